"""BlueFog-style training programs (examples/bluefog/) run unchanged but for the import line, at 3 and 4
thread-ranks: the synthetic benchmark loop with every distributed optimizer, and an MNIST-style loop on
scikit-learn's offline digits (static and one-peer dynamic topologies) that must learn."""

from __future__ import annotations

import math

import pytest
import torch
from bluefog_examples import run_example

SIZES = (3, 4)
OPTIMIZERS = ["neighbor_allreduce", "allreduce", "gradient_allreduce", "win_put",
              "hierarchical_neighbor_allreduce", "adapt_then_combine"]  # fmt: skip


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dist_optimizer", OPTIMIZERS)
def test_synthetic_benchmark_loop(monkeypatch: pytest.MonkeyPatch, dist_optimizer: str, n: int) -> None:
    argv = ["--batch-size", "8", "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2",
            "--dist-optimizer", dist_optimizer]  # fmt: skip
    outs = run_example(monkeypatch, "pytorch_benchmark.py", argv, n, ["img_secs", "total", "model"])
    totals = [float(o["total"]) for o in outs]
    for o in outs:
        assert len(o["img_secs"]) == 2 and all(v > 0 and math.isfinite(v) for v in o["img_secs"])
        assert all(torch.isfinite(p).all() for p in o["model"].parameters())
    assert totals == pytest.approx([sum(sum(o["img_secs"]) / 2 for o in outs)] * n)
    if dist_optimizer == "gradient_allreduce":
        # averaged gradients from the same broadcast start: the models stay identical
        first = [p.detach() for p in outs[0]["model"].parameters()]
        for o in outs[1:]:
            for a, b in zip(first, o["model"].parameters()):
                torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-6)


MNIST = {
    "neighbor_allreduce": [],
    "adapt_then_combine": [],
    "gradient_allreduce": [],
    "win_put": [],
    "neighbor_allreduce-dynamic": ["--enable-dynamic-topology"],
    "win_put-dynamic": ["--enable-dynamic-topology"],
}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("case", sorted(MNIST))
def test_mnist_style_training_learns_the_digits(monkeypatch: pytest.MonkeyPatch, case: str, n: int) -> None:
    argv = ["--dist-optimizer", case.split("-")[0], "--epochs", "4", *MNIST[case]]
    outs = run_example(monkeypatch, "pytorch_mnist.py", argv, n, ["accuracy"])
    accuracies = [o["accuracy"] for o in outs]
    assert accuracies == pytest.approx([accuracies[0]] * n)  # allreduce-averaged metric, the same everywhere
    assert accuracies[0] > 0.85, (case, accuracies[0])
