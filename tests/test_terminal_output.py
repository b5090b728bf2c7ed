"""What a person reads when a job fails: one line per distinct cause on the terminal (which ranks, what
failed), every rank's full traceback in its log file, the folder named.

``lowband run`` on both of its paths (torchrun's agent; the testbed, on loopback and, as root, on
shaped links), ``lowband.launch`` and ``lowband bench``; a typo in a strategy's name raised on every
rank (one line, not three tracebacks) and a rank killed with SIGKILL (a few lines naming it). Real
processes: each case costs a few seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowband
from lowband.strategies import make_strategy
from lowband.testbed import shaping_available

TESTS = Path(__file__).parent
SCRIPT = TESTS / "_terminal_script.py"
_OK, _WHY = shaping_available()
PATHS = [
    pytest.param([], id="torchrun"),
    pytest.param(["--mode", "loopback"], id="testbed-loopback"),
    pytest.param(
        ["--rate", "1gbit", "--mode", "netns"], id="testbed-netns",
        marks=pytest.mark.skipif(not _OK, reason=f"link shaping unavailable here: {_WHY}"),
    ),
]  # fmt: skip
LOGS_RE = re.compile(r"every rank's output and traceback: (\S+)/rank\*\.log$")


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith(text))


def _run(path: list[str], mode: str, tmp: Path, *extra: str) -> tuple[int, list[str]]:
    cmd = [sys.executable, "-m", "lowband.cli", "run", "-n", "3", "--timeout", "30", *path, *extra]
    out = subprocess.run(
        [*cmd, str(SCRIPT), mode, str(tmp)], capture_output=True, text=True, timeout=180, cwd=tmp
    )
    return out.returncode, out.stderr.strip().splitlines()


def _logs(lines: list[str], who: str = "lowband run") -> Path:
    """The log folder the last line names (checked to be the last line)."""
    m = LOGS_RE.search(lines[-1])
    assert m is not None and lines[-1].startswith(f"{who}: "), lines
    return Path(m.group(1))


@pytest.mark.parametrize("path", PATHS)
def test_a_typo_on_every_rank_is_one_line(path: list[str], tmp_path: Path) -> None:
    code, lines = _run(path, "typo", tmp_path)
    assert code == 1, lines
    causes = [x for x in lines if "unknown strategy 'ddpp'" in x]
    assert len(causes) == 1, lines
    line = _line_of(SCRIPT, 'make_strategy("ddpp"')
    assert causes[0].startswith("lowband run: ranks 0-2 failed: InvalidArgumentError: "), causes[0]
    assert causes[0].endswith(f"(_terminal_script.py, line {line})"), causes[0]
    assert not any("Traceback" in x or "hostname of the client socket" in x for x in lines), lines
    label = 1 if path else 0  # the testbed names its links first
    assert len(lines) <= label + 2, "\n".join(lines)  # the cause and the logs; nothing more
    logs = _logs(lines)
    try:
        for r in range(3):
            text = (logs / f"rank{r}.log").read_text()
            assert f"rank {r} started" in text  # the rank's own output is in its log too
            assert "Traceback (most recent call last)" in text and "in make_strategy" in text, text
            assert "rank_main.py" not in text and "runpy" not in text, text  # the user's frames first
    finally:
        shutil.rmtree(logs)


@pytest.mark.parametrize("path", PATHS)
def test_a_killed_rank_is_named_in_a_few_lines(path: list[str], tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    code, lines = _run(path, "kill", tmp_path, "--log-dir", str(logs))
    assert code == 1, lines
    ours = [x for x in lines if x.startswith("lowband run: ") and "bytes" not in x and "rank " in x]
    assert ours[0].startswith("lowband run: rank 1 was killed by SIGKILL (exit code -9"), lines
    follow = _ranks_of(ours, "lowband run: then ", " failed because of it (follow-on errors")
    stopped = _ranks_of(ours, "lowband run: ", " stopped by torchrun's agent once another rank had failed")
    if path:  # the testbed waits for every rank: both record their follow-on error
        assert follow == [0, 2] and not stopped, lines
    else:  # torchrun's agent stops the others once it sees rank 1 gone (it polls every 0.1 s): a rank
        # still waiting on a peer then is named as stopped by it (seen on a loaded CI machine)
        assert sorted(follow + stopped) == [0, 2], lines
    assert _logs(lines) == logs
    label = 1 if path else 0
    assert len(lines) <= label + 3 + bool(stopped), "\n".join(lines)  # + the agent's line, if any
    assert "killed (signal SIGKILL, exit code -9)" in (logs / "rank1.log").read_text()
    for r in follow:
        text = (logs / f"rank{r}.log").read_text()
        assert "Traceback (most recent call last)" in text and "CommFailedError" in text, text


def _ranks_of(lines: list[str], head: str, tail: str) -> list[int]:
    """The ranks named by the one line ``HEAD ranks 0, 2 TAIL`` (``[]`` when there is none)."""
    found = [x[len(head) : x.index(tail)] for x in lines if x.startswith(head) and tail in x]
    assert len(found) <= 1, lines
    if not found:
        return []
    out: list[int] = []
    for part in found[0].removeprefix("ranks ").removeprefix("rank ").split(", "):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def _typo_everywhere() -> None:
    model = torch.nn.Linear(4, 1)
    make_strategy("ddpp", model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_launch_says_a_typo_in_one_line_and_logs_the_tracebacks(tmp_path: Path) -> None:
    with pytest.raises(lowband.LowbandError) as ei:
        lowband.launch(_typo_everywhere, 3, log_dir=str(tmp_path / "logs"))
    lines = str(ei.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("lowband.launch: ranks 0-2 failed: InvalidArgumentError: "), lines
    line = _line_of(Path(__file__), 'make_strategy("ddpp"')
    assert "unknown strategy 'ddpp'" in lines[0] and lines[0].endswith(
        f"(test_terminal_output.py, line {line})"
    )
    assert _logs(lines, "lowband.launch") == tmp_path / "logs"
    for r in range(3):
        text = (tmp_path / "logs" / f"rank{r}.log").read_text()
        assert "Traceback (most recent call last)" in text and "in _typo_everywhere" in text, text


def _ok() -> int:
    print("hello")
    return lowband.rank()


def test_launch_removes_its_temporary_logs_when_every_rank_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert lowband.launch(_ok, 2) == [0, 1]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("lowband-launch-")]


BROKEN_WORKLOAD = """\
import torch
from lowband.bench.workloads import Workload, tensor_batches

