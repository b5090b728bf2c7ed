"""``lowband run --max-restarts`` with the checkpoint loop: a rank killed with SIGKILL (during a step, or
while its checkpoint is being written) is restarted with the others, the job resumes from the newest
complete checkpoint and finishes with exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowband.testbed import shaping_available

TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS / "_restart_script.py"
PY = sys.executable


def _run(mode: str, out: Path, restarts: int, *links: str) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [PY, "-m", "lowband.cli", "run", "-n", "2", "--timeout", "20", "--max-restarts", str(restarts),
           *links, str(SCRIPT), mode, str(out)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _recovery(out: Path, what: str) -> None:
    """Print the seconds from the SIGKILL to every rank resumed (``pytest -s`` shows it)."""
    died = float((out / "killed-at.txt").read_text())
    last = [(out / f"resumed-rank{r}.txt").read_text().split()[-3:] for r in range(2)]
    began, resumed = min(float(x[1]) for x in last), max(float(x[2]) for x in last)
    print(
        f"{what}: from the SIGKILL to every rank resumed from step 6: {resumed - died:.1f} s "
        f"(new processes began after {began - died:.1f} s)"
    )


@pytest.mark.parametrize(("mode", "starts"), [("step", ["0", "6"]), ("save", ["0", "3"])])
def test_a_killed_rank_is_restarted_and_the_run_finishes_exactly(
    mode: str, starts: list[str], tmp_path: Path
) -> None:
    whole = _run("none", tmp_path / "whole", 0)
    assert whole.returncode == 0, whole.stderr[-3000:]
    got = _run(mode, tmp_path / mode, 2)
    assert got.returncode == 0, got.stderr[-3000:]
    if mode == "step":
        _recovery(tmp_path / mode, "torchrun restart")
    for r in range(2):
        assert (tmp_path / mode / f"starts-rank{r}.txt").read_text().split() == starts
        a = torch.load(tmp_path / "whole" / f"final-rank{r}.pt", weights_only=True)
        b = torch.load(tmp_path / mode / f"final-rank{r}.pt", weights_only=True)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"rank {r} after a restart ({mode})"


@pytest.mark.skipif(not shaping_available()[0], reason="link shaping unavailable here")
def test_restart_on_the_testbed(tmp_path: Path) -> None:
    """The same on emulated 1 Gbit/s links: the testbed restarts every rank in its namespaces."""
    whole = _run("none", tmp_path / "whole", 0)
    assert whole.returncode == 0, whole.stderr[-3000:]
    got = _run("step", tmp_path / "tb", 2, "--rate", "1gbit")
    assert got.returncode == 0, got.stderr[-3000:]
    assert "rank 1 ended with status -9; restarting every rank (restart 1 of 2)" in got.stderr, got.stderr[
        -2000:
    ]
    _recovery(tmp_path / "tb", "testbed restart")
    for r in range(2):
        assert (tmp_path / "tb" / f"starts-rank{r}.txt").read_text().split() == ["0", "6"]
        a = torch.load(tmp_path / "whole" / f"final-rank{r}.pt", weights_only=True)
        b = torch.load(tmp_path / "tb" / f"final-rank{r}.pt", weights_only=True)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"rank {r} after a testbed restart"
