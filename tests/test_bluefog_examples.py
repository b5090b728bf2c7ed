"""BlueFog-style programs (examples/bluefog/) run unchanged but for the import line, at 3 and 4 ranks:
average consensus (static, dynamic, asynchronous push-sum with associated p), decentralized least squares
(exact diffusion, gradient tracking, push-DIGing), and hierarchical averaging launched by torchrun with
BlueFog's ``BLUEFOG_NODES_PER_MACHINE`` and ``BLUEFOG_TIMELINE``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bluefog_examples import EXAMPLES, IMPORTS, run_example

SIZES = (3, 4)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_programs_differ_from_bluefog_only_in_their_imports(path: Path) -> None:
    text = path.read_text()
    lowband_lines = [line for line in text.splitlines() if "lowband" in line]
    assert lowband_lines and all(line in IMPORTS for line in lowband_lines), lowband_lines
    as_bluefog = text
    for ours, theirs in IMPORTS.items():
        as_bluefog = as_bluefog.replace(ours, theirs)
    assert "lowband" not in as_bluefog
    assert "import bluefog.torch as bf" in as_bluefog


CONSENSUS = {
    "static": [],
    "dynamic": ["--enable-dynamic-topology"],
    "async": ["--asynchronous-mode"],
    "async-dynamic": ["--asynchronous-mode", "--enable-dynamic-topology"],
}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mode", sorted(CONSENSUS))
def test_average_consensus(monkeypatch: pytest.MonkeyPatch, mode: str, n: int) -> None:
    argv = ["--data-size", "64", "--max-iters", "100", *CONSENSUS[mode]]
    for out in run_example(monkeypatch, "pytorch_average_consensus.py", argv, n, ["mse"]):
        assert float(out["mse"][-1]) < 1e-6, (mode, float(out["mse"][-1]))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("method", ["exact_diffusion", "gradient_tracking", "push_diging"])
def test_decentralized_optimization(monkeypatch: pytest.MonkeyPatch, method: str, n: int) -> None:
    argv = ["--method", method, "--max-iter", "150"]
    for out in run_example(monkeypatch, "pytorch_optimization.py", argv, n, ["relative_error", "mse"]):
        # exact methods: every rank reaches the global optimum (not a neighbourhood of it)
        assert out["relative_error"] < 1e-6, (method, out["relative_error"])


def test_hierarchical_program_under_torchrun_honours_nodes_per_machine(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "BLUEFOG_NODES_PER_MACHINE": "2",
        "BLUEFOG_TIMELINE": str(tmp_path / "timeline"),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(EXAMPLES / "pytorch_hierarchical_consensus.py")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pattern = (r"rank=(?P<rank>\d+) local_rank=(?P<lr>\d+) local_size=(?P<ls>\d+) machine_rank=(?P<mr>\d+) "
               r"machine_size=(?P<ms>\d+) result=(?P<y>-?\d+\.\d{6})")  # fmt: skip
    rows = {int(m["rank"]): m for m in re.finditer(pattern, proc.stdout)}
    assert sorted(rows) == [0, 1, 2, 3], proc.stdout
    for r, m in rows.items():
        assert (int(m["lr"]), int(m["ls"]), int(m["mr"]), int(m["ms"])) == (r % 2, 2, r // 2, 2)
        # machine means 0.5 and 2.5; each machine keeps 3/4 of its own and takes 1/4 of the other's
        assert float(m["y"]) == pytest.approx(1.0 if r < 2 else 2.0, abs=1e-12)
    for r in range(4):
        assert (tmp_path / f"timeline{r}.json").exists()
