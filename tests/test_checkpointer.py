"""lowband.checkpoint.Checkpointer: saves every K steps with a manifest, keeps the last two, resumes
exactly from the newest complete set, skips a torn or altered set naming the rank and file, resumes at
another world size where the state re-splits (and refuses where it does not), refuses another
strategy's or a newer format's set, and saves then exits when a rank is sent SIGTERM."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from test_loop_api import _flat, _loss, _model, _opt

import lowband
from lowband.checkpoint import MANIFEST, Checkpointer, complete_sets
from lowband.errors import InvalidArgumentError
from lowband.strategies import make_strategy
from lowband.testing import RankFailures, run_processes, run_threads

SPECS: dict[str, dict[str, Any]] = {
    "compressed": {"compressor": "topk:ratio=0.2"},  # error-feedback memories: per rank, re-split
    "localsgd": {"period": 3},  # replicas agree at every third step
    "embrace": {"schedule": "hybrid"},  # sharded tables: assembled, then cut for the new world size
    "gradient-allreduce": {},  # every rank's state equal: loads as it is at any world size
}


def _train(name: str, folder: str, stop: int, total: int, every: int, keep: int = 2) -> dict[str, Any]:
    """Resume from ``folder`` (if anything is there), train up to ``stop`` of ``total`` steps."""
    r = lowband.rank()
    m = _model()
    s = make_strategy(name, m, lambda p: _opt(p), **SPECS[name])
    ckpt = Checkpointer(folder, every=every, keep=keep)
    start = ckpt.resume(s)
    for k in range(start, stop):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
        ckpt.maybe_save(s, k + 1)
    s.synchronize()
    out = {"start": start, "params": _flat(m), "saved": ckpt.saved}
    s.close()
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("n", [1, 2, 3])
def test_resume_continues_exactly(name: str, n: int, tmp_path: Path) -> None:
    whole = run_threads(_train, n, name, str(tmp_path / "whole"), 12, 12, 100, timeout=120)
    first = run_threads(_train, n, name, str(tmp_path / "c"), 10, 12, 3, timeout=120)
    assert first[0]["saved"] == [3, 6, 9]
    assert complete_sets(tmp_path / "c") == [9, 6]  # the last two kept
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["step-000000006", "step-000000009"]
    man = json.loads((tmp_path / "c" / "step-000000009" / MANIFEST).read_text())
    assert man["step"] == 9 and man["world_size"] == n and man["strategy"] == name
    assert [f["rank"] for f in man["files"]] == list(range(n)) and all(
        len(f["sha256"]) == 64 for f in man["files"]
    )
    resumed = run_threads(_train, n, name, str(tmp_path / "c"), 12, 12, 3, timeout=120)
    for r in range(n):
        assert resumed[r]["start"] == 9
        assert resumed[r]["params"] == whole[r]["params"], f"{name} rank {r} at {n} ranks"


def test_a_torn_or_altered_set_is_skipped(tmp_path: Path) -> None:
    run_threads(_train, 2, "compressed", str(tmp_path), 9, 9, 3, 3, timeout=120)
    assert complete_sets(tmp_path) == [9, 6, 3]
    (tmp_path / "step-000000009" / MANIFEST).unlink()  # a crash before the manifest: incomplete
    assert complete_sets(tmp_path) == [6, 3]
    f = tmp_path / "step-000000006" / "rank1-of-2.pt"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF  # same size, altered
    f.write_bytes(bytes(data))
    with pytest.warns(
        UserWarning, match=r"skipping .*step-000000006.*rank 1.*rank1-of-2\.pt.*does not match"
    ):
        out = run_threads(_train, 2, "compressed", str(tmp_path), 3, 9, 3, 3, timeout=120)
    assert [o["start"] for o in out] == [3, 3]


def test_resume_at_another_world_size(tmp_path: Path) -> None:
    run_threads(_train, 3, "compressed", str(tmp_path / "c"), 6, 6, 3, timeout=120)
    out = run_threads(_train, 2, "compressed", str(tmp_path / "c"), 8, 8, 3, timeout=120)
    assert [o["start"] for o in out] == [6, 6] and out[0]["params"] == out[1]["params"]
    for name in ("embrace", "gradient-allreduce"):
        run_threads(_train, 3, name, str(tmp_path / name), 6, 6, 3, timeout=120)
        got = run_threads(_train, 2, name, str(tmp_path / name), 8, 8, 3, timeout=120)
        assert [o["start"] for o in got] == [6, 6], name
    # local SGD's momenta differ between the ranks, even right after an averaging: refused, naming the fix
    run_threads(_train, 3, "localsgd", str(tmp_path / "m"), 6, 6, 3, timeout=120)
    with pytest.raises(RankFailures, match=r"per-rank optimizer state .* resume at 3 ranks"):
        run_threads(_train, 2, "localsgd", str(tmp_path / "m"), 6, 6, 3, timeout=120)


def test_another_strategy_or_a_newer_format_is_refused(tmp_path: Path) -> None:
    run_threads(_train, 2, "compressed", str(tmp_path), 3, 3, 3, timeout=120)
    with pytest.raises(RankFailures, match="is of strategy 'compressed', this run's is 'localsgd'"):
        run_threads(_train, 2, "localsgd", str(tmp_path), 3, 3, 3, timeout=120)
    path = tmp_path / "step-000000003" / MANIFEST
    man = json.loads(path.read_text())
    path.write_text(json.dumps({**man, "format": 99}))
    with pytest.raises(InvalidArgumentError, match="has format 99"):
        from lowband.checkpoint import read_manifest

        read_manifest(path.parent)
    assert complete_sets(tmp_path) == []


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="every must be an int >= 1"):
        Checkpointer("x", every=0)
    with pytest.raises(InvalidArgumentError, match="keep must be an int >= 1"):
        Checkpointer("x", every=1, keep=True)


def _sigterm(folder: str) -> tuple[Any, int]:
    r = lowband.rank()
    m = _model()
    s = make_strategy("compressed", m, lambda p: _opt(p), **SPECS["compressed"])
    ckpt = Checkpointer(folder, every=100)
    for k in range(20):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
        if k == 4 and r == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded; the ranks agree at the next maybe_save
        try:
            ckpt.maybe_save(s, k + 1)
        except SystemExit as exc:
            return exc.code, k + 1
    raise AssertionError("not stopped")


def test_sigterm_saves_then_exits(tmp_path: Path) -> None:
    """Rank 1 alone is sent SIGTERM after step 5's training: both ranks save step 5 and exit with 143."""
    out = run_processes(_sigterm, 2, str(tmp_path), timeout=120)
    assert out == [(143, 5), (143, 5)]
    assert complete_sets(tmp_path) == [5]
    assert torch.load(tmp_path / "step-000000005" / "rank0-of-2.pt", weights_only=True)["steps"] == 5