class Broken(Workload):
    def build_model(self, seed):
        torch.manual_seed(seed)
        return torch.nn.Linear(4, 2)
    def batches(self, rank, world, batch_size, seed):
        return tensor_batches([torch.randn(64, 4), torch.randint(0, 2, (64,))], rank, world, batch_size, seed)
    def loss(self, model, batch):
        raise ValueError("this loss is broken")

def make():
    return Broken()
"""


def test_bench_says_one_line_per_distinct_cause(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text(BROKEN_WORKLOAD)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lowband.cli", "bench", "-w", f"{tmp_path / 'broken.py'}:make", "-s", "ddp"]
    cmd += ["-n", "2", "--mode", "loopback", "--rounds", "2", "--steps-per-round", "2", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]
    lines = [x for x in res.stderr.strip().splitlines() if x.startswith("lowband bench")]
    assert lines[0].startswith("lowband bench: ranks 0, 1 failed: ValueError: this loss is broken"), lines
    assert lines[0].endswith(f"(broken.py, line {_line_of(tmp_path / 'broken.py', 'raise ValueError')})"), (
        lines
    )
    assert _logs(lines, "lowband bench") == out / "logs" and len(lines) == 2, lines
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    for r in range(2):
        assert "in loss" in (out / "logs" / f"rank{r}.log").read_text()
