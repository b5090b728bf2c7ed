"""``lowband plan``: bad input refused before anything runs, and one end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowband.cli import main

GOOD = ["plan", "-w", "linreg", "-n", "2", "--rate", "100mbit", "-s", "ddp"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-w", "nosuch"], "unknown workload 'nosuch'"),
        (["-w", "nosuch_module_xyz:factory"], "nosuch_module_xyz"),
        (["-s", "ddp+nosuch"], "unknown strategy 'nosuch'"),
        (["-s", "powersgd:rank=0"], "rank"),
        (["-s", "localsgd:colour=red"], "colour"),
        (["-s", "ddp+ddp"], "repeat"),
        (["-n", "3", "--ranks-per-machine", "2"], "must divide the world size"),
        (["--rates", "10mbit,100mbit"], "give the links once"),
        (["-n", "4", "--rate", "", "--rates", "10mbit,100mbit,100mbit"], "give the links once"),
        (["--rate", "100 furlongs"], "lowband plan"),
        (["--rate", "none"], "unshaped"),
        (["--shared-cores", "-1"], "--shared-cores"),
        (["--max-compression", "0.5"], "--max-compression"),
    ],
)
def test_bad_input_one_error_nothing_written(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main([*GOOD, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.strip().count("\n") == 0, err  # one line
    assert not out.exists()


def test_no_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-w", "linreg", "-s", "ddp", "--out", str(tmp_path / "o")]) == 2
    assert "give the links' rate" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    specs = "slimgc+ddp+localsgd:period=5+powersgd:rank=1+compressed:compressor=fp16"
    args = ["plan", "-w", "linreg", "-n", "3", "--rate", "10mbit", "-s", specs, "--out", str(out)]
    assert main([*args, "--max-local-steps", "1"]) == 0
    printed = capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    ranked = [s["predicted_ms"] for s in plan["strategies"] if s["model"]]
    assert ranked == sorted(ranked) and len(ranked) == 4
    assert plan["strategies"][-1] == {"spec": "slimgc", "predicted_ms": None, "model": False}
    chosen = plan["recommended"]
    assert chosen != "localsgd:period=5"  # 5 local steps are not accepted
    first = next(s for s in plan["strategies"] if s["model"] and not s["flags"].get("local_steps"))
    assert chosen == first["spec"]
    assert plan["links"]["bandwidth_bytes_s"] == pytest.approx(1.25e6)
    assert "no model" in printed and chosen in printed
    assert f"`{chosen}`" in (out / "plan.md").read_text()
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    measured = plan["profile"]["operations"]  # fp16 measured once, on this machine, with its exact bytes
    fp16 = [op for op in measured if op.get("compressor") == "fp16"]
    assert len(fp16) == 1 and fp16[0]["payload_bytes"] == 2 * fp16[0]["numel"]


SCALE = ["plan", "-w", "linreg", "--rate", "100mbit", "-s", "ddp"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-sizes", "8,0"], "each size must be in [1,"),
        (["--world-sizes", "8,-4"], "each size must be in [1,"),
        (["--world-sizes", "8,2.5"], "integers separated by commas"),
        (["--world-sizes", "8,x"], "integers separated by commas"),
        (["--world-sizes", ""], "integers separated by commas"),
        (["--world-sizes", "8,8"], "repeats a size"),
        (["--world-sizes", ",".join(str(2**i) for i in range(13))], "at most 12 sizes"),
        (["--world-sizes", "8,12", "--ranks-per-machine", "8"], "must divide the world size (12)"),
        (["--world-sizes", "8,64", "-n", "4"], "-n describes one world size"),
        (["--world-sizes", "8,64", "--shared-cores", "2"], "--shared-cores describes one world size"),
        (["--world-sizes", "8", "-s", "ddp+nosuch"], "unknown strategy 'nosuch'"),
    ],
)
def test_scale_bad_input_one_error_nothing_written(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main([*SCALE, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.strip().count("\n") == 0, err
    assert not out.exists()


def test_scale_rates_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "-w", "linreg", "--rates", "10mbit,100mbit", "--world-sizes", "2,4"]
    assert main([*args, "--out", str(tmp_path / "o")]) == 2
    assert "--rates describes one world size" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_scale_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "scale"
    specs = "ddp+gradient-allreduce+atc+slimgc+localsgd:period=5"
    args = ["plan", "-w", "linreg", "--rate", "10mbit", "--delay-ms", "1", "-s", specs]
    assert main([*args, "--world-sizes", "1024,8,64,2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "scale.json").read_text())
    assert doc["world_sizes"] == [2, 8, 64, 1024]
    assert doc["links"]["bandwidth_bytes_s"] == pytest.approx(1.25e6) and doc["links"]["latency_s"] == 0.001
    rows = doc["strategies"]
    assert rows["slimgc"]["8"] == {"spec": "slimgc", "predicted_ms": None, "model": False}
    for spec in ("ddp", "gradient-allreduce", "localsgd:period=5"):  # ring allreduces: never faster
        ms = [rows[spec][str(n)]["predicted_ms"] for n in doc["world_sizes"]]
        sent = [rows[spec][str(n)]["bytes_per_rank_step"] for n in doc["world_sizes"]]
        assert ms == sorted(ms) and sent == sorted(sent), (spec, ms, sent)
    atc = [rows["atc"][str(n)]["bytes_per_rank_step"] for n in doc["world_sizes"]]
    assert len(set(atc)) == 1  # one peer at every size
    assert "n=1024 ms" in printed and "no model" in printed
    assert "`ddp`" in (out / "scale.md").read_text()
    assert (out / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
