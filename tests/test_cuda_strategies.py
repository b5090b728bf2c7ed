"""Every registered strategy with its model on a GPU: 2 real processes sharing one GPU over gloo (CUDA
tensors, host-staged by gloo), against the same run on the CPU.

Marked ``cuda``: skipped without a GPU, run by ``scripts/gpu-check``. The model (two embedding tables
and an MLP, float64, from tests/embedding_model.py) suits every strategy, dense and embedding ones. In
float64 the GPU's arithmetic differs from the CPU's only in summation order, so the deterministic
strategies must end within 1e-9 of the CPU run; those whose choices depend on measured timings
(DreamDDP's schedule, SlimGC's BestCT, ...) must train (finite losses, every rank's replica part in
sync where the strategy promises it) and are reported with their distance.
"""

from __future__ import annotations

import pytest
import torch

import lowband
from lowband.errors import InvalidArgumentError
from lowband.strategies import make_strategy, strategy_names
from lowband.testing import run_processes
from tests import embedding_model as em

STEPS = 3
#: strategies whose result does not depend on timings: GPU == CPU up to float64 rounding
DETERMINISTIC = {
    "ddp", "stage", "powersgd", "localsgd", "compressed", "topk-allgather", "gradient-allreduce", "atc",
    "awc", "gs-sgd", "gtopk", "sketched-sgd", "embrace", "ddp-sparse", "sparse-allgather", "embedding-ps",
}  # fmt: skip
TOL = 1e-9

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _train(dev_type: str) -> dict[str, object]:
    dev = lowband.device()
    assert dev.type == dev_type, (dev, dev_type)
    out: dict[str, object] = {}
    for name in strategy_names():
        m = em.model(seed=5).to(dev)
        try:
            s = make_strategy(name, m, em.sgd)
        except InvalidArgumentError as exc:
            out[name] = f"refused: {exc}"
            continue
        losses = []
        for step in range(STEPS):
            b = tuple(t.to(dev) for t in em.batch(lowband.rank(), step))
            losses.append(float(s.train_step(lambda mod, b=b: em.loss(mod, b))))
        s.synchronize()
        # this rank's parameters (its shards, for the strategies that partition tables)
        flat = torch.cat([p.detach().reshape(-1).cpu() for p in m.parameters()])
        out[name] = {"losses": losses, "flat": flat.tolist(), "device": str(next(m.parameters()).device)}
        s.close()
    return out


@pytest.mark.cuda
@cuda
def test_every_strategy_on_a_gpu_matches_the_cpu() -> None:
    gpu = run_processes(_train, 2, "cuda", timeout=600, backend="gloo", device="cuda")
    cpu = run_processes(_train, 2, "cpu", timeout=600, backend="gloo", device="cpu")
    report: list[str] = []
    failures: list[str] = []
    for name in sorted(cpu[0]):
        c, g = cpu[0][name], gpu[0][name]
        if isinstance(c, str) or isinstance(g, str):
            report.append(f"{name:20s} cpu: {str(c)[:60]} | gpu: {str(g)[:60]}")
            if isinstance(c, str) != isinstance(g, str):
                failures.append(f"{name}: refused on one device only: cpu {c!r}, gpu {g!r}")
            continue
        assert isinstance(c, dict) and isinstance(g, dict)
        if not g["device"].startswith("cuda"):
            failures.append(f"{name}: the model left the GPU ({g['device']})")
        finite = all(torch.isfinite(torch.tensor(r[name]["losses"])).all() for r in gpu)  # type: ignore[index]
        diff = (torch.tensor(c["flat"]) - torch.tensor(g["flat"])).abs().max().item()
        report.append(f"{name:20s} max |gpu - cpu| = {diff:.3g}  gpu losses {g['losses']}")
        if not finite:
            failures.append(f"{name}: non-finite loss on the GPU")
        if name in DETERMINISTIC and not diff <= TOL:
            failures.append(f"{name}: GPU and CPU runs differ by {diff:.3g} > {TOL}")
    print("\n".join(report))
    assert not failures, "\n".join(failures) + "\n" + "\n".join(report)


def _resume_all() -> dict[str, object]:
    """Per strategy: 3 steps, a checkpoint through bytes, 2 more; and a fresh strategy that reads the
    checkpoint with ``map_location="cpu"`` (as users load one) and runs the same 2 steps."""
    import io

    dev = lowband.device()
    out: dict[str, object] = {}
    for name in strategy_names():
        try:
            m1 = em.model(seed=5).to(dev)
            s1 = make_strategy(name, m1, em.sgd)
        except InvalidArgumentError as exc:
            out[name] = f"refused: {exc}"
            continue

        def step(s: object, k: int) -> None:
            b = tuple(t.to(dev) for t in em.batch(lowband.rank(), k))
            s.train_step(lambda mod, b=b: em.loss(mod, b))  # type: ignore[attr-defined]

        for k in range(3):
            step(s1, k)
        buf = io.BytesIO()
        torch.save({"model": m1.state_dict(), "strategy": s1.state_dict()}, buf)
        for k in range(3, 5):
            step(s1, k)
        s1.synchronize()
        buf.seek(0)
        saved = torch.load(buf, map_location="cpu", weights_only=False)
        m2 = em.model(seed=5).to(dev)
        s2 = make_strategy(name, m2, em.sgd)
        m2.load_state_dict(saved["model"])
        s2.load_state_dict(saved["strategy"])
        for k in range(3, 5):
            step(s2, k)
        s2.synchronize()
        flat = [torch.cat([p.detach().reshape(-1).cpu() for p in m.parameters()]) for m in (m1, m2)]
        out[name] = {
            "diff": (flat[0] - flat[1]).abs().max().item(),
            "finite": bool(torch.isfinite(flat[1]).all()),
            "device": str(next(m2.parameters()).device),
        }
        s1.close()
        s2.close()
    return out


def check_resume_all(device: str) -> None:
    got = run_processes(_resume_all, 2, timeout=600, backend="gloo", device=device)
    failures = []
    for r, res in enumerate(got):
        for name, v in res.items():
            if isinstance(v, str):
                continue
            assert isinstance(v, dict)
            if not v["device"].startswith(device):
                failures.append(f"rank {r} {name}: the resumed model is on {v['device']}")
            if not v["finite"]:
                failures.append(f"rank {r} {name}: non-finite parameters after the resume")
            if name in DETERMINISTIC and not v["diff"] <= TOL:
                failures.append(
                    f"rank {r} {name}: resumed run differs from the uninterrupted by {v['diff']:.3g}"
                )
    assert not failures, "\n".join(failures)


@pytest.mark.cuda
@cuda
def test_every_strategy_resumes_on_a_gpu_from_a_checkpoint_read_to_the_cpu() -> None:
    check_resume_all("cuda")
