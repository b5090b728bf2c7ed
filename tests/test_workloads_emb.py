"""Embedding-dominated workloads: the sampled-softmax word LM and the word transformer.

Batches and negatives deterministic per (seed, rank, step), disjoint shards, ids inside the vocabulary,
the sampled loss against a per-row reference, evaluation against a hand-computed full softmax, and the
parameter shares the workloads are built for.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lowband.bench.workloads import SampledWordLMWorkload, WordGPTWorkload, get_workload
from lowband.bench.workloads.sampled_softmax import (
    draw_negatives,
    log_uniform_log_q,
    negatives_generator,
    sampled_softmax_loss,
)
from lowband.bench.workloads.text import GPT
from lowband.bench.workloads.wordlm_sampled import SampledWordLM
from lowband.errors import InvalidArgumentError
from lowband.sparse.lazy import lazy_optimizer, lazy_step, sparse_rows

TINY = {"vocab_size": 60, "embed_dim": 6, "context": 3, "hidden": 10, "negatives": 9}


def _tiny() -> SampledWordLMWorkload:
    w = get_workload("wordlm-sampled", **TINY)
    assert isinstance(w, SampledWordLMWorkload)
    return w


def _q(k: int, v: int) -> float:
    return math.log((k + 2) / (k + 1)) / math.log(v + 1)


def _reference_loss(h: torch.Tensor, out: torch.Tensor, targets: list[int], negs: list[int], v: int) -> float:
    """Mean over rows of -log softmax at the target, candidates [t] + negatives != t, logits h.u - log q."""
    total = 0.0
    for i, t in enumerate(targets):
        cands = [t] + [n for n in negs if n != t]
        logits = [float(h[i] @ out[c]) - math.log(_q(c, v)) for c in cands]
        top = max(logits)
        total += -(logits[0] - top - math.log(sum(math.exp(a - top) for a in logits)))
    return total / len(targets)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(0, 6), st.integers(2, 9), st.integers(0, 999))
def test_sampled_softmax_loss_matches_per_row_reference(b: int, k: int, v: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, 3, generator=g, dtype=torch.float64)
    out = torch.randn(v, 3, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (b,), generator=g)
    negs = torch.randint(0, v, (k,), generator=g)  # duplicates and accidental hits included
    got = sampled_softmax_loss((h * out[targets]).sum(1), h @ out[negs].T, targets, negs, v)
    want = _reference_loss(h, out, targets.tolist(), negs.tolist(), v)
    assert abs(float(got) - want) < 1e-12 * max(1.0, abs(want))


def test_log_uniform_proposal_and_sampler() -> None:
    v = 8
    log_q = log_uniform_log_q(torch.arange(v), v)
    assert torch.allclose(log_q.exp(), torch.tensor([_q(k, v) for k in range(v)], dtype=torch.float64))
    assert abs(float(log_q.exp().sum()) - 1.0) < 1e-12
    n = 200_000
    ids = draw_negatives(v, n, torch.Generator().manual_seed(1))
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < v
    freq = torch.bincount(ids, minlength=v).double() / n
    sigma = (log_q.exp() * (1 - log_q.exp()) / n).sqrt()
    assert ((freq - log_q.exp()).abs() < 5 * sigma).all(), (freq, log_q.exp())
    assert draw_negatives(v, 0, torch.Generator().manual_seed(1)).numel() == 0


def test_batches_and_negatives_deterministic_per_seed_rank_step() -> None:
    w = _tiny()
    first = list(itertools.islice(w.batches(1, 3, 5, seed=4), 4))
    again = list(itertools.islice(w.batches(1, 3, 5, seed=4), 4))
    for step, ((x1, y1), (x2, y2)) in enumerate(zip(first, again)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert x1.shape == (5, TINY["context"]) and y1.shape == (5 + TINY["negatives"],)
        assert torch.equal(y1[5:], w.negatives(4, 1, step))  # the negatives travel in the batch
    negs = w.negatives(4, 1, 2)
    assert torch.equal(negs, w.negatives(4, 1, 2))
    for other in (w.negatives(5, 1, 2), w.negatives(4, 0, 2), w.negatives(4, 1, 3)):
        assert not torch.equal(negs, other)
    assert torch.equal(  # the same stream as the documented generator
        negs, draw_negatives(w.vocab_size, TINY["negatives"], negatives_generator(4, 1, 2))
    )
    model = w.build_model(0)
    assert torch.equal(w.loss(model, first[2]), w.loss(model, again[2]))
    assert isinstance(w.make_optimizer(model.parameters()), torch.optim.Adagrad)
    assert w.items(first[0]) == 5


@pytest.mark.parametrize("name", ["wordlm-sampled", "wordgpt"])
def test_rank_shards_disjoint(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    w = get_workload(name, vocab_size=TINY["vocab_size"])
    seen: dict[int, set[int]] = {}
    real = w._train_batch
    for rank in range(4):
        got: set[int] = set()

        def record(idx: torch.Tensor, got: set[int] = got) -> tuple[torch.Tensor, torch.Tensor]:
            got.update(idx.tolist())
            return real(idx)

        monkeypatch.setattr(w, "_train_batch", record)
        list(itertools.islice(w.batches(rank, 4, 8, seed=0), 5))
        assert len(got) == 40 and got <= set(w.shard_indices(rank, 4).tolist())
        seen[rank] = got
    for a, b in itertools.combinations(range(4), 2):
        assert not seen[a] & seen[b], (a, b)


@pytest.mark.parametrize("name", ["wordlm-sampled", "wordgpt"])
def test_ids_inside_the_vocabulary(name: str) -> None:
    w = get_workload(name, vocab_size=TINY["vocab_size"])
    v = len(w.data.vocab)
    assert v == TINY["vocab_size"]
    for x, y in itertools.islice(w.batches(2, 3, 16, seed=1), 6):
        for ids in (x, y):
            assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < v
    x, y = w._test_batch(torch.arange(4))
    assert int(torch.cat([x.flatten(), y.flatten()]).max()) < v


def test_sampled_loss_of_the_model_matches_reference() -> None:
    w = _tiny()
    model = w.build_model(3).double()
    assert isinstance(model, SampledWordLM)
    x, y = next(w.batches(0, 2, 7, seed=9))
    loss = w.loss(model, (x, y))
    h = model.mlp(model.embed.weight[x].flatten(1)).detach()
    want = _reference_loss(h, model.out_emb.weight.detach(), y[:7].tolist(), y[7:].tolist(), w.vocab_size)
    assert abs(float(loss.detach()) - want) < 1e-12
    loss.backward()
    for table, ids in ((model.embed, x), (model.out_emb, y)):  # row-sparse gradients of both tables
        grad = table.weight.grad
        assert grad is not None
        touched = set(grad.abs().sum(dim=1).nonzero().flatten().tolist())
        assert touched and touched <= set(ids.flatten().tolist())
    ids = w.lookup_ids((x, y))
    assert set(ids) == {"embed", "out_emb"} and ids["embed"] is x and ids["out_emb"] is y


def test_evaluation_is_the_full_softmax() -> None:
    w = _tiny()
    model = w.build_model(1)
    assert isinstance(model, SampledWordLM)
    with torch.no_grad():  # make the output rows matter: a sampled loss would now differ clearly
        model.out_emb.weight.mul_(20.0)
    n = 50
    res = w.evaluate(model, max_items=n)
    x, t = w._test_batch(torch.arange(n))
    with torch.no_grad():
        h = model.mlp(model.embed.weight[x].flatten(1)).double()
        logits = h @ model.out_emb.weight.double().T  # (n, V): every word of the vocabulary
    want = float((torch.logsumexp(logits, dim=1) - logits[torch.arange(n), t]).mean())
    assert abs(res.loss - want) < 1e-4 * want
    assert res.accuracy == float((logits.argmax(dim=1) == t).double().mean())
    negs = w.negatives(0, 0, 0)
    sampled = w.loss(model, (x, torch.cat([t, negs])))
    assert (
        abs(float(sampled.detach()) - res.loss) > 0.05
    )  # what an evaluation over the negatives would report


def test_sampled_lm_is_embedding_dominated() -> None:
    w = get_workload("wordlm-sampled")
    model = w.build_model(0)
    assert isinstance(model, SampledWordLM)
    tables = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    assert [t.sparse for t in tables] == [False, False] and {t.weight.shape for t in tables} == {
        (w.vocab_size, 192)
    }
    total = sum(p.numel() for p in model.parameters())
    assert model.embedding_parameters() / total > 0.9
    assert "% in embedding tables" in w.describe() and "512 log-uniform negatives" in w.describe()


def test_wordgpt_has_an_untied_input_table() -> None:
    w = get_workload("wordgpt", vocab_size=TINY["vocab_size"], block_size=8, n_embd=16, n_layer=2)
    assert isinstance(w, WordGPTWorkload)
    model = w.build_model(0)
    assert isinstance(model, GPT) and model.head.weight is not model.wte.weight
    assert "untied" in w.describe() and "Shakespeare words" in w.describe()
    x, y = next(w.batches(0, 2, 4, seed=3))
    assert x.shape == y.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert w.items((x, y)) == 32
    loss = w.loss(model, (x, y))
    assert torch.equal(loss, w.loss(model, next(w.batches(0, 2, 4, seed=3))))
    loss.backward()
    grad = model.wte.weight.grad
    assert grad is not None
    assert set(grad.abs().sum(dim=1).nonzero().flatten().tolist()) <= set(x.flatten().tolist())
    assert set(w.lookup_ids((x, y))) == {"wte", "wpe"}
    char_model = get_workload("shakespeare-gpt", n_embd=16, n_layer=1, block_size=8).build_model(0)
    assert isinstance(char_model, GPT) and char_model.head.weight is char_model.wte.weight


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="negatives must be an int >= 1"):
        get_workload("wordlm-sampled", negatives=0)
    with pytest.raises(
        InvalidArgumentError, match="workload 'wordgpt': vocab_size must be an int >= 2, got 1"
    ):
        get_workload("wordgpt", vocab_size=1)
    with pytest.raises(InvalidArgumentError, match="do not match 2 targets and 3 negatives"):
        sampled_softmax_loss(
            torch.zeros(2), torch.zeros(2, 2), torch.zeros(2).long(), torch.zeros(3).long(), 5
        )
    with pytest.raises(InvalidArgumentError, match="step must be an int >= 0"):
        negatives_generator(0, 0, -1)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's Adagrad on sparse gradients
@pytest.mark.parametrize("name", ["wordlm-sampled", "wordgpt"])
def test_optimizer_updates_only_touched_rows_and_accepts_sparse_gradients(name: str) -> None:
    opts = {"vocab_size": TINY["vocab_size"]}
    if name == "wordgpt":
        opts |= {"block_size": 8, "n_embd": 16, "n_layer": 1}
    w = get_workload(name, **opts)
    batch = next(w.batches(1, 2, 4, seed=2))
    models = [w.build_model(5).double() for _ in range(2)]
    for table in models[1].modules():
        if isinstance(table, nn.Embedding):
            table.sparse = True  # what a sparse-gradient strategy does
    for model in models:
        opt = w.make_optimizer(model.parameters())
        w.loss(model, batch).backward()
        opt.step()
    before = w.build_model(5).double().state_dict()
    dense, sparse = models[0].state_dict(), models[1].state_dict()
    for key in dense:
        assert torch.allclose(dense[key], sparse[key], rtol=0, atol=1e-12), key
    for key, ids in w.lookup_ids(batch).items():
        if key == "wpe":
            continue  # the position table: every row is read every step
        weight = f"{key}.weight"
        untouched = torch.ones(before[weight].shape[0], dtype=torch.bool)
        untouched[ids.flatten()] = False
        assert untouched.any() and torch.equal(dense[weight][untouched], before[weight][untouched])
        assert not torch.equal(dense[weight][~untouched], before[weight][~untouched])


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_split_table_updates_equal_one_update() -> None:
    """The workloads' Adagrad is a lazy optimizer: a table's gradient applied in two parts of disjoint
    rows (the vertical schedule) equals one dense update, over several iterations."""
    w = _tiny()
    g = torch.Generator().manual_seed(4)
    shape = (w.vocab_size, TINY["embed_dim"])
    start = torch.randn(shape, generator=g, dtype=torch.float64)
    whole, split = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    dense_opt = w.make_optimizer([whole])
    lazy_opt = lazy_optimizer(w.make_optimizer([split]), where="test")
    for iteration in (1, 2, 3):
        rows = torch.randperm(w.vocab_size, generator=g)[:20]
        grad = torch.zeros(shape, dtype=torch.float64)
        grad[rows] = torch.randn(20, shape[1], generator=g, dtype=torch.float64)
        whole.grad = grad
        dense_opt.step()
        for part in (rows[:7], rows[7:]):
            lazy_step(lazy_opt, {split: sparse_rows(part, grad[part], split.shape)}, iteration)
        assert torch.allclose(whole, split, rtol=0, atol=1e-12), iteration
    with pytest.raises(InvalidArgumentError, match="Adagrad with weight decay"):
        lazy_optimizer(torch.optim.Adagrad([split], weight_decay=0.1), where="test")
