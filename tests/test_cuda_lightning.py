"""Lightning's Trainer on a GPU with ``LowbandStrategy``: one rank on cuda:0 over NCCL
(``accelerator="gpu"``), for powersgd, compressed (1-bit, two-stage), dreamddp, diloco (streamed
fragments with a delay) and the bf16 precision plugin, against the same fit on the CPU over gloo: the
model stays on the GPU, the losses are finite and equal the CPU's up to float32 rounding, and a
checkpoint saved after the first epoch on the GPU resumes there exactly.

Marked ``cuda``: skipped without a GPU (or without Lightning), run by ``scripts/gpu-check``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import integration_fixtures as fx  # noqa: E402

from lowband.integrations.lightning import LowbandStrategy  # noqa: E402
from lowband.testing import run_processes  # noqa: E402
from tests.test_integrations_lightning import LitNet, loader  # noqa: E402

RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "powersgd": ("powersgd", {"rank": 1, "start_iter": 2}),
    "compressed": ("compressed", {"compressor": "onebit", "reducer": "twostage"}),
    "dreamddp": ("dreamddp", {"period": 2, "trial_periods": 0}),
    "diloco": ("diloco", {"inner_steps": 4, "fragments": 2, "delay": 1, "compressor": "topk:ratio=0.3"}),
}
TOL = 1e-4  # relative: float32 on a GPU against the CPU (other kernels, other summation orders)


class DevNet(LitNet):
    """Records the device its parameters are on while it trains (Lightning moves the module back to
    the CPU when a fit ends)."""

    seen: str = ""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.seen = str(next(self.parameters()).device)
        return super().training_step(batch, batch_idx)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _trainer(accelerator: str, strategy: LowbandStrategy, epochs: int, **kwargs: Any) -> Any:
    return pl.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, max_epochs=epochs, use_distributed_sampler=False,
        enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip


def _fits(accelerator: str, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, (name, opts) in RUNS.items():
        if name == "dreamddp":
            opts = {**opts, "profile": str(Path(folder) / f"{accelerator}-profile.json")}
        model = DevNet()
        s = LowbandStrategy(name, **opts)
        _trainer(accelerator, s, 2).fit(model, loader(0))
        device = model.seen
        assert s.lowband is not None
        s.lowband.close()
        out[key] = {"losses": model.losses, "device": device}
    # bf16 autocast through Lightning's precision plugin (on the GPU: CUDA autocast)
    model = DevNet()
    s = LowbandStrategy("powersgd", **RUNS["powersgd"][1])
    _trainer(accelerator, s, 2, precision="bf16-mixed").fit(model, loader(0))
    assert s.lowband is not None
    s.lowband.close()
    out["bf16"] = {"losses": model.losses, "device": model.seen}
    # a first epoch saved, resumed (on the GPU: the point)
    name, opts = RUNS["diloco"]
    first = LitNet()
    s = LowbandStrategy(name, **opts)
    tr = _trainer(accelerator, s, 1)
    tr.fit(first, loader(0))
    ckpt = str(Path(folder) / "diloco.ckpt")
    tr.save_checkpoint(ckpt)
    assert s.lowband is not None
    s.lowband.close()
    resumed = LitNet()
    s = LowbandStrategy(name, **opts)
    _trainer(accelerator, s, 2).fit(resumed, loader(0), ckpt_path=ckpt)
    assert s.lowband is not None
    s.lowband.close()
    out["resume"] = {"first": first.losses, "resumed": resumed.losses}
    return out


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


@pytest.mark.cuda
@cuda
def test_lightning_fits_on_a_gpu_as_on_the_cpu(tmp_path: Path) -> None:
    (gpu,) = run_processes(_fits, 1, "gpu", str(tmp_path), timeout=300, backend="nccl", device="cuda")
    (cpu,) = run_processes(_fits, 1, "cpu", str(tmp_path), timeout=300, backend="gloo", device="cpu")
    failures = []
    for key in [*RUNS, "bf16"]:
        g, c = gpu[key], cpu[key]
        print(f"{key:10s} gpu {g['losses'][-2:]} cpu {c['losses'][-2:]} on {g['device']}")
        if not g["device"].startswith("cuda"):
            failures.append(f"{key}: the model left the GPU ({g['device']})")
        if len(g["losses"]) != fx.STEPS or not all(torch.isfinite(torch.tensor(g["losses"]))):
            failures.append(f"{key}: {len(g['losses'])} losses on the GPU, want {fx.STEPS} finite ones")
        tol_ok = key == "bf16" or all(_close(a, b) for a, b in zip(g["losses"], c["losses"]))
        if not tol_ok:
            failures.append(f"{key}: GPU losses {g['losses']} differ from the CPU's {c['losses']}")
    r = gpu["resume"]
    whole = gpu["diloco"]["losses"]
    if r["first"] + r["resumed"] != whole:
        failures.append(f"diloco resumed on the GPU: {r['first'] + r['resumed']} != {whole}")
    assert not failures, "\n".join(failures)
