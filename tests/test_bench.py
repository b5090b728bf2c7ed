"""The bench: metric definitions on synthetic records (pure), and the whole runner on a tiny
configuration (real rank processes; loopback, and emulated links when root)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import lowband
from lowband.bench.config import BenchConfig
from lowband.bench.metrics import COMPUTE, smoothed, summarize, time_to_target
from lowband.bench.runner import run_bench
from lowband.errors import InvalidArgumentError
from lowband.testbed import have_root
from lowband.testing import run_threads


def _run(
    step: float, losses: list[float], tx: float | list[float], n: int = 2, rounds: int = 2
) -> dict[str, object]:
    """Synthetic raw records: every step ``step`` s; rank r sends and receives ``tx`` (or ``tx[r]``)
    bytes per step."""
    per = len(losses) // rounds
    txs = tx if isinstance(tx, list) else [tx] * n
    segs = []
    for r in range(rounds):
        ls = losses[r * per : (r + 1) * per]
        segs.append(
            {
                "round": r, "first_step": r * per, "step_times": [step] * per, "loss": ls,
                "wall_end": (r + 1) * per * step, "items": 10 * per, "tx_bytes": [t * per for t in txs],
                "rx_bytes": [t * per for t in txs], "starts": [[0.0] * per] * n, "ends": [[step] * per] * n,
            }
        )  # fmt: skip
    return {"label": "x", "segments": segs, "evals": [], "in_sync": True, "replica_spread": 0.0}


def test_metrics_definitions() -> None:
    raw = {
        "world_size": 2,
        "runs": {
            "ddp": _run(0.4, [4, 3, 2, 1], tx=2e6),
            "localsgd:period=2": _run(0.2, [4, 3, 2.5, 2], tx=2.5e5),
            COMPUTE: _run(0.1, [4, 3, 2, 1], tx=0),
        },
    }
    rates = [(1e8, 1e8)] * 2
    s = summarize(raw, warmup_rounds=1, rank_rates=rates, bytes_sharing=1, baselines=["ddp"], smooth=1)
    ddp, loc = s["strategies"]["ddp"], s["strategies"]["localsgd:period=2"]
    assert ddp["iter_time_median"] == pytest.approx(0.4)
    assert ddp["throughput"] == pytest.approx(20 / 0.8)
    assert ddp["compute_time"] == pytest.approx(0.1)
    assert ddp["comm_not_overlapped"] == pytest.approx(0.3)
    assert ddp["bound"] == pytest.approx(2e6 * 8 / 1e8)  # wire time 160 ms > 100 ms of computation
    assert ddp["efficiency"] == pytest.approx(0.16 / 0.4)
    assert loc["bound"] == pytest.approx(0.1)  # 20 ms on the wire < 100 ms of computation
    assert loc["speedup_vs"]["ddp"] == pytest.approx(2.0)
    # default target: the worst final loss (2.0, localsgd) -> ddp reaches it at step 3, localsgd at step 4
    assert s["target_loss"] == 2.0
    assert ddp["time_to_target"] == pytest.approx(1.2)
    assert loc["time_to_target"] == pytest.approx(0.8)
    assert loc["time_to_target_ratio_vs"]["ddp"] == pytest.approx(1.5)
    assert smoothed([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    assert time_to_target(raw["runs"]["ddp"], 0.5, 1) is None  # type: ignore[arg-type]


def test_metrics_count_every_step_and_the_synchronize_tail() -> None:
    """A strategy whose step k waits for step k-1's communication (0.2 s of it overlapped): each round's
    first step has nothing to wait for (0.1 s), the others 0.3 s, and the last step's 0.2 s tail is
    waited for in synchronize(): the round's mean is (0.1 + 0.3 + 0.3 + 0.2) / 3 = 0.3 s, the steady
    state. A periodic strategy (an averaging of 0.4 s in the first step of each 3-step period, rounds of
    3 steps) is charged its averaging in every round: (0.5 + 0.1 + 0.1) / 3, not (0.1 + 0.1) / 2 as when
    a round's first step was left out. The time to target counts every step and every tail."""
    run = _run(0.3, [4, 3, 2, 1, 1, 1], tx=1e5, rounds=2)
    wall = 0.0
    for seg in run["segments"]:  # type: ignore[attr-defined]
        seg["step_times"][0] = 0.1
        seg["sync_tail"] = 0.2
        wall = seg["wall_end"] = wall + sum(seg["step_times"]) + 0.2
    per = _run(0.1, [4, 3, 2, 1, 1, 1], tx=1e5, rounds=2)
    wall = 0.0
    for seg in per["segments"]:  # type: ignore[attr-defined]
        seg["step_times"][0] = 0.5
        wall = seg["wall_end"] = wall + sum(seg["step_times"])
    raw = {"world_size": 2, "runs": {"overlap": run, "periodic": per}}
    rows = summarize(raw, warmup_rounds=0, rank_rates=None, bytes_sharing=1, baselines=[], smooth=1)
    row = rows["strategies"]["overlap"]
    assert row["iter_time_median"] == pytest.approx(0.3) and row["iter_time_mean"] == pytest.approx(0.3)
    assert row["throughput"] == pytest.approx(10 / 0.3)  # 10 items per step
    # loss 1 at step 4: the second round's first step, after the first round and its tail
    assert row["time_to_target"] == pytest.approx(0.1 + 0.3 + 0.3 + 0.2 + 0.1)
    assert rows["strategies"]["periodic"]["iter_time_median"] == pytest.approx(0.7 / 3)
    assert row["bytes_sent_per_rank_step"] == pytest.approx(1e5)  # the counters span whole rounds


