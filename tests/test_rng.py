"""lowband.rng.fork_rng: two threads forking the global random state at once never deadlock (torch's own
fork_rng did, 3 runs of 3 within 5 s, in the same script: ``python tests/_rng_fork_threads.py torch 5``);
the states are put back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from lowband.rng import fork_rng

HERE = Path(__file__).parent


def test_forks_from_two_threads_with_garbage_collection_never_deadlock() -> None:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    out = subprocess.run(
        [sys.executable, str(HERE / "_rng_fork_threads.py"), "lowband", "3"],
        env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-2000:]


def test_the_state_is_put_back() -> None:
    torch.manual_seed(3)
    expected = torch.rand(5)
    torch.manual_seed(3)
    with fork_rng():
        torch.manual_seed(99)
        torch.rand(100)
    assert torch.equal(torch.rand(5), expected)
