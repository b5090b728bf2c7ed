"""Link drift on the real testbed (root and link shaping needed, skipped otherwise): ``lowband run
--rate-change`` re-shapes one machine's link while its ranks allreduce, and their allreduces slow down
by about the ratio of the rates."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowband.testbed import shaping_available

TESTS = Path(__file__).parent
SCRIPT = TESTS / "_rate_change_script.py"
_OK, _WHY = shaping_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"link shaping unavailable here: {_WHY}")
ENV = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}


def test_a_rate_change_slows_the_allreduce_by_the_ratio_of_the_rates(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    # 256 KiB per allreduce: ~21 ms at 100 Mbit/s, ~210 ms at 10 Mbit/s (2 ranks: each sends it once)
    deadline = time.perf_counter() + 7.5
    cmd = [
        sys.executable, "-m", "lowband.cli", "run", "-n", "2", "--rate", "100mbit", "--mode", "netns",
        "--rate-change", "3s:m1=10mbit", "--report", str(report),
        str(SCRIPT), str(tmp_path), repr(deadline), "256",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=ENV, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rate change at" in out.stderr and "machine m1's link 100 Mbit/s -> 10 Mbit/s" in out.stderr
    (change,) = json.loads(report.read_text())["rate_changes"]
    assert change["machine"] == 1 and change["old_bits"] == 1e8 and change["new_bits"] == 1e7, change
    assert "error" not in change and 3.0 <= change["applied_s"] < 5.0, change
    samples = json.loads((tmp_path / "times.json").read_text())
    at = change["monotonic"]
    before = [d for s, d in samples if s + d < at]
    after = [d for s, d in samples if s > at + 0.5]  # the queue filled at 100 Mbit/s has drained
    assert len(before) >= 5 and len(after) >= 5, (len(before), len(after), change)
    slow = statistics.median(after) / statistics.median(before)
    assert slow > 3.0, (slow, statistics.median(before), statistics.median(after))