def test_metrics_heterogeneous_links() -> None:
    """The bound takes each rank's bytes at that rank's own rates: the busy rank 0 on a fast link and
    the idle rank 2 on a slow one. The step takes 200 ms, the slow link needs 160 ms of it: efficiency
    0.8 (the slowest rate applied to the busiest rank's bytes would give a bound of 3.2 s: 16)."""
    tx = [4e6, 1e6, 2e5]
    raw = {
        "world_size": 3,
        "runs": {"ps": _run(0.2, [3, 2, 1, 1], tx=tx, n=3), COMPUTE: _run(0.01, [3, 2, 1, 1], tx=0, n=3)},
    }
    rates: list[tuple[float | None, float | None]] = [(1e9, 1e9), (1e9, 1e9), (1e7, 1e7)]
    row = summarize(raw, warmup_rounds=1, rank_rates=rates, bytes_sharing=1, baselines=[])["strategies"]["ps"]
    # rank 0: 4 MB at 1 Gbit/s = 32 ms; rank 1: 8 ms; rank 2: 0.2 MB at 10 Mbit/s = 160 ms
    assert row["wire_time"] == pytest.approx(0.16)
    assert row["bound"] == pytest.approx(0.16) and row["efficiency"] == pytest.approx(0.8)
    fast = [(1e9, 1e9)] * 3
    row = summarize(raw, warmup_rounds=1, rank_rates=fast, bytes_sharing=1, baselines=[])["strategies"]["ps"]
    assert row["bound"] == pytest.approx(0.032) and row["efficiency"] == pytest.approx(0.16)
    # one direction unshaped, and a rank on an unshaped link, add no wire time
    half = [(1e9, None), (None, None), (None, 1e7)]
    row = summarize(raw, warmup_rounds=1, rank_rates=half, bytes_sharing=1, baselines=[])["strategies"]["ps"]
    assert row["wire_time"] == pytest.approx(0.16)
    row = summarize(raw, warmup_rounds=1, rank_rates=None, bytes_sharing=1, baselines=[])["strategies"]["ps"]
    assert row["wire_time"] is None and row["bound"] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="2 rank rates for 3 ranks"):
        summarize(raw, warmup_rounds=1, rank_rates=fast[:2], bytes_sharing=1, baselines=[])


def test_link_shares_of_layouts() -> None:
    """Each rank's rates for its counted bytes: its own link, or its share of a two-tier machine link."""
    from lowband.bench.runner import link_shares
    from lowband.testbed import Layout

    assert link_shares(Layout.heterogeneous(["1gbit", "10mbit"])) == [(1e9, 1e9), (1e7, 1e7)]
    assert link_shares(Layout.two_tier(2, 2, "100mbit")) == [(5e7, 5e7)] * 4
    assert link_shares(Layout.flat(2, None)) == [(None, None)] * 2


def test_config_validation() -> None:
    for bad, msg in (
        ({"strategies": ["nope"]}, "unknown strategy 'nope'"),
        ({"strategies": ["ddp", "ddp"]}, "repeat"),
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"rounds": 2, "warmup_rounds": 2}, "warmup_rounds"),
        ({"world_size": 4, "ranks_per_machine": 3}, "must divide"),
        ({"mode": "wifi"}, "mode must be"),
        ({"eval_items": -1}, "eval_items must be an int >= 0"),
    ):
        with pytest.raises(InvalidArgumentError, match=msg):
            BenchConfig(**bad).validate()  # type: ignore[arg-type]


