"""``diloco`` on a GPU: 2 real processes sharing one GPU over gloo (CUDA tensors), against the same run on
the CPU, for each of its parts: the published outer loop, streamed fragments with a delay and mixing,
SparseLoCo's chunked top-k + 2-bit with error feedback, DeMo's DCT top-k, a gossip outer step; and an
exact resume from a ``state_dict`` saved on the GPU mid-fragment (exchange in flight), read back through
``torch.load(map_location="cpu")`` as users do, into a fresh GPU strategy.

Marked ``cuda``: skipped without a GPU, run by ``scripts/gpu-check``. In float64 the GPU's arithmetic
differs from the CPU's only in summation order, so every variant must end within 1e-9 of the CPU run.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import lowband
from lowband.strategies import make_strategy
from lowband.testing import run_processes
from tests import embedding_model as em

STEPS = 9
TOL = 1e-9
VARIANTS: dict[str, dict[str, Any]] = {
    "published": {"inner_steps": 2},
    "streaming": {"inner_steps": 4, "fragments": 2, "delay": 1, "alpha": 0.5},
    "sparseloco": {
        "inner_steps": 2,
        "compressor": "chunktopk:chunk=8;ratio=0.25;bits=2",
        "outer": "sgd:lr=1.0",
    },
    "streaming+compressed": {"inner_steps": 4, "fragments": 2, "delay": 1, "compressor": "topk:ratio=0.3"},
    "demo": {"inner_steps": 3, "compressor": "dct-topk:chunk=8;topk=2"},
    "gossip": {"inner_steps": 2, "topology": "dynamic-exp2"},
}

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _flat(m: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1).cpu() for p in m.parameters()]).tolist()


def _step(s: object, dev: torch.device, k: int) -> float:
    b = tuple(t.to(dev) for t in em.batch(lowband.rank(), k))
    return float(s.train_step(lambda mod, b=b: em.loss(mod, b)))  # type: ignore[attr-defined]


def _train(dev_type: str) -> dict[str, object]:
    dev = lowband.device()
    assert dev.type == dev_type, (dev, dev_type)
    out: dict[str, object] = {}
    for name, opts in VARIANTS.items():
        m = em.model(seed=5).to(dev)
        s = make_strategy("diloco", m, em.sgd, **opts)
        losses = [_step(s, dev, k) for k in range(STEPS)]
        s.synchronize()
        assert all(p.device.type == dev_type for p in m.parameters()), name
        out[name] = {"losses": losses, "flat": _flat(m)}
        s.close()
    return out


def _resume(dev_type: str) -> tuple[list[float], list[float]]:
    """5 steps, save (mid-period, fragment 0's exchange in flight), 4 more; and a fresh strategy that
    loads the saved state through bytes and ``map_location="cpu"`` and runs the same 4 steps."""
    dev = lowband.device()
    assert dev.type == dev_type, (dev, dev_type)
    opts = VARIANTS["streaming+compressed"]
    m1 = em.model(seed=5).to(dev)
    s1 = make_strategy("diloco", m1, em.sgd, **opts)
    for k in range(5):
        _step(s1, dev, k)
    buf = io.BytesIO()
    torch.save({"model": m1.state_dict(), "strategy": s1.state_dict()}, buf)  # type: ignore[attr-defined]
    for k in range(5, STEPS):
        _step(s1, dev, k)
    s1.synchronize()
    buf.seek(0)
    saved = torch.load(buf, map_location="cpu", weights_only=False)
    m2 = em.model(seed=7).to(dev)
    s2 = make_strategy("diloco", m2, em.sgd, broadcast_init=False, **opts)
    m2.load_state_dict(saved["model"])
    s2.load_state_dict(saved["strategy"])  # type: ignore[attr-defined]
    for k in range(5, STEPS):
        _step(s2, dev, k)
    s2.synchronize()
    assert all(p.device.type == dev_type for p in m2.parameters())
    out = _flat(m1), _flat(m2)
    s1.close()
    s2.close()
    return out


@pytest.mark.cuda
@cuda
def test_every_diloco_variant_on_a_gpu_matches_the_cpu() -> None:
    gpu = run_processes(_train, 2, "cuda", timeout=300, backend="gloo", device="cuda")
    cpu = run_processes(_train, 2, "cpu", timeout=300, backend="gloo", device="cpu")
    failures, report = [], []
    for r in range(2):
        for name in VARIANTS:
            c, g = cpu[r][name], gpu[r][name]
            diff = (torch.tensor(c["flat"]) - torch.tensor(g["flat"])).abs().max().item()
            report.append(f"rank {r} {name:22s} max |gpu - cpu| = {diff:.3g}  gpu losses {g['losses'][-3:]}")
            if not torch.isfinite(torch.tensor(g["losses"])).all():
                failures.append(f"rank {r} {name}: non-finite loss on the GPU")
            if not diff <= TOL:
                failures.append(f"rank {r} {name}: GPU and CPU runs differ by {diff:.3g} > {TOL}")
    print("\n".join(report))
    assert not failures, "\n".join(failures) + "\n" + "\n".join(report)


@pytest.mark.cuda
@cuda
def test_diloco_resumes_exactly_from_a_gpu_state_dict_loaded_to_the_cpu() -> None:
    for a, b in run_processes(_resume, 2, "cuda", timeout=300, backend="gloo", device="cuda"):
        assert a == b
