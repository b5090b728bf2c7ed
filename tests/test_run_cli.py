"""``lowband run`` and the bench's command line: help pages, validation before anything starts (one
line on stderr, exit code 2, nothing left behind), the layout options, and the loopback fallback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowband.bench.validate import describe_options
from lowband.errors import InvalidArgumentError
from lowband.testbed.links import build_layout

TESTS = Path(__file__).parent
PY = sys.executable
SCRIPT = TESTS / "_run_user_script.py"


def _netns_of(pid: int) -> list[str]:
    try:
        return [n for n in os.listdir("/run/netns") if n.startswith(f"lb-{pid}-")]
    except FileNotFoundError:
        return []


def _options_without_help(parser: argparse.ArgumentParser, where: str) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _options_without_help(sub, f"{where} {name}")
        elif not action.help and not isinstance(action, argparse._HelpAction):
            out.append(f"{where} {'/'.join(action.option_strings) or action.dest}")
    return out


def test_every_flag_of_every_command_has_help() -> None:
    from lowband.cli import _parser
    from lowband.run_cli import run_parser

    assert _options_without_help(_parser(), "lowband") == []
    assert _options_without_help(run_parser(), "lowband run") == []


def test_run_help_is_a_help_page(capsys: pytest.CaptureFixture[str]) -> None:
    from lowband.cli import main
    from lowband.run_cli import run_parser

    assert main(["run", "--help"]) == 0
    page = capsys.readouterr().out
    assert page.startswith("usage: lowband run")
    for action in run_parser()._actions:
        for opt in action.option_strings:
            assert opt in page, opt
    assert "UNSHAPED" in page and "--rdzv-endpoint" in page
    assert main(["run"]) == 2  # no script: the page, and a failing status


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["-n", "2", "--rate", "fast", "job.py"], "cannot parse 'fast'"),
        (["-n", "2", "--rates", "1gbit", "job.py"], "need one per machine (2)"),
        (["-n", "3", "--ranks-per-machine", "2", "--rate", "1gbit", "job.py"], "must divide the world size"),
        (["-n", "2", "--rate", "1gbit", "--nnodes", "2", "job.py"], "--nnodes: not with a link option"),
        (["-n", "2", "--rate", "1gbit", "--max-restarts", "1", "job.py"], "--max-restarts 1: not with"),
        (["--rate", "1gbit", "job.py"], "-n N: give the number of ranks"),
        (["-n", "2", "--rate", "1gbit", "--mtu", "10", "job.py"], "mtu must be in 576..65000"),
        (["-n", "2", "--rate", "1gbit", "nosuch.py"], "no script 'nosuch.py'"),
        (["-n", "2", "--rate", "1gbit"], "give the script to run"),
        (["-n", "2", "--timeout", "0", "job.py"], "seconds > 0, got '0'"),
        (["-n", "0", "job.py"], "number of ranks >= 1, got '0'"),
        (["-n", "two", "job.py"], "number of ranks >= 1, got 'two'"),
        (["-n"], "expected one argument"),
        (["-n", "2", "--mode", "fast", "job.py"], "invalid choice: 'fast'"),
    ],
)
def test_run_rejects_bad_command_lines_in_one_line(
    argv: list[str],
    said: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lowband.cli import main
    from lowband.testbed import netns

    (tmp_path / "job.py").write_text("raise SystemExit(7)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(netns.Testbed, "up", lambda self: pytest.fail("the testbed started"))
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and err.startswith("lowband run: error: "), err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["-s", "nosuch"], "unknown strategy 'nosuch'; known: "),
        (["-s", "ddp+localsgd:nope=1"], "strategy 'localsgd': unknown option(s) ['nope']"),
        (["-s", "localsgd:period=abc"], "strategy 'localsgd': period must be an int >= 1, got 'abc'"),
        (["-s", "localsgd:period=2.5"], "strategy 'localsgd': period must be an int >= 1, got 2.5"),
        (
            ["-s", "ddp:bucket_cap_mb=true"],
            "strategy 'ddp': bucket_cap_mb must be a number >= 0.001, got True",
        ),
        (
            ["-s", "embrace:schedule=diagonal"],
            "schedule must be one of 'hybrid', 'horizontal', 'vertical', '2d'",
        ),
        (
            ["-s", "compressed:compressor=qsgd:levels=0"],
            "compressor 'qsgd': levels must be an int in [1, 127]",
        ),
        (["-s", "ddp+ddp"], "strategies repeat"),
        (["-w", "nosuch"], "unknown workload 'nosuch'"),
        (["-w", "nosuch_module_xyz:make"], "nosuch_module_xyz"),
        (["-w", "missing_file.py:make"], "no such file"),
        (["-n", "2", "--rates", "1gbit"], "need one per machine (2)"),
        (["--rate", "fast"], "cannot parse 'fast'"),
        (["--timeout", "-1"], "seconds > 0, got '-1'"),
        (["--sweep-world-sizes", "2,x"], "--sweep-world-sizes: expected ints"),
    ],
)
def test_bench_rejects_bad_input_before_starting(
    argv: list[str],
    said: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lowband.bench import runner
    from lowband.cli import main

    class NoTestbed:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pytest.fail("the testbed started")

    monkeypatch.setattr(runner, "Testbed", NoTestbed)
    out = tmp_path / "out"
    assert main(["bench", *argv, "--mode", "loopback", "--force", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_list_shows_every_strategys_options_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from lowband.cli import main
    from lowband.strategies.registry import STRATEGIES

    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "localsgd" in out and "      period=5: an int >= 1 (steps); " in out
    for name in STRATEGIES.names():  # every option, with its default, what it takes and its doc
        for line in STRATEGIES.options(name).help():
            assert f"      {line}\n" in out, (name, line)
        assert describe_options(STRATEGIES, name) == STRATEGIES.options(name).describe()


def test_build_layout_covers_flat_heterogeneous_and_two_tier() -> None:
    flat = build_layout(3, rate="100mbit", delay_ms=5.0)
    assert (
        flat.world_size == 3 and {m.up for m in flat.machines} == {1e8} and flat.machines[0].delay_ms == 5.0
    )
    het = build_layout(2, rates=["1gbit", "10mbit"])
    assert [m.down for m in het.machines] == [1e9, 1e7]
    tiers = build_layout(4, rate="1gbit", ranks_per_machine=2, intra_rate="10gbit")
    assert tiers.n_machines == 2 and tiers.intra == 1e10 and tiers.machine_of(3) == 1
    mixed = build_layout(4, rates=["1gbit", "100mbit"], ranks_per_machine=2)
    assert [m.up for m in mixed.machines] == [1e9, 1e8]
    with pytest.raises(InvalidArgumentError, match="must divide"):
        build_layout(3, rate="1gbit", ranks_per_machine=2)


def test_loopback_fallback_runs_the_script_and_says_unshaped(tmp_path: Path) -> None:
    cmd = [PY, "-m", "lowband.cli", "run", "-n", "2", "--mode", "loopback", "--timeout", "60"]
    out = subprocess.run(
        [*cmd, str(SCRIPT), "allreduce", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "UNSHAPED" in out.stderr and "bytes not measured" in out.stdout, (out.stdout, out.stderr)
