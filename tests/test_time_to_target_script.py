"""benchmarks/time_to_target.py: the target from the baseline's curve, or given with --target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "time_to_target.py"


def _run(losses: list[float], step_s: float) -> dict[str, Any]:
    return {"segments": [{"first_step": 0, "step_times": [step_s] * len(losses), "loss": losses}]}


def _results(tmp_path: Path) -> Path:
    runs = {
        "ddp": _run([5.0 - 0.1 * i for i in range(20)], 1.0),  # 10-step means fall 0.1 per step
        "localsgd:period=20": _run([5.0 - 0.05 * i for i in range(20)], 0.5),
        "diloco:inner_steps=5": _run([5.0 - 0.2 * i for i in range(20)], 0.5),
        "compute-only": _run([0.0] * 20, 0.1),
    }
    (tmp_path / "results.json").write_text(json.dumps({"raw": {"runs": runs}}))
    return tmp_path


def _main(run: Path, *args: str) -> dict[str, Any]:
    subprocess.run([sys.executable, str(SCRIPT), str(run), *args], check=True, capture_output=True)
    out: dict[str, Any] = json.loads((run / "time_to_target.json").read_text())
    return out


def test_the_target_is_the_baselines_smoothed_loss_at_the_fraction(tmp_path: Path) -> None:
    out = _main(_results(tmp_path), "--fraction", "0.5")
    # ddp's 10-step mean at step 10: mean of 5.0 .. 4.1 = 4.55
    assert abs(out["target"] - 4.55) < 1e-9 and out["baseline"] == "ddp"
    s = out["strategies"]
    assert s["ddp"]["step"] == 10 and abs(s["ddp"]["seconds"] - 10.0) < 1e-9
    # diloco's mean at step k is 5 - 0.1 (k - 1) for k <= 10: reaches 4.55 at step 5.5 -> 6
    assert s["diloco:inner_steps=5"]["step"] == 6 and abs(s["diloco:inner_steps=5"]["seconds"] - 3.0) < 1e-9
    # localsgd's mean reaches 4.55 at step 15 (7.5 s): torch's best here, not ddp (10 s)
    assert s["localsgd:period=20"]["step"] == 15
    assert out["best_torch"] == "localsgd:period=20" and out["best_other"] == "diloco:inner_steps=5"
    assert abs(out["speedup_vs_best_torch"] - 7.5 / 3.0) < 1e-9


def test_a_given_target_needs_no_baseline_in_the_run(tmp_path: Path) -> None:
    run = _results(tmp_path)
    data = json.loads((run / "results.json").read_text())
    del data["raw"]["runs"]["ddp"]
    (run / "results.json").write_text(json.dumps(data))
    out = _main(run, "--target", "4.79")
    assert out["target"] == 4.79 and out["baseline"] is None
    s = out["strategies"]
    # localsgd's mean at step k (k <= 10) is 5 - 0.025 (k - 1): below 4.79 first at step 10
    assert s["localsgd:period=20"]["step"] == 10 and abs(s["localsgd:period=20"]["seconds"] - 5.0) < 1e-9
    assert s["diloco:inner_steps=5"]["step"] == 4  # 5 - 0.1 (k - 1)
    assert out["best_torch"] == "localsgd:period=20"
    assert abs(out["speedup_vs_best_torch"] - 5.0 / 2.0) < 1e-9


def test_no_ratio_where_no_torch_strategy_reaches_the_target_and_no_baseline_is_named(tmp_path: Path) -> None:
    run = _results(tmp_path)
    out = _main(run, "--target", "3.0")  # ddp's and localsgd's means end at 3.55 and 4.275
    assert out["strategies"]["diloco:inner_steps=5"]["step"] == 16  # 5 - 0.2 (k - 5.5) from step 10
    assert out["strategies"]["localsgd:period=20"]["seconds"] is None
    assert out["strategies"]["ddp"]["seconds"] is None
    assert "speedup_vs_best_torch" not in out
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), str(run), "--baseline", "powersgd"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "no run of the baseline 'powersgd'" in bad.stderr
