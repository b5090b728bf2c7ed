"""Device binding (lowband.devices), the device in signatures and backend checks, GPU tensors staged for
gloo's point-to-point ops, the testbed's GPU/NCCL environment and init under the NCCL emulator.

CUDA is simulated where the decision is pure (``torch.cuda.is_available`` / ``device_count`` patched);
the CUDA-marked tests at the end run on a GPU (``scripts/gpu-check``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import lowband
from lowband import devices
from lowband.comm import validate
from lowband.comm.batch import _stage, recv_op, send_op
from lowband.comm.contract import host_staged as _host_staged
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.testing import run_processes, run_threads


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> object:
    """Pretend this machine has N visible GPUs (set ``.n``)."""
    state = SimpleNamespace(n=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: state.n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state.n)
    for var in ("LOWBAND_DEVICE", "LOWBAND_CUDA_INDEX", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return state


def test_select_binds_local_rank_and_refuses_too_many_ranks_for_nccl(gpus: SimpleNamespace) -> None:
    gpus.n = 4
    assert devices.select(None, 2, 4, None) == torch.device("cuda", 2)
    assert devices.select("auto", 3, 4, "cpu:gloo,cuda:nccl") == torch.device("cuda", 3)
    assert devices.select("cpu", 3, 4, None) == torch.device("cpu")
    assert devices.select("cuda:1", 0, 1, None) == torch.device("cuda", 1)
    gpus.n = 1
    with pytest.raises(
        InvalidArgumentError, match=r"2 ranks on this machine but 1 GPU\(s\) visible.*backend='gloo'"
    ):
        devices.select(None, 1, 2, None)
    # gloo shares the GPUs round-robin
    assert devices.select(None, 1, 2, "gloo") == torch.device("cuda", 0)
    with pytest.raises(InvalidArgumentError, match=r"device cuda:3 does not exist: 1 GPU"):
        devices.select("cuda:3", 0, 1, None)


def test_select_without_cuda_and_bad_requests(gpus: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus.n = 0
    assert devices.select(None, 0, 1, None) == torch.device("cpu")
    with pytest.raises(InvalidArgumentError, match="'cuda' asked for but CUDA is not available"):
        devices.select("cuda", 0, 1, None)
    with pytest.raises(InvalidArgumentError, match=r"device='gpu': use auto, cpu, cuda or cuda:N"):
        devices.select("gpu", 0, 1, None)
    monkeypatch.setenv("LOWBAND_DEVICE", "tpu")
    with pytest.raises(InvalidArgumentError, match="environment variable LOWBAND_DEVICE='tpu'"):
        devices.select(None, 0, 1, None)


def test_testbed_index_overrides_local_rank(gpus: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Testbed ranks are emulated machines (local rank 0 each) sharing the host's GPUs: rank r -> GPU r."""
    gpus.n = 4
    monkeypatch.setenv("LOWBAND_CUDA_INDEX", "3")
    assert devices.select(None, 0, 1, None) == torch.device("cuda", 3)
    monkeypatch.setenv("LOWBAND_CUDA_INDEX", "4")
    with pytest.raises(InvalidArgumentError, match="NCCL needs one GPU per rank"):
        devices.select(None, 0, 1, None)
    assert devices.select(None, 0, 1, "gloo") == torch.device("cuda", 0)


