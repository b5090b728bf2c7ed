"""Runtime: init (world of one, torchrun env://, lowband run, launch), hierarchy, groups, CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import lowband
from lowband.testing import run_processes, run_threads

BIN = Path(sys.executable).parent


def test_world_of_one() -> None:
    """Plain python, no launcher: a world of one where every op works."""
    code = textwrap.dedent(
        """
        import torch, lowband
        ctx = lowband.init()
        assert (lowband.rank(), lowband.size(), lowband.local_rank(), lowband.local_size()) == (0, 1, 0, 1)
        assert (lowband.machine_rank(), lowband.machine_size()) == (0, 1)
        assert lowband.allreduce(torch.ones(3)).tolist() == [1.0] * 3
        assert lowband.allgather(torch.ones(2, 2)).shape == (2, 2)
        assert lowband.alltoall(torch.arange(3))[0].tolist() == [0, 1, 2]
        assert lowband.init() is ctx  # idempotent
        lowband.shutdown()
        assert not lowband.is_initialized()
        print("ok")
        """
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize(("n", "local"), [(4, 2), (4, 1), (3, 3), (2, 1)])
def test_hierarchy(n: int, local: int) -> None:
    def rank_fn() -> tuple[int, ...]:
        r = lowband.rank()
        lg = lowband.local_group()
        mg = lowband.machine_group()
        # sum of world ranks inside my machine, and across machines at my local rank
        s_local = int(lowband.allreduce(torch.tensor(r), op="sum", group=lg).item())
        s_cross = int(lowband.allreduce(torch.tensor(r), op="sum", group=mg).item()) if mg is not None else -1
        return (
            lowband.local_rank(),
            lowband.local_size(),
            lowband.machine_rank(),
            lowband.machine_size(),
            s_local,
            s_cross,
        )

    out = run_threads(rank_fn, n, local_size=local)
    machines = n // local
    for r, (lr, ls, mr, ms, s_local, s_cross) in enumerate(out):
        assert (lr, ls, mr, ms) == (r % local, local, r // local, machines)
        m = r // local
        assert s_local == sum(range(m * local, (m + 1) * local))
        assert s_cross == (sum(range(lr, n, local)) if machines > 1 else -1)


def test_bad_local_size() -> None:
    with pytest.raises(
        lowband.testing.RankFailures, match=r"local_size=3 must be >= 1 and divide the world size 4"
    ):
        run_threads(lambda: None, 4, local_size=3)


def test_new_group_bad_ranks() -> None:
    def rank_fn() -> None:
        with pytest.raises(
            lowband.InvalidArgumentError,
            match=r"new_group on rank \d: ranks must be distinct world ranks in \[0, 2\)",
        ):
            lowband.new_group([0, 5])

    run_threads(rank_fn, 2)


def _env_ranks() -> tuple[int, int, int, int, float]:
    s = lowband.allreduce(torch.tensor([float(lowband.rank())]), op="sum").item()
    return lowband.rank(), lowband.size(), lowband.local_rank(), lowband.local_size(), s


def test_init_from_env_processes() -> None:
    """env:// initialisation (what torchrun provides), with real processes."""
    out = run_processes(_env_ranks, 3, timeout=90)
    assert out == [(r, 3, r, 3, 3.0) for r in range(3)]


def test_launch() -> None:
    out = lowband.launch(_env_ranks, 2)
    assert out == [(0, 2, 0, 2, 1.0), (1, 2, 1, 2, 1.0)]


SCRIPT = """
import sys, torch, lowband
lowband.init()
s = lowband.allreduce(torch.tensor([float(lowband.rank())]), op="sum").item()
line = f"RESULT rank={lowband.rank()} size={lowband.size()} local_size={lowband.local_size()} sum={s} args={sys.argv[2:]}"
open(f"{sys.argv[1]}/out{lowband.rank()}.txt", "w").write(line)
lowband.shutdown()
"""


@pytest.mark.parametrize("launcher", ["lowband", "torchrun"])
def test_cli_run_and_torchrun(tmp_path: Path, launcher: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    if launcher == "lowband":
        cmd = [str(BIN / "lowband"), "run", "-n", "3", str(script), str(tmp_path), "--flag", "x"]
    else:
        cmd = [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "3",
            str(script),
            str(tmp_path),
            "--flag",
            "x",
        ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [(tmp_path / f"out{r}.txt").read_text() for r in range(3)]
    assert lines == [f"RESULT rank={r} size=3 local_size=3 sum=3.0 args=['--flag', 'x']" for r in range(3)]


def test_cli_run_failure_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("import lowband\nlowband.init()\nraise SystemExit(5 if lowband.rank() == 1 else 0)\n")
    out = subprocess.run(
        [str(BIN / "lowband"), "run", "-n", "2", str(script)], capture_output=True, text=True, timeout=180
    )
    assert out.returncode != 0


def test_cli_demo_small(tmp_path: Path) -> None:
    """The main job, shrunk: the demo's strategies (baselines, DreamDDP, BlueFog ATC) side by side."""
    out = subprocess.run(
        [str(BIN / "lowband"), "demo", "-n", "2", "--mode", "loopback", "--rounds", "2",
         "--steps-per-round", "2", "--out", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    for name in ("ddp(", "powersgd(", "localsgd(", "dreamddp(", "atc("):
        assert f"| {name}" in out.stdout
    assert (tmp_path / "demo" / "results.json").exists()


def test_ring_example_oracle_in_threads() -> None:
    """examples/ring_average.py (gossip over p2p), at N = 1..4 in threads."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from ring_average import ring_average

    for n in (1, 2, 3, 4):
        res = run_threads(ring_average, n, 6, 257)
        assert all(x["max_err_vs_oracle"] < 1e-12 and x["mean_err"] < 1e-12 for x in res)
