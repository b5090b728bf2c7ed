"""``lowband bench --device`` and ``--precision``: parsing, the errors before anything starts, and tiny
runs (CPU here; CUDA-marked ones where a GPU exists)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import lowband
from lowband.bench import precision as prec
from lowband.bench.cli import add_parsers, config_from_args
from lowband.bench.config import BenchConfig
from lowband.bench.runner import run_bench
from lowband.errors import InvalidArgumentError
from lowband.strategies import make_strategy
from lowband.testing import run_threads

CUDA = torch.cuda.is_available()


def _parse(*argv: str) -> BenchConfig:
    p = argparse.ArgumentParser()
    add_parsers(p.add_subparsers(dest="cmd"))
    return config_from_args(p.parse_args(["bench", *argv]), "bench")


def test_flags_parse_into_the_config() -> None:
    cfg = _parse("--device", "cpu", "--precision", "bf16")
    assert (cfg.device, cfg.precision) == ("cpu", "bf16")
    dflt = _parse()
    assert (dflt.device, dflt.precision) == ("auto", "fp32")
    with pytest.raises(SystemExit):  # argparse refuses other words
        _parse("--precision", "fp8")
    assert prec.device_type("auto") == ("cuda" if CUDA else "cpu")


def _tiny(tmp_path: Path, **kw: object) -> BenchConfig:
    base = BenchConfig(
        workload="fmnist-cnn", strategies=["ddp"], world_size=2, rate=None, mode="loopback", rounds=2,
        steps_per_round=3, warmup_rounds=1, eval_items=32, out_dir=str(tmp_path / "out"),
    )  # fmt: skip
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


@pytest.mark.skipif(CUDA, reason="checks the error where CUDA is missing")
def test_cuda_without_cuda_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"--device cuda asked for but CUDA is not available.*--device cpu"
    ):
        _tiny(tmp_path, device="cuda").validate()


def test_bad_device_and_precision_words(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="device must be one of auto, cpu, cuda, got 'gpu'"):
        _tiny(tmp_path, device="gpu").validate()
    with pytest.raises(InvalidArgumentError, match="precision must be one of fp32, bf16, fp16, got 'fp8'"):
        _tiny(tmp_path, device="cpu", precision="fp8").validate()


def test_precision_without_autocast_support_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    prec.check_precision("w", "fp16", "cpu")  # torch 2.13 has fp16 autocast on the CPU
    prec.check_precision("w", "bf16", "cpu")
    monkeypatch.setattr(prec, "_autocast_works", lambda _t, _d: False)  # as an older torch
    with pytest.raises(InvalidArgumentError, match="no fp16 autocast on cpu; use --precision bf16"):
        prec.check_precision("w", "fp16", "cpu")


def test_fp16_refuses_strategies_without_a_safe_scaler_path(tmp_path: Path) -> None:
    cfg = _tiny(tmp_path, device="cpu", precision="fp16", strategies=["ddp", "slimgc", "dreamddp:period=2"])
    with pytest.raises(InvalidArgumentError) as e:
        cfg.validate()
    msg = str(e.value)
    assert "needs a loss scaler" in msg and "'slimgc'" in msg and "'dreamddp'" in msg and "'ddp'" not in msg
    assert "use --precision bf16" in msg
    _tiny(
        tmp_path, device="cpu", precision="fp16", strategies=["ddp", "powersgd", "compressed", "gs-sgd"]
    ).validate()


def test_a_model_on_another_device_is_refused() -> None:
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(
        InvalidArgumentError, match=r"'weight' on meta but the bench runs on cpu.*--device meta"
    ):
        prec.check_model_device("lowband bench", meta, "cpu")
    prec.check_model_device("lowband bench", nn.Linear(2, 2), "cuda")  # CPU models are moved by the bench


def _cpu_model_on_a_cuda_rank() -> str:
    lowband.runtime.current().device = torch.device("cuda", 0)  # as a rank bound to a GPU
    try:
        make_strategy("stage", nn.Linear(2, 2), lambda ps: torch.optim.SGD(ps, lr=0.1))
    except InvalidArgumentError as e:
        return str(e)
    return ""


def test_make_strategy_refuses_a_model_on_the_wrong_device() -> None:
    msg = run_threads(_cpu_model_on_a_cuda_rank, 1, timeout=30)[0]
    assert "parameter 'weight' is on cpu but this rank computes on cuda:0" in msg
    assert "model.to(lowband.device())" in msg


def test_move_batch_and_autocast_keep_devices() -> None:
    batch = {"x": (torch.ones(2, 3), [torch.zeros(2)]), "n": 3}
    with torch.device("meta"):  # nothing is made without an explicit device
        out = prec.move_batch(batch, torch.device("cpu"))
    assert out["x"][0].device.type == "cpu" and out["x"][1][0].device.type == "cpu" and out["n"] == 3
    lin = nn.Linear(3, 2)
    loss = prec.autocast_loss(lambda mod, b: mod(b).sum(), torch.ones(4, 3), torch.device("cpu"), "bf16")(lin)
    assert loss.dtype == torch.bfloat16 and lin.weight.dtype == torch.float32  # autocast inside, fp32 params
    assert prec.grad_scaler(torch.device("cpu"), "fp16") is not None
    assert prec.grad_scaler(torch.device("cpu"), "bf16") is None


def _check_run(res: dict[str, object], out: Path, device: str, precision: str, keys: set[str]) -> None:
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["device"] == device and on_disk["precision"] == precision
    assert on_disk["config"]["precision"] == precision
    rows = on_disk["summary"]["strategies"]
    assert set(rows) == keys
    for key in keys:
        losses = [x for seg in on_disk["raw"]["runs"][key]["segments"] for x in seg["loss"]]
        assert all(0 < x < 10 for x in losses), (key, losses)
    assert f"on {device} in {precision}" in str(res["markdown"])


def test_tiny_bench_bf16_on_cpu(tmp_path: Path) -> None:
    cfg = _tiny(
        tmp_path, device="cpu", precision="bf16", strategies=["ddp", "compressed:compressor=topk:ratio=0.1"]
    )
    res = run_bench(cfg, timeout=240, quiet=True)
    _check_run(res, Path(cfg.out_dir), "cpu", "bf16", {"ddp", "compressed:compressor=topk:ratio=0.1"})


def test_tiny_bench_fp16_on_cpu(tmp_path: Path) -> None:
    # linreg: fp16 convolutions on the CPU took ~50 s for the CNN's 12 steps; the scaler path is the same
    cfg = _tiny(
        tmp_path,
        workload="linreg",
        device="cpu",
        precision="fp16",
        strategies=["stage", "powersgd:start_iter=2"],
    )
    res = run_bench(cfg, timeout=240, quiet=True)
    _check_run(res, Path(cfg.out_dir), "cpu", "fp16", {"stage", "powersgd:start_iter=2"})


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_tiny_bench_on_cuda_one_rank(tmp_path: Path, precision: str) -> None:
    cfg = _tiny(tmp_path, device="cuda", precision=precision, world_size=1, strategies=["ddp", "stage"])
    res = run_bench(cfg, timeout=300, quiet=True, force=True)
    _check_run(res, Path(cfg.out_dir), "cuda:0", precision, {"ddp", "stage"})


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
def test_tiny_bench_ddp_on_cuda_two_ranks(tmp_path: Path) -> None:
    cfg = _tiny(tmp_path, device="cuda", precision="bf16", strategies=["ddp"])
    res = run_bench(cfg, timeout=300, quiet=True, force=True)
    _check_run(res, Path(cfg.out_dir), "cuda:0", "bf16", {"ddp"})
