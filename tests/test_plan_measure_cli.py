"""``lowband plan --measure`` and ``--time-limit``: bad input refused before anything runs (no ranks),
and one measured plan under ``lowband run -n 2``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lowband.cli import main
from lowband.plan.budget import estimate_seconds

BASE = ["plan", "-w", "linreg", "-s", "ddp"]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--measure", "--rate", "100mbit"], {"RANK": "0", "WORLD_SIZE": "2"}, "give the links once"),
        (["--measure", "--rates", "1mbit,2mbit"], {"RANK": "0", "WORLD_SIZE": "2"}, "not --rates"),
        (["--measure", "--delay-ms", "0"], {"RANK": "0", "WORLD_SIZE": "2"}, "not --delay-ms"),
        (["--measure", "--intra-rate", "1gbit"], {"RANK": "0", "WORLD_SIZE": "2"}, "not --intra-rate"),
        (["--measure"], {}, "no launched job (RANK/WORLD_SIZE unset): run it on every rank"),
        (["--measure", "-n", "3"], {"RANK": "0", "WORLD_SIZE": "2"}, "-n 3 but the job was launched with 2"),
        (["--measure", "--ranks-per-machine", "2"], {"RANK": "0", "WORLD_SIZE": "3"}, "must divide"),
        (["--measure"], {"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
        (["--rate", "1mbit", "--time-limit", "0"], {}, "--time-limit must be > 0"),
        (["--rate", "1mbit", "--time-limit", "1e-9"], {}, "over the time limit of 1e-09 s"),
        (["--measure", "--time-limit", "1e-9"], {"RANK": "0", "WORLD_SIZE": "1"}, "give fewer specs (-s)"),
        ([], {}, "give the links' rate"),
    ],
)
def test_bad_input_one_error_nothing_written(
    args: list[str],
    env: dict[str, str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "out"
    assert main([*BASE, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.strip().count("\n") == 0, err  # one line
    assert not out.exists()


def test_estimate_grows_with_the_grid() -> None:
    one, many = estimate_seconds("fmnist-cnn", 1), estimate_seconds("fmnist-cnn", 34)
    assert 0 < one < many < 60  # the default grid of fmnist-cnn fits the default limit
    assert estimate_seconds("linreg", 34) < one  # a smaller model


@pytest.mark.slow
def test_measured_plan_under_the_launcher(tmp_path: Path) -> None:
    """`lowband run -n 2 -m lowband plan --measure` (unshaped loopback): rank 0 writes the plan with
    the measured links, the other rank exits 0."""
    out = tmp_path / "plan"
    cmd = [sys.executable, "-m", "lowband", "run", "-n", "2", "-m", "lowband", "plan", "--measure",
           "-w", "linreg", "-s", "ddp+localsgd:period=5", "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("recommended: ") == 1, run.stdout  # rank 0 alone plans
    plan = json.loads((out / "plan.json").read_text())
    links = plan["links"]
    assert plan["world_size"] == 2 and links["measured"] is True
    assert links["label"].startswith("measured: ")
    assert links["alpha_s"] >= 0 and links["beta_s_per_byte"] >= 0 and len(links["samples"]) >= 2
    # 2 (n - 1) steps: the quiet fit's latency, or the loaded allreduce's if larger
    assert math.isclose(links["latency_s"], max(links["alpha_s"], links["loaded_allreduce_s"]) / 2)
    assert plan["recommended"] in ("ddp", "localsgd:period=5")
