"""The decentralized strategies' default topology is sparse at every world size: ``atc`` and ``awc``
send one model copy per rank per step (to one peer) at 2, 3 and 4 ranks, no more than a ring allreduce
(DDP) sends, where the static exponential-2 graph (the former default) is the full graph at 3 ranks
and sends two copies. Bytes are lowband's own counters (the logical traffic) of the neighbor
averaging."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.decentral.strategies import DEFAULT_TOPOLOGY
from lowband.strategies import make_strategy
from lowband.testing import run_threads

STEPS = 4
_SEED_LOCK = threading.Lock()  # ranks are threads sharing torch's global generator


def _model() -> nn.Module:
    with _SEED_LOCK:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _model_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in _model().parameters())


def _bytes_per_step(spec: str, opts: dict[str, Any]) -> dict[str, Any]:
    r = lowband.rank()
    s = make_strategy(spec, _model(), lambda ps: torch.optim.SGD(ps, lr=0.05), **opts)
    g = torch.Generator().manual_seed(r)

    def step() -> None:
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        s.train_step(lambda m: ((m(x) - y) ** 2).mean())
        s.synchronize()

    step()  # the topology check runs on the first step only
    lowband.barrier()
    lowband.reset_trace()
    for _ in range(STEPS):
        step()
    # the parameters' traffic (the per-step non-finite agreement is a few bytes of allreduce besides)
    sent = sum(c["bytes_sent"] for op, c in lowband.counters().items() if "neighbor" in op)
    out = {"sent": sent / STEPS, "label": s.label()}
    s.close()
    return out


@pytest.mark.parametrize("spec", ["atc", "awc"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_default_topology_sends_one_copy_per_step(spec: str, n: int) -> None:
    copy = _model_bytes()
    ring = 2 * (n - 1) / n * copy  # a ring allreduce of the gradients (DDP)
    for res in run_threads(_bytes_per_step, n, spec, {}, timeout=120, trace=True):
        assert f"topology={DEFAULT_TOPOLOGY}" in res["label"], res["label"]
        assert res["sent"] == copy, (res["sent"], copy)
        assert res["sent"] <= ring


def test_the_static_exponential_graph_is_full_at_three_ranks() -> None:
    """What the default avoids: ``exp2`` at 3 ranks sends to both others (1.5x a ring allreduce)."""
    copy = _model_bytes()
    for res in run_threads(_bytes_per_step, 3, "atc", {"topology": "exp2"}, timeout=120, trace=True):
        assert res["sent"] == 2 * copy
