"""``lowband run --keep-going``: a lost rank does not stop the others, whose strategy trains on without
it (``on_peer_loss=continue``); the launcher's store outlives rank 0; the run succeeds when a rank
does, and names the lost ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowband.testbed import shaping_available

TESTS = Path(__file__).parent
SCRIPT = TESTS / "_keep_going_script.py"
_OK, _WHY = shaping_available()


def _run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", **env}
    return subprocess.run(
        [sys.executable, "-m", "lowband.cli", "run", *args], capture_output=True, text=True, timeout=150, env=full,
        cwd=tmp_path,
    )  # fmt: skip


def _survivors(tmp_path: Path, n: int, lost: int) -> None:
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n) if r != lost}
    assert not (tmp_path / f"rank{lost}.json").exists()
    first = got[min(got)]
    for r, g in got.items():
        assert g["params"] == first["params"], r  # the survivors end averaged together
        (event,) = g["peer_loss"]
        assert event["lost_ranks"] == [lost] and event["members"] == sorted(got), event


@pytest.mark.parametrize("mode", ["loopback", "netns"])
def test_survivors_go_on_when_rank_0_dies(mode: str, tmp_path: Path) -> None:
    if mode == "netns" and not _OK:
        pytest.skip(f"link shaping unavailable here: {_WHY}")
    links = ["--rate", "1gbit", "--mode", "netns"] if mode == "netns" else []
    out = _run(["-n", "3", "--keep-going", *links, str(SCRIPT), str(tmp_path)], tmp_path, DIE="0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "lowband run: --keep-going: ranks 1, 2 trained on and ended successfully; lost: rank 0" in out.stderr
    )
    assert "rank 0 was killed by SIGKILL" in out.stderr, out.stderr
    _survivors(tmp_path, 3, lost=0)


def test_a_stopped_rank_is_left_behind_and_named(tmp_path: Path) -> None:
    out = _run(
        ["-n", "3", "--keep-going", "--timeout", "4", str(SCRIPT), str(tmp_path)],
        tmp_path,
        DIE="2",
        HOW="stop",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "lost: rank 2" in out.stderr and "rank 2 stopped answering" in out.stderr, out.stderr
    _survivors(tmp_path, 3, lost=2)


def test_the_run_fails_when_every_rank_fails(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("raise SystemExit(3)\n")
    out = _run(["-n", "2", "--keep-going", "job.py"], tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "--keep-going:" not in out.stderr and "ranks 0, 1" in out.stderr, out.stderr


def test_death_notices_count_only_deaths_recorded_after_they_were_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed import HashStore, PrefixStore  # type: ignore[attr-defined]

    from lowband.comm.deaths import DeathNotices, record_death

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-x")
    raw = HashStore()
    record_death(raw, "run-x", 1, 2, -9)  # before: not this membership's
    seen = DeathNotices(PrefixStore("0/", PrefixStore("attempt", raw)))  # read through a rank's view
    assert seen.new() == []
    record_death(raw, "run-x", 2, 3, -9)
    record_death(raw, "run-other", 1, 1, -9)  # another run's
    record_death(raw, "run-x", 3, 0, 1)
    assert seen.new() == [(3, -9), (0, 1)] and seen.new() == []