def _tiny(tmp_path: Path, mode: str) -> BenchConfig:
    return BenchConfig(
        workload="fmnist-cnn", strategies=["ddp", "localsgd:period=2"], world_size=2, rate="200mbit",
        mode=mode, rounds=2, steps_per_round=4, warmup_rounds=1, eval_items=64, out_dir=str(tmp_path / "out"),
    )  # fmt: skip


def _check(res: dict[str, object], out: Path) -> None:
    on_disk = json.loads((out / "results.json").read_text())
    rows = on_disk["summary"]["strategies"]
    assert set(rows) == {"ddp", "localsgd:period=2"}
    for name in ("loss.png", "iteration.png", "timeline.png", "results.md"):
        assert (out / name).stat().st_size > 500
    ddp, loc = rows["ddp"], rows["localsgd:period=2"]
    assert ddp["in_sync"] and ddp["replica_spread"] == 0.0  # DDP keeps replicas identical
    assert ddp["steps"] == loc["steps"] == 8
    # DDP allreduces every step; local SGD (H=2) averages every other step: about half the bytes
    params = on_disk["raw"]["runs"]["ddp"]["params"]
    assert ddp["bytes_sent_per_rank_step"] > 0.9 * 4 * params
    assert loc["bytes_sent_per_rank_step"] < 0.7 * ddp["bytes_sent_per_rank_step"]
    assert ddp["compute_time"] > 0 and ddp["iter_time_median"] > 0
    assert "localsgd:period=2" in str(res["markdown"]) and "H=2" not in str(res["markdown"])
    for key in ("ddp", "localsgd:period=2"):  # every rank's Strategy.report, rank 0's as "report"
        run = on_disk["raw"]["runs"][key]
        assert len(run["report_ranks"]) == 2 and run["report"] == run["report_ranks"][0]


def test_runner_loopback(tmp_path: Path) -> None:
    cfg = _tiny(tmp_path, "loopback")
    res = run_bench(cfg, timeout=240, quiet=True)
    assert res["shaped"] is False and "UNSHAPED" in str(res["markdown"])
    _check(res, Path(cfg.out_dir))


def test_runner_compressed_breakdown(tmp_path: Path) -> None:
    """``compressed`` runs in the bench beside DDP; its breakdown is measured (every rank's report),
    DDP's inferred from the compute-only run; breakdown.png is drawn."""
    spec = "compressed:compressor=fp16,reducer=allreduce"
    cfg = dataclasses.replace(_tiny(tmp_path, "loopback"), strategies=["ddp", spec])
    res = run_bench(cfg, timeout=240, quiet=True)
    out = Path(cfg.out_dir)
    rows = json.loads((out / "results.json").read_text())["summary"]["strategies"]
    comp, ddp = rows[spec]["breakdown"], rows["ddp"]["breakdown"]
    assert comp["source"] == "measured" and ddp["source"] == "inferred" and ddp["compression_s"] is None
    assert comp["compression_s"] > 0 and comp["compute_s"] > 0 and comp["comm_s"] >= 0
    # a rank's own step time, averaged over ranks, cannot exceed the job's pace by more than noise
    assert sum(comp[k] for k in ("compute_s", "compression_s", "comm_s")) <= 1.5 * rows[spec]["iter_time_max"]
    assert rows[spec]["report"]["transport"] == "allreduce" and rows[spec]["bytes_sent_per_rank_step"] > 0
    assert (out / "breakdown.png").stat().st_size > 500
    assert "compute / compression / comm ms" in str(res["markdown"])


