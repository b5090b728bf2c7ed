"""``lowband bench``: start the ranks in the testbed, train every strategy side by side, report.

The runner (this process, in the root network namespace) brings up the emulated links, writes the
config, starts one worker per rank inside its namespace (:mod:`lowband.bench.worker`), shows rank 0's
progress, and then turns the raw records into ``results.json``, PNG plots and a Markdown table.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

import lowband
from lowband.bench.config import TIME_LIMIT_S, BenchConfig
from lowband.bench.metrics import Rates, summarize
from lowband.bench.report import bench_title, plot_all, results_markdown, sweep_table, terminal_table
from lowband.bench.resources import check_resources, machine, rank_bytes
from lowband.blame import LaunchFolders, ends_of_codes, read_reports
from lowband.blame import summary as failure_lines
from lowband.errors import CommTimeoutError, LowbandError
from lowband.rank_main import RANK_MAIN, REPORT_DIR_ENV
from lowband.testbed import Layout, Testbed
from lowband.testbed.procs import wait_procs
from lowband.testbed.schedule import check_spec, place_changes, schedule_for


def link_shares(layout: Layout) -> list[Rates]:
    """Each rank's (up, down) rate for its counted bytes: its machine's link, divided among the ranks
    of a two-tier machine (their bytes are the machine link's counters divided the same way)."""
    k = layout.ranks_per_machine
    out: list[Rates] = []
    for r in range(layout.world_size):
        m = layout.machines[layout.machine_of(r)]
        out.append((None if m.up is None else m.up / k, None if m.down is None else m.down / k))
    return out


def _follow(stream: IO[bytes], bar: tqdm, log: IO[str]) -> None:
    for raw in stream:
        line = raw.decode(errors="replace").rstrip("\n")
        if line.startswith("@@progress "):
            _, done, total, what = line.split(" ", 3)
            bar.total = int(total)
            bar.n = int(done)
            bar.set_postfix_str(what, refresh=False)
            bar.refresh()
        else:
            log.write(line + "\n")
            log.flush()


def check_machine(cfg: BenchConfig) -> None:
    """Refuse (with the estimate) a bench whose ranks this machine cannot hold: first on torch's
    footprint alone (instant, whatever the workload), then with the workload's model."""
    m, what = machine(), f"lowband bench -n {cfg.world_size}"
    check_resources(cfg.world_size, cfg.threads, rank_bytes(0), m, what)
    if cfg.collectives is not None:
        model_bytes = max(cfg.sizes, default=0)
    else:
        from lowband.bench.precision import check_model_device, device_type
        from lowband.bench.workloads import get_workload

        model = get_workload(cfg.workload).build_model(cfg.seed)
        check_model_device("lowband bench", model, device_type(cfg.device))  # also on every rank
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    check_resources(cfg.world_size, cfg.threads, rank_bytes(model_bytes), m, what)


def run_bench(
    cfg: BenchConfig,
    *,
    timeout: float = TIME_LIMIT_S,
    quiet: bool = False,
    force: bool = False,
    log_dir: str | None = None,
) -> dict[str, Any]:
    """Run one bench (one workload, one link setting); returns the results also written to
    ``cfg.out_dir/results.json``. Refuses ranks the machine cannot hold (:func:`check_machine`)
    unless ``force``. Each rank's output goes to ``log_dir/rankR.log`` (default ``cfg.out_dir/logs``);
    a failed run raises :class:`LowbandError` with one line per distinct cause (:mod:`lowband.blame`)."""
    cfg.validate()
    from lowband.bench.workloads import canonical_spec, get_workload, is_spec

    if cfg.collectives is None and is_spec(cfg.workload):
        # a user's workload: loaded here, before anything starts (a failure is one line), and named by
        # an absolute path for the ranks, which load it again by the same spec
        cfg = dataclasses.replace(cfg, workload=canonical_spec(cfg.workload))
        get_workload(cfg.workload)
    if not force:
        check_machine(cfg)
    out = Path(cfg.out_dir)
    log_path = Path(log_dir) if log_dir is not None else out / "logs"
    log_path.mkdir(parents=True, exist_ok=True)
    (out / "raw.json").unlink(missing_ok=True)
    cfg_path = out / "config.json"
    cfg.save(cfg_path)
    layout = cfg.layout()
    check_spec(cfg.rate_change, layout, cfg.mode, "lowband bench: --rate-change")  # shaping available
    started = datetime.datetime.now().isoformat(timespec="seconds")
    reports = LaunchFolders(str(log_path), "lowband-bench")  # the ranks' reports; the logs are ours
    with Testbed(layout, mode=cfg.mode, mtu=cfg.mtu) as tb:
        sched = schedule_for(tb, cfg.rate_change, "lowband bench")
        logs = [open(log_path / f"rank{r}.log", "w") for r in range(cfg.world_size)]  # noqa: SIM115
        try:
            stdouts: list[Any] = [subprocess.PIPE, *logs[1:]]
            procs = tb.spawn(
                [sys.executable, RANK_MAIN, "-m", "lowband.bench.worker", str(cfg_path.resolve())],
                env={
                    "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": str(cfg.threads),
                    REPORT_DIR_ENV: reports.reports,
                },
                stdout=stdouts,
                stderr=logs,
            )
            if sched is not None:
                sched.start()  # time 0 of --rate-change: the launch of the ranks
            what = "collectives" if cfg.collectives is not None else Path(cfg.workload).name
            unit = "timing" if cfg.collectives is not None else "step"
            bar = tqdm(desc=f"bench {what}, {tb.label()}", unit=unit, disable=quiet, file=sys.stderr)
            follower = threading.Thread(target=_follow, args=(procs[0].stdout, bar, logs[0]), daemon=True)
            follower.start()
            stopped, killed, ended_at = list[int](), list[int](), dict[int, float]()
            try:
                codes = wait_procs(
                    procs, timeout, grace=10.0, stopped=stopped, killed=killed, ended_at=ended_at
                )
            except CommTimeoutError as e:
                raise CommTimeoutError(
                    f"lowband bench: the run reached its time limit of {timeout:g} s (--time-limit; nothing "
                    f"was saved): {e}"
                ) from None
            follower.join(timeout=10)
            bar.set_postfix_str("ranks done: taking the testbed down, writing the results and plots")
            bar.close()
        finally:
            changes = sched.stop() if sched is not None else []
            for f in logs:
                f.close()
            said = read_reports(reports.reports)
            reports.close()
        if any(codes):
            seen = {r: ended_at[r] for r in stopped if r in ended_at}
            ends = ends_of_codes(codes, ended_at, killed)
            lines = failure_lines(ends, said, seen, "lowband bench", str(log_path), "lowband bench")
            raise LowbandError("\n".join(lines))
        if not (out / "raw.json").exists():
            raise LowbandError(
                f"lowband bench: every rank exited 0 but rank 0 wrote no results (logs: {log_path})"
            )
        shaped, label = tb.shaped, tb.label()
    raw = json.loads((out / "raw.json").read_text())
    changes = place_changes(changes, raw.get("epoch0"))
    link_rate = layout.bottleneck() if shaped else None
    rank_rates = link_shares(layout) if shaped else None
    if cfg.collectives is not None:
        return _collectives_results(cfg, raw, out, started, label, shaped, link_rate, tb.reason, changes)
    sharing = cfg.ranks_per_machine if shaped else cfg.world_size
    summary = summarize(
        raw,
        warmup_rounds=cfg.warmup_rounds,
        rank_rates=rank_rates,
        bytes_sharing=sharing,
        baselines=cfg.baselines,
        target_loss=cfg.target_loss,
        smooth=min(10, cfg.steps_per_round),
    )
    results = {
        "lowband_version": lowband.__version__,
        "started": started,
        "config": dataclasses.asdict(cfg),
        "testbed": label,
        "shaped": shaped,
        "link_rate_bits": link_rate,
        "workload": raw["workload"],
        "unit": raw["unit"],
        "batch_size_per_rank": raw["batch_size"],
        "device": raw.get("device", "cpu"),
        "precision": raw.get("precision", cfg.precision),
        "testbed_reason": tb.reason,
        "rate_changes": changes,
        "summary": summary,
        "raw": raw,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    title = bench_title(results)
    plots = plot_all(raw, summary, out, title, smooth=min(10, cfg.steps_per_round))
    md = results_markdown(results)  # also what `lowband bench --replot` writes
    (out / "results.md").write_text(md)
    results["markdown"] = md
    results["terminal"] = f"{title}\n\n{terminal_table(summary)}" + (
        "" if shaped else "\nUNSHAPED (loopback)"
    )
    results["plots"] = [str(p) for p in plots]
    return results


def _collectives_results(
    cfg: BenchConfig,
    raw: dict[str, Any],
    out: Path,
    started: str,
    label: str,
    shaped: bool,
    link_rate: float | None,
    reason: str,
    changes: list[dict[str, Any]],
) -> dict[str, Any]:
    from lowband.bench.collectives import collectives_table, plot_collectives, summarize_collectives

    summary = summarize_collectives(raw)
    title = f"collectives, {cfg.world_size} ranks, {label}"
    results: dict[str, Any] = {
        "lowband_version": lowband.__version__,
        "started": started,
        "config": dataclasses.asdict(cfg),
        "testbed": label,
        "shaped": shaped,
        "link_rate_bits": link_rate,
        "rate_changes": changes,
        "summary": summary,
        "raw": raw,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot = out / "collectives.png"
    plot_collectives(summary, cfg.sizes, plot, title)
    header = (
        f"### {title}\n\n{cfg.rounds} rounds x {cfg.reps} timed ops per op and size, alternated; "
        "time = slowest rank, barrier to completion"
        + ("" if shaped else "\n\n**UNSHAPED** (loopback): " + reason)
    )
    md = f"{header}\n\n{collectives_table(summary, cfg.sizes)}\n"
    (out / "results.md").write_text(md)
    results["markdown"] = md
    results["plots"] = [str(plot)]
    return results


def run_sweep(
    cfg: BenchConfig,
    rates: list[str | None],
    world_sizes: list[int],
    *,
    timeout: float = TIME_LIMIT_S,
    force: bool = False,
    log_dir: str | None = None,
) -> dict[str, Any]:
    """One bench per (link rate, world size); prints speed-up tables like the papers' Table 1. Each
    bench's logs go to its own folder (``log_dir/n{N}_{RATE}`` when ``log_dir`` is given)."""
    if not force:  # refuse before the first run starts, not after the small ones
        check_machine(dataclasses.replace(cfg, world_size=max(world_sizes)))
    points = []
    base = Path(cfg.out_dir)
    for n in world_sizes:
        for rate in rates:
            setting = f"n={n}, {rate or 'unshaped'}"
            sub = dataclasses.replace(
                cfg, world_size=n, rate=rate, out_dir=str(base / f"n{n}_{rate or 'unshaped'}")
            )
            if rate is None:
                sub.mode = "loopback"
            logs = None if log_dir is None else str(Path(log_dir) / Path(sub.out_dir).name)
            res = run_bench(sub, timeout=timeout, force=force, log_dir=logs)
            print(res["terminal"])
            points.append({"setting": setting, "testbed": res["testbed"], "summary": res["summary"]})
    baseline = cfg.baselines[0]
    table = sweep_table(points, baseline)
    (base / "sweep.json").write_text(json.dumps({"points": points, "baseline": baseline}, indent=1))
    (base / "sweep.md").write_text(table + "\n")
    return {"points": points, "table": table}
