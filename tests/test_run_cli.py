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
        (["-n", "2", "--rate", "1gbit", "--rdzv-conf", "x=1", "job.py"], "--rdzv-conf x=1: not with"),
        (["-n", "2", "--max-restarts", "-1", "job.py"], "--max-restarts must be >= 0"),
        (["--rate", "1gbit", "job.py"], "-n N: give the number of ranks"),
        (["-n", "2", "--rate", "1gbit", "--mtu", "10", "job.py"], "mtu must be in 576..65000"),
        (["-n", "2", "--rate", "1gbit", "nosuch.py"], "no script 'nosuch.py'"),
        (["-n", "2", "--rate", "1gbit"], "give the script to run"),
        (["-n", "2", "--timeout", "0", "job.py"], "seconds > 0, got '0'"),
        (["-n", "0", "job.py"], "number of ranks >= 1, got '0'"),
        (["-n", "two", "job.py"], "number of ranks >= 1, got 'two'"),
        (["-n"], "expected one argument"),
        (["-n", "2", "--mode", "fast", "job.py"], "invalid choice: 'fast'"),
        (["-n", "2", "--keep-going", "--max-restarts", "1", "job.py"], "--keep-going and --max-restarts"),
        (
            ["-n", "2", "--keep-going", "--nnodes", "2", "job.py"],
            "--keep-going with --nnodes: --keep-going runs",
        ),
        (["-n", "2", "--keep-going", "--rdzv-conf", "x=1", "job.py"], "--keep-going with --rdzv-conf x=1"),
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


SMALL = {"available_bytes": 16 * 10**9, "cores": 2}


def test_each_rank_gets_its_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowband.bench import resources
    from lowband.run_cli import rank_threads

    monkeypatch.setattr(resources, "machine", lambda: resources.Machine(64 * 10**9, 8))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert rank_threads(3, force=False) == {"OMP_NUM_THREADS": "2"}  # 8 cores // 3 ranks
    assert rank_threads(8, force=False) == {"OMP_NUM_THREADS": "1"}
    assert rank_threads(20, force=False) == {"OMP_NUM_THREADS": "1"}  # at least 1
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's, and what lowband would set: nothing said
    assert rank_threads(4, force=False) == {} and capsys.readouterr().err == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # the user's wins, with a warning
    assert rank_threads(4, force=False) == {}
    err = capsys.readouterr().err
    assert err.startswith("lowband run: warning: OMP_NUM_THREADS=8 from your environment: 4 rank(s) x 8")
    assert "lowband would give each rank 2" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("testbed", [["--rate", "50mbit"], []], ids=["testbed", "torchrun"])
def test_run_refuses_ranks_the_machine_cannot_hold_unless_forced(
    testbed: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``run -n 64 --rate 50mbit`` on 2 cores and 16 GB: refused in one line before anything starts (it
    ran 2.5 minutes and failed with 466 lines); ``--force`` starts it, one thread per rank."""
    from lowband import torchrun
    from lowband.bench import resources
    from lowband.cli import main
    from lowband.testbed import netns, run

    (tmp_path / "job.py").write_text("raise SystemExit(7)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(resources, "machine", lambda: resources.Machine(**SMALL))
    monkeypatch.setattr(netns.Testbed, "up", lambda self: pytest.fail("the testbed started"))
    started: list[dict[str, object]] = []

    def start(*args: object, **kwargs: object) -> int:
        started.append(kwargs)
        return 0

    monkeypatch.setattr(run, "run_script", start)
    monkeypatch.setattr(torchrun, "run_command", start)
    assert main(["run", "-n", "64", *testbed, "job.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowband run -n 64: refusing to start: 64 ranks need about 19.2 GB"), err
    assert "64 ranks x 1 thread(s) on 2 core(s) is more than 4 per core" in err and "--force" in err
    assert len(err.strip().splitlines()) == 1 and not started, err
    assert main(["run", "-n", "64", *testbed, "--force", "job.py"]) == 0
    assert started[0]["env"] == {"OMP_NUM_THREADS": "1"}, started
    assert main(["run", "-n", "2", *testbed, "--log-dir", "here", "job.py"]) == 0  # 2 ranks fit
    assert started[1]["env"] == {"OMP_NUM_THREADS": "1"} and started[1]["log_dir"] == "here", started


@pytest.mark.parametrize("testbed", [["--mode", "loopback"], []], ids=["testbed", "torchrun"])
def test_ranks_compute_with_cores_over_ranks_threads(testbed: list[str], tmp_path: Path) -> None:
    import json

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [PY, "-m", "lowband.cli", "run", "-n", "2", *testbed, "--timeout", "60"]
    script = [str(TESTS / "_terminal_script.py"), "threads", str(tmp_path)]
    out = subprocess.run([*cmd, *script], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    want = max(1, len(os.sched_getaffinity(0)) // 2)
    for r in range(2):
        info = json.loads((tmp_path / f"threads{r}.json").read_text())
        assert info == {"omp": str(want), "torch": want}, info