@pytest.mark.skipif(not have_root(), reason="emulated links need root (network namespaces + tc)")
def test_runner_shaped_cli(tmp_path: Path) -> None:
    """``lowband bench`` itself, on network namespaces with tbf at 200 Mbit/s."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "lowband.cli", "bench", "-n", "2", "--rate", "200mbit", "--mode", "netns",
        "-s", "ddp+localsgd:period=2", "--rounds", "2", "--steps-per-round", "4", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "netns+tbf" in proc.stdout and "results.json" in proc.stdout
    res = json.loads((out / "results.json").read_text())
    assert res["shaped"] is True and res["link_rate_bits"] == 2e8
    _check({"markdown": proc.stdout}, out)


@pytest.mark.skipif(not have_root(), reason="emulated links need root (network namespaces + tc)")
def test_runner_heterogeneous_cli(tmp_path: Path) -> None:
    """``--rates``: one rank at 400 Mbit/s, one at 50 Mbit/s. The bound is each rank's bytes at its own
    rate (the slow rank's here), and no strategy is more efficient than the links allow."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "lowband.cli", "bench", "-n", "2", "--rates", "400mbit,50mbit", "--mode",
        "netns", "-s", "ddp", "--rounds", "2", "--steps-per-round", "4", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["shaped"] is True and res["link_rate_bits"] == 5e7
    row = res["summary"]["strategies"]["ddp"]
    segs = [s for s in res["raw"]["runs"]["ddp"]["segments"] if s["round"] >= 1]
    steps = sum(len(s["step_times"]) for s in segs)
    per_rank = [
        max(sum(s["tx_bytes"][r] for s in segs), sum(s["rx_bytes"][r] for s in segs)) / steps for r in (0, 1)
    ]
    assert row["wire_time"] == pytest.approx(max(per_rank[0] * 8 / 4e8, per_rank[1] * 8 / 5e7))
    assert 0 < row["efficiency"] <= 1.1, row


def test_collectives_loopback(tmp_path: Path) -> None:
    """``--collectives``: every op timed at every size, ratios to the first op, table and plot written."""
    from lowband.bench.collectives import parse_size

    assert parse_size("16MB") == 16_000_000 and parse_size("4MiB") == 4 * 2**20 and parse_size("64") == 64
    with pytest.raises(InvalidArgumentError):
        parse_size("3 parsecs")
    ops = ["allreduce", "neighbor_allreduce:topology=ring", "neighbor_allreduce:topology=dynamic-exp2"]
    cfg = BenchConfig(
        world_size=3, mode="loopback", rounds=2, reps=2, sizes=[4096, 65536], collectives=ops,
        out_dir=str(tmp_path / "c"),
    )  # fmt: skip
    res = run_bench(cfg, timeout=240, quiet=True)
    rows = res["summary"]["rows"]
    assert list(rows) == ops
    for op in ops:
        for size in ("4096", "65536"):
            r = rows[op][size]
            assert r["samples"] == 4 and 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
    assert rows["allreduce"]["4096"]["ratio_to_allreduce"] == 1.0
    assert (tmp_path / "c" / "collectives.png").stat().st_size > 1000
    assert "neighbor_allreduce:topology=ring" in (tmp_path / "c" / "results.md").read_text()
    with pytest.raises(InvalidArgumentError, match="unknown collective"):
        BenchConfig(collectives=["allgather_of_doom"]).validate()


def test_bench_refuses_ranks_the_machine_cannot_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lowband bench -n 100`` on a 24 GB, 2-core machine stops with the estimate before any testbed
    or rank starts; ``force`` gets past the check."""
    from lowband.bench import resources, runner
    from lowband.cli import main

    small = resources.Machine(available_bytes=24 * 10**9, cores=2)
    started: list[object] = []

    class NoTestbed:
        def __init__(self, *args: object, **kwargs: object) -> None:
            started.append(args)
            raise RuntimeError("testbed started")

    monkeypatch.setattr(runner, "machine", lambda: small)
    monkeypatch.setattr(runner, "Testbed", NoTestbed)
    out = tmp_path / "out"
    assert main(["bench", "-n", "100", "--mode", "loopback", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowband bench -n 100: refusing to start") and "--force" in err
    assert "100 ranks need about 30.0 GB (300 MB per rank" in err and "24.0 GB available" in err
    assert "100 ranks x 1 thread(s) on 2 core(s)" in err
    assert not started and not out.exists()

    ok = BenchConfig(world_size=4, out_dir=str(out))
    runner.check_machine(ok)  # the demo's 4 ranks fit
    with pytest.raises(InvalidArgumentError, match="9 ranks x 1 thread"):
        runner.check_machine(dataclasses.replace(ok, world_size=9))  # memory fits, cores do not
    with pytest.raises(RuntimeError, match="testbed started"):
        runner.run_bench(dataclasses.replace(ok, world_size=100, mode="loopback"), force=True)
    assert len(started) == 1


def test_time_limit_ends_the_bench_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--time-limit`` caps the whole bench (the ranks are killed) and the error names the option."""
    from lowband.cli import main

    out = tmp_path / "out"
    args = ["bench", "-n", "2", "--mode", "loopback", "--rounds", "50", "--out", str(out), "-s", "ddp"]
    assert main([*args, "--time-limit", "1"]) != 0
    err = capsys.readouterr().err
    assert "reached its time limit of 1 s (--time-limit" in err and "killed them" in err, err
    assert not (out / "results.json").exists()
    assert main([*args, "--time-limit", "0"]) == 2
    assert "argument --time-limit: expected a number of seconds > 0" in capsys.readouterr().err


def _reports() -> list[dict[str, object]]:
    from lowband.bench.worker import gather_reports

    r = lowband.rank()
    return gather_reports({"rank": r, "table": [[r] * r], "name": "é" * r})


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gather_reports_every_rank(n: int) -> None:
    """Every rank's Strategy.report, in rank order, on every rank (uneven JSON lengths)."""
    expect = [{"rank": r, "table": [[r] * r], "name": "é" * r} for r in range(n)]
    assert run_threads(_reports, n, timeout=60) == [expect] * n


def _bad_report() -> str:
    from lowband.bench.worker import gather_reports

    try:
        gather_reports({"x": object()} if lowband.rank() == 1 else {"x": 1})
    except InvalidArgumentError as exc:
        return str(exc)
    return "no error"


def test_gather_reports_refuses_what_is_not_json_on_every_rank() -> None:
    for msg in run_threads(_bad_report, 2, timeout=60):
        assert "Strategy.report on rank 1: the report is not JSON-able" in msg


def test_summary_carries_the_report() -> None:
    run = _run(0.1, [2, 1], tx=0)
    run["report"] = {"table": {"1024": 0.5}}
    raw = {"world_size": 2, "runs": {"x": run, COMPUTE: _run(0.05, [2, 1], tx=0)}}
    row = summarize(raw, warmup_rounds=0, rank_rates=None, bytes_sharing=1, baselines=[])["strategies"]["x"]
    assert row["report"] == {"table": {"1024": 0.5}}


def test_breakdown_measured_over_timed_steps_and_ranks(tmp_path: Path) -> None:
    """A strategy's own per-step breakdown is averaged over the timed steps (after the warm-up round)
    and over every rank's report; one without it gets the split inferred from the compute-only run."""
    run = _run(0.1, [4, 3, 2, 1], tx=0)  # two rounds of two steps: steps 0-1 untimed, 2-3 timed

    def bd(scale: float) -> dict[str, object]:
        return {"first_step": 0, "compute_s": [9.0, 9.0, 0.04 * scale, 0.06 * scale],
                "compression_s": [9.0, 9.0, 0.01, 0.01], "comm_s": [9.0, 9.0, 0.02, 0.04]}  # fmt: skip

    run["report_ranks"] = [{"breakdown": bd(1)}, {"breakdown": bd(2)}]
    raw = {"world_size": 2, "runs": {"c": run, "ddp": _run(0.2, [4, 3, 2, 1], tx=0),
                                     COMPUTE: _run(0.05, [4, 3, 2, 1], tx=0)}}  # fmt: skip
    s = summarize(raw, warmup_rounds=1, rank_rates=None, bytes_sharing=1, baselines=[])
    c, ddp = s["strategies"]["c"]["breakdown"], s["strategies"]["ddp"]["breakdown"]
    assert c["source"] == "measured"
    assert c["compute_s"] == pytest.approx((0.04 + 0.06 + 0.08 + 0.12) / 4)
    assert c["compression_s"] == pytest.approx(0.01) and c["comm_s"] == pytest.approx(0.03)
    assert ddp == {
        "source": "inferred",
        "compute_s": 0.05,
        "compression_s": None,
        "comm_s": pytest.approx(0.15),
    }
    from lowband.bench.report import markdown_table, plot_breakdown

    assert "75.0 / 10.0 / 30.0 |" in markdown_table(s, "samples")
    assert "50.0* / - / 150.0* |" in markdown_table(s, "samples")
    plot_breakdown(s, tmp_path / "b.png", "t")
    assert (tmp_path / "b.png").stat().st_size > 500


def test_list_shows_the_compressed_options_and_registries() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lowband.cli", "bench", "--list"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert (
        "  compressed " in out
        and "      compressor=identity: a compressor spec (name:key=value;...) of: " in out
    )
    assert (
        "      reducer=auto: 'auto' or a transport spec" in out
        and "      memory=residual: a memory spec" in out
    )
    from lowband.compress import COMPRESSORS, TRANSPORTS

    comp = out[out.index("compressors (") : out.index("transports (")]
    trans = out[out.index("transports (") : out.index("collectives (")]
    # lowband's own (test modules register more in this process, not in the subprocess)
    ours = [c for c in COMPRESSORS.names() if COMPRESSORS.get(c).__module__.startswith("lowband.")]
    mine = [t for t in TRANSPORTS.names() if TRANSPORTS.get(t).__module__.startswith("lowband.")]
    assert len(ours) >= 13 and len(mine) >= 5
    assert all(f"  {c} " in comp for c in ours)
    assert all(f"  {t} " in trans for t in mine)