def test_launchers_refuse_too_many_ranks_before_starting(
    gpus: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus.n = 1
    with pytest.raises(InvalidArgumentError, match=r"^lowband.launch: 3 ranks on this machine but 1 GPU"):
        lowband.launch(print, 3)
    # the same decision with gloo: nothing to refuse
    devices.check_ranks(3, None, "gloo", "lowband.launch")
    from lowband.run_cli import main

    assert main(["-n", "2", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "2 ranks on this machine but 1 GPU(s) visible" in err and "LOWBAND_DEVICE=cpu" in err


def test_testbed_rank_env_keeps_nccl_on_the_shaped_link() -> None:
    from lowband.testbed.links import build_layout
    from lowband.testbed.netns import Testbed

    tb = Testbed(build_layout(3, rate="100mbit"), mode="loopback")
    env = tb.rank_env(2)
    assert env["LOWBAND_CUDA_INDEX"] == "2"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"]
    assert env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == env["NCCL_IB_DISABLE"] == "1"


def test_init_binds_the_cpu_here() -> None:
    def fn() -> str:
        return str(lowband.device())

    assert run_threads(fn, 2) == ["cpu", "cpu"]


# -- the device in signatures, and tensors against the group's backend -------------------------------
def test_signature_carries_the_device_type() -> None:
    cpu = validate.signature_row("allreduce", torch.float32, [4], 0, (), 2, torch.device("cpu"))
    gpu = validate.signature_row("allreduce", torch.float32, [4], 0, (), 2, torch.device("cuda", 0))
    assert cpu != gpu and validate.describe(gpu).startswith("allreduce of a float32 cuda tensor")
    g = SimpleNamespace(rank=0, world_rank=0, ranks=(0, 1), name="world")
    with pytest.raises(
        CollectiveMismatchError,
        match=r"device differ across ranks: rank 0 called allreduce of a float32 tensor.*rank 1 called allreduce of a float32 cuda tensor",
    ):
        validate.check_rows("allreduce", g, [cpu, gpu])  # type: ignore[arg-type]
    validate.check_rows("allreduce", g, [gpu, gpu])  # type: ignore[arg-type]


def test_backend_devices_and_check_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert validate.backend_devices("gloo") == {"cpu", "cuda"}
    assert validate.backend_devices("nccl") == {"cuda"}
    assert validate.backend_devices("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert "cpu" in validate.backend_devices("nccl_emu")  # unknown backends are trusted
    monkeypatch.setattr(dist, "get_backend", lambda pg: "nccl")
    g = SimpleNamespace(pg=object(), name="world")
    with pytest.raises(
        InvalidArgumentError,
        match=r"tensor is on cpu but group 'world' has backend 'nccl'.*lowband.device\(\)",
    ):
        validate.check_device("allreduce", 0, g, torch.zeros(2))


def test_host_values_move_to_the_device_only_on_a_group_that_moves_no_cpu_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lowband's own host values (timings, sizes) on an adopted NCCL-only group (Lightning's, say) go
    on this rank's device; on any group that moves CPU tensors they stay where they are."""
    from lowband.comm import base, host_value

    t = torch.arange(3.0)
    ctx = SimpleNamespace(device=torch.device("meta"))
    g = SimpleNamespace(pg=object(), name="world")
    monkeypatch.setattr(base, "resolve", lambda op, group: (ctx, g))
    monkeypatch.setattr(validate, "served_devices", lambda pg: {"meta"})  # NCCL-only, "meta" the GPU
    moved = host_value(t)
    assert moved.device.type == "meta" and moved.shape == t.shape
    monkeypatch.setattr(validate, "served_devices", lambda pg: {"cpu", "meta"})  # cpu:gloo,cuda:nccl
    assert host_value(t) is t
    ctx.device = torch.device("cpu")  # a CPU rank: nothing to move to
    monkeypatch.setattr(validate, "served_devices", lambda pg: {"meta"})
    assert host_value(t) is t


# -- gloo point-to-point: GPU tensors through host memory ---------------------------------------------
def test_gpu_tensors_are_staged_for_gloo_point_to_point() -> None:
    def fn() -> bool:
        return _host_staged(lowband.world().pg)

    assert run_threads(fn, 2) == [True, True]
    meta = torch.empty(3, device="meta")  # stands for a GPU tensor: not staged (only cuda is)
    staged: list[tuple[object, torch.Tensor]] = []
    assert _stage(send_op(meta, 1, 0), staged).tensor is meta and not staged
    cpu = torch.zeros(3)
    assert _stage(recv_op(cpu, 1, 0), staged).tensor is cpu and not staged  # type: ignore[arg-type]


# -- lowband.init under the NCCL emulator --------------------------------------------------------------
def _emulated() -> tuple[str, list[float]]:
    return str(dist.get_backend()), lowband.allreduce(torch.ones(2) * (lowband.rank() + 1)).tolist()


def test_init_with_the_nccl_emulator_as_default_group() -> None:
    res = run_processes(_emulated, 2, timeout=120, emulate_nccl=True)
    assert res == [("nccl_emu", [1.5, 1.5])] * 2  # the average of 1 and 2


# -- on a GPU (scripts/gpu-check) ----------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _exchange(device: str) -> list[float]:
    from lowband.comm.batch import Channel

    me, peer = lowband.rank(), 1 - lowband.rank()
    out = torch.zeros(3, device=device)
    mine = torch.full((3,), float(me + 1), device=device)
    Channel.of(None).batch("test_p2p", [recv_op(out, peer, 5), send_op(mine, peer, 5)])
    assert out.device.type == device
    return out.tolist()


ON_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, cuda]),
]


