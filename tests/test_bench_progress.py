"""The bench's progress bar says what is being done: which strategy trains, when it is evaluated, and
what happens after the last step (the reports gathered and the strategies closed on the ranks, then the
testbed taken down and the results written by the runner)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from lowband.bench.config import BenchConfig
from lowband.bench.runner import _follow
from lowband.bench.worker import run_worker
from lowband.testing import run_threads


def test_worker_reports_each_phase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = "compressed:compressor=identity"
    cfg = BenchConfig(
        workload="fmnist-cnn", strategies=[spec], world_size=2, mode="loopback", rounds=2, steps_per_round=2,
        warmup_rounds=1, eval_items=32, out_dir=str(tmp_path),
    )  # fmt: skip
    run_threads(lambda: run_worker(cfg), 2, timeout=240)
    lines = [x.split(" ", 3) for x in capsys.readouterr().out.splitlines() if x.startswith("@@progress ")]
    assert all(x[2] == "8" for x in lines)  # 2 rounds x 2 runs (the strategy, compute-only) x 2 steps
    got = [(int(x[1]), x[3]) for x in lines]
    assert got == [
        (0, f"round 1/2: {spec}"),
        (2, f"round 1/2: {spec}: evaluating"),
        (2, "round 1/2: compute-only"),
        (4, f"round 2/2: {spec}"),
        (6, f"round 2/2: {spec}: evaluating"),
        (6, "round 2/2: compute-only"),
        (8, "training done: gathering the reports, closing the strategies"),
    ]


def test_runner_shows_the_last_phase() -> None:
    from tqdm import tqdm

    out = io.StringIO()
    bar = tqdm(file=out, total=1)
    stream = io.BytesIO(b"@@progress 8 8 training done: gathering the reports, closing the strategies\n")
    _follow(stream, bar, io.StringIO())
    bar.refresh()
    assert bar.n == 8 and "closing the strategies" in out.getvalue()