@pytest.mark.parametrize("device", ON_DEVICES)
def test_point_to_point_exchange_on_each_device(device: str) -> None:
    """On a GPU over gloo the batch is staged through host memory (comm/batch.py)."""
    assert run_threads(_exchange, 2, device) == [[2.0] * 3, [1.0] * 3]


def _window(device: str) -> list[float]:
    from lowband.compat.bluefog import torch as bf

    bf.init()
    x = torch.full((4,), float(lowband.rank() + 1), device=device)
    bf.win_create(x, "w")
    bf.win_put(x, "w")
    bf.barrier()
    got = bf.win_update("w")
    assert got.device.type == device
    bf.win_free("w")
    return got.tolist()


@pytest.mark.parametrize("device", ON_DEVICES)
def test_windows_on_each_device(device: str) -> None:
    """Windows hold the caller's tensors, GPU ones too; their traffic is staged through host memory
    (the window service's gloo channel)."""
    out = run_processes(_window, 2, device, timeout=120, backend="gloo", device=device)
    assert out[0] == out[1] and len(out[0]) == 4


def test_gpu_check_skips_every_gpu_check_without_cuda(tmp_path: object) -> None:
    """scripts/gpu-check on a CPU machine: SKIP per GPU check, exit 0 (the CPU-side suites it also runs
    are this test suite's own files)."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: scripts/gpu-check runs the checks for real")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "gpu_check.py"), "--skip-cpu", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=root,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    skips = [line for line in out.stdout.splitlines() if line.startswith("SKIP")]
    assert len(skips) == 5 and all("no CUDA here" in s for s in skips), out.stdout


def _powersgd_with_cuda_available() -> list[float]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from lowband.strategies import make_strategy

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    s = make_strategy("powersgd", m, lambda p: torch.optim.SGD(p, lr=0.01), rank=1, start_iter=2)
    # this process's view of torch in the hook's module says CUDA is available, as on a GPU machine
    psgd.torch.cuda.is_available = lambda: True
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(lowband.rank()))
    losses = [float(s.train_step(lambda mod: mod(x).square().mean())) for _ in range(4)]  # 2 compressed
    s.close()
    return losses


def test_powersgd_trains_a_cpu_model_on_a_machine_with_cuda() -> None:
    """torch's PowerSGD hook synchronises the bucket's device whenever CUDA is available, which fails for
    a CPU bucket (seen on an H200 machine); the strategy's view of torch skips non-GPU devices there,
    and forwards every other name to torch."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from lowband.strategies.psgd_cpu import tolerate_cpu_buckets

    tolerate_cpu_buckets()
    assert psgd.torch.zeros is torch.zeros and psgd.torch.cuda.Stream is torch.cuda.Stream
    for losses in run_processes(_powersgd_with_cuda_available, 2, timeout=120):
        assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
