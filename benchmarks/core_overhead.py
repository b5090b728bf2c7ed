"""Core overhead benchmark: lowband's collectives against raw ``torch.distributed`` on real processes.

For each world size (default 2 and 4 local ranks, started with :func:`lowband.launch`, gloo on CPU):

1. **allreduce sweep** (float32, ``op="sum"``, in place) over message sizes 1 KB .. 64 MB, three
   strategies side by side in the same run: raw ``torch.distributed.all_reduce`` on the default
   process group, ``lowband.allreduce`` with the cross-rank argument check on (the default), and
   ``lowband.allreduce`` with the check off. The strategies are interleaved (one repetition of each,
   in an order rotated every repetition) so that drift on a shared machine hits all of them alike.
2. **fusion**: 1,000 float32 tensors of 4 KB each, reduced one op per tensor (nonblocking
   ``lowband.iallreduce`` + ``wait_all``, and a blocking loop), fused (``lowband.grouped_allreduce``),
   and with raw torch per-tensor loops for reference; with the check on and off.

Every timed iteration is: ``dist.barrier()``, then ``time.perf_counter`` around the op alone. The
iteration's time is the slowest rank's (a MAX allreduce of the per-rank times, outside the timed
region). Inputs are refilled before every iteration (outside the timed region) so each strategy
starts from the same data and cache state.

Usage::

    python benchmarks/core_overhead.py                     # full sweep, ~5-8 min on 2 cores
    python benchmarks/core_overhead.py --quick             # smoke run, < 1 min
    python benchmarks/core_overhead.py --world-sizes 2 --sizes 1MB,16MB --reps 20

Writes raw per-repetition timings, summaries and metadata as JSON to ``--out`` (default
``benchmarks/results/core_overhead.json``) and a plot of overhead vs size next to it (``.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lowband
import lowband.runtime

# ----------------------------------------------------------------------------- settings

UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}
DEFAULT_SIZES = "1KB,4KB,16KB,64KB,256KB,1MB,4MB,16MB,64MB"
QUICK_SIZES = "1KB,64KB,1MB"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "core_overhead.json"

OVERHEAD_TARGET_PCT = 3.0
OVERHEAD_TARGET_MIN_BYTES = 1024**2
FUSION_TARGET_RATIO = 5.0

SWEEP_STRATEGIES = ("raw", "lowband", "lowband_nocheck")
FUSION_STRATEGIES = (
    "raw_loop",  # dist.all_reduce per tensor, blocking
    "raw_async",  # dist.all_reduce(async_op=True) per tensor, then wait all
    "unfused_nonblocking",  # lowband.iallreduce per tensor + wait_all (check on)
    "unfused_blocking",  # lowband.allreduce per tensor (check on)
    "fused",  # lowband.grouped_allreduce (check on)
    "unfused_nonblocking_nocheck",
    "unfused_blocking_nocheck",
    "fused_nocheck",
)
# (numerator, denominator) pairs reported as "how many times slower than fused"
FUSION_RATIOS = (
    ("unfused_nonblocking", "fused"),
    ("unfused_blocking", "fused"),
    ("unfused_nonblocking_nocheck", "fused_nocheck"),
    ("unfused_blocking_nocheck", "fused_nocheck"),
    ("raw_loop", "fused"),
    ("raw_async", "fused_nocheck"),
)


def parse_size(text: str) -> int:
    """``"4KB"`` -> 4096 (binary units: B, KB, MB, GB; a bare number is bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 512B, 4KB, 1MB, 1GB")
    unit = m.group(2) or "B"
    if not unit.endswith("B"):
        unit += "B"
    nbytes = int(float(m.group(1)) * UNITS[unit])
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(
            f"size {text!r} = {nbytes} bytes is not a positive multiple of 4 (float32)"
        )
    return nbytes


def parse_sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(parse_size(s) for s in text.split(",") if s.strip())
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def parse_world_sizes(text: str) -> tuple[int, ...]:
    try:
        ws = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad world sizes {text!r}; use e.g. 2,4") from exc
    if not ws or any(w < 1 for w in ws):
        raise argparse.ArgumentTypeError(f"world sizes must be ints >= 1, got {text!r}")
    return ws


def fmt_size(nbytes: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}"
    return f"{nbytes}B"


def default_reps(nbytes: int) -> int:
    """Fewer repetitions for big messages so the default sweep stays within minutes."""
    return max(5, min(50, int(2e8 / nbytes)))


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every rank runs (picklable: it travels to the spawned ranks)."""

    sizes: tuple[int, ...]
    reps: int | None  # None: default_reps(size)
    warmup: int
    fusion_tensors: int
    fusion_numel: int
    fusion_reps: int
    fusion_warmup: int

    def reps_for(self, nbytes: int) -> int:
        return self.reps if self.reps is not None else default_reps(nbytes)


# ----------------------------------------------------------------------------- per-rank side


@contextlib.contextmanager
def lowband_check(enabled: bool) -> Iterator[None]:
    """Turn lowband's cross-rank argument check on/off for the calls inside, without re-init.

    The runtime context holds a (mutable) :class:`lowband.config.Config` that every op reads at call
    time; swap in a copy with ``check`` replaced and put the original back afterwards. Every rank runs
    the same schedule, so all ranks always agree on the setting.
    """
    ctx = lowband.runtime.current("benchmark")
    saved = ctx.config
    ctx.config = dataclasses.replace(saved, check=enabled)
    try:
        yield
    finally:
        ctx.config = saved


def timed(op: Callable[[], object]) -> float:
    """Seconds the slowest rank spent in ``op`` (barrier first; the MAX reduction is not timed)."""
    dist.barrier()
    t0 = time.perf_counter()
    op()
    elapsed = time.perf_counter() - t0
    buf = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return float(buf.item())


def _expect_value(ts: Sequence[torch.Tensor], value: float, what: str) -> None:
    for t in (ts[0], ts[-1]):
        if t.numel() and not (float(t.reshape(-1)[0]) == value and float(t.reshape(-1)[-1]) == value):
            raise RuntimeError(
                f"benchmark sanity check failed for {what}: expected {value}, got {t.reshape(-1)[:4]}"
            )


def _sweep_ops(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[bool, Callable[[], object]]]:
    """strategy -> (lowband check setting, op)."""
    return {
        "raw": (True, lambda: dist.all_reduce(tensors["raw"], op=dist.ReduceOp.SUM)),
        "lowband": (True, lambda: lowband.allreduce(tensors["lowband"], op="sum", inplace=True)),
        "lowband_nocheck": (
            False,
            lambda: lowband.allreduce(tensors["lowband_nocheck"], op="sum", inplace=True),
        ),
    }


def _fusion_ops(
    inputs: list[torch.Tensor], raw_bufs: list[torch.Tensor], results: dict[str, list[torch.Tensor]]
) -> dict[str, tuple[bool, Callable[[], object]]]:
    """strategy -> (lowband check setting, op). lowband ops are out of place (their default)."""

    def raw_loop() -> None:
        for t in raw_bufs:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)

    def raw_async() -> None:
        works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True) for t in raw_bufs]
        for w in works:
            assert w is not None
            w.wait()

    def unfused_nonblocking(key: str) -> Callable[[], None]:
        def run() -> None:
            handles = [lowband.iallreduce(t, op="sum") for t in inputs]
            results[key] = lowband.wait_all(handles)

        return run

    def unfused_blocking(key: str) -> Callable[[], None]:
        def run() -> None:
            results[key] = [lowband.allreduce(t, op="sum") for t in inputs]

        return run

    def fused(key: str) -> Callable[[], None]:
        def run() -> None:
            results[key] = lowband.grouped_allreduce(inputs, op="sum")

        return run

    return {
        "raw_loop": (True, raw_loop),
        "raw_async": (True, raw_async),
        "unfused_nonblocking": (True, unfused_nonblocking("unfused_nonblocking")),
        "unfused_blocking": (True, unfused_blocking("unfused_blocking")),
        "fused": (True, fused("fused")),
        "unfused_nonblocking_nocheck": (False, unfused_nonblocking("unfused_nonblocking_nocheck")),
        "unfused_blocking_nocheck": (False, unfused_blocking("unfused_blocking_nocheck")),
        "fused_nocheck": (False, fused("fused_nocheck")),
    }


def rank_main(s: Settings) -> dict[str, Any] | None:
    """Runs on every rank (``lowband.init`` already called by ``lowband.launch``); rank 0 returns timings."""
    torch.set_num_threads(1)
    rank, p = lowband.rank(), lowband.size()
    progress: Any = None
    if rank == 0:
        from tqdm import tqdm

        total = sum((s.warmup + s.reps_for(n)) * len(SWEEP_STRATEGIES) for n in s.sizes)
        total += (s.fusion_warmup + s.fusion_reps) * len(FUSION_STRATEGIES)
        progress = tqdm(total=total, desc=f"world size {p}", unit="op", file=sys.stderr, dynamic_ncols=True)

    def tick(label: str) -> None:
        if progress is not None:
            progress.set_postfix_str(label, refresh=False)
            progress.update(1)

    sweep: dict[str, dict[str, list[float]]] = {}
    for nbytes in s.sizes:
        numel = nbytes // 4
        label = fmt_size(nbytes)
        tensors = {k: torch.empty(numel, dtype=torch.float32) for k in SWEEP_STRATEGIES}
        ops = _sweep_ops(tensors)
        times: dict[str, list[float]] = {k: [] for k in SWEEP_STRATEGIES}
        n_reps = s.reps_for(nbytes)
        for it in range(s.warmup + n_reps):
            rot = it % len(SWEEP_STRATEGIES)
            for key in SWEEP_STRATEGIES[rot:] + SWEEP_STRATEGIES[:rot]:
                check, op = ops[key]
                tensors[key].fill_(1.0)
                with lowband_check(check):
                    dt = timed(op)
                if it < s.warmup:
                    if it == 0:
                        _expect_value([tensors[key]], float(p), f"{key} allreduce of {label}")
                else:
                    times[key].append(dt)
                tick(label)
        sweep[label] = times
        del tensors, ops

    inputs = [torch.ones(s.fusion_numel, dtype=torch.float32) for _ in range(s.fusion_tensors)]
    raw_bufs = [torch.empty(s.fusion_numel, dtype=torch.float32) for _ in range(s.fusion_tensors)]
    results: dict[str, list[torch.Tensor]] = {}
    fops = _fusion_ops(inputs, raw_bufs, results)
    fusion: dict[str, list[float]] = {k: [] for k in FUSION_STRATEGIES}
    for it in range(s.fusion_warmup + s.fusion_reps):
        rot = it % len(FUSION_STRATEGIES)
        for key in FUSION_STRATEGIES[rot:] + FUSION_STRATEGIES[:rot]:
            check, op = fops[key]
            if key.startswith("raw"):
                for t in raw_bufs:
                    t.fill_(1.0)
            results.pop(key, None)  # free the previous outputs outside the timed region
            with lowband_check(check):
                dt = timed(op)
            if it < s.fusion_warmup:
                if it == 0:
                    _expect_value(raw_bufs if key.startswith("raw") else results[key], float(p), key)
            else:
                fusion[key].append(dt)
            tick("fusion")
    if progress is not None:
        progress.close()
    _expect_value(inputs, 1.0, "unchanged inputs of out-of-place ops")
    if rank != 0:
        return None
    config = lowband.runtime.current("benchmark").config
    return {
        "sweep": sweep,
        "fusion": fusion,
        "lowband_config": dataclasses.asdict(config),
        "backend": str(dist.get_backend()),
        "torch_threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------- launcher side


def stats(xs: Sequence[float]) -> dict[str, float]:
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "mean": statistics.fmean(xs),
        "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
    }


def overhead_pct(lb: Sequence[float], raw: Sequence[float]) -> dict[str, float]:
    """Headline: ratio of medians. Range: per-repetition ratios (paired: the same repetition)."""
    paired = [(a / b - 1.0) * 100.0 for a, b in zip(lb, raw, strict=True)]
    return {
        "median_ratio_pct": (statistics.median(lb) / statistics.median(raw) - 1.0) * 100.0,
        "paired_median_pct": statistics.median(paired),
        "paired_min_pct": min(paired),
        "paired_max_pct": max(paired),
    }


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    sweep: dict[str, Any] = {}
    for label, times in raw["sweep"].items():
        entry: dict[str, Any] = {
            "bytes": parse_size(label),
            "reps": len(times["raw"]),
            "stats_s": {k: stats(v) for k, v in times.items()},
            "overhead": {
                "check_on": overhead_pct(times["lowband"], times["raw"]),
                "check_off": overhead_pct(times["lowband_nocheck"], times["raw"]),
            },
        }
        sweep[label] = entry
    fusion_stats = {k: stats(v) for k, v in raw["fusion"].items()}
    ratios = {f"{a}/{b}": fusion_stats[a]["median"] / fusion_stats[b]["median"] for a, b in FUSION_RATIOS}
    return {"sweep": sweep, "fusion": {"stats_s": fusion_stats, "ratios": ratios}}


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def _range_ms(st: dict[str, float]) -> str:
    return f"{_ms(st['median'])} [{_ms(st['min'])}-{_ms(st['max'])}]"


def _pct(ov: dict[str, float]) -> str:
    return f"{ov['median_ratio_pct']:+.1f}% [{ov['paired_min_pct']:+.0f}..{ov['paired_max_pct']:+.0f}]"


def print_tables(ws: int, summary: dict[str, Any], fusion_shape: tuple[int, int]) -> None:
    print(
        f"\n=== world size {ws}: allreduce float32 op=sum, ms, median [min-max] of per-rep slowest-rank times ==="
    )
    head = (
        f"{'size':>6} {'reps':>4}  {'raw torch':>26}  {'lowband (check on)':>26}  {'lowband (check off)':>26}"
        f"  {'overhead on':>20}  {'overhead off':>20}"
    )
    print(head)
    print("-" * len(head))
    for label, e in summary["sweep"].items():
        st = e["stats_s"]
        print(
            f"{label:>6} {e['reps']:>4}  {_range_ms(st['raw']):>26}  {_range_ms(st['lowband']):>26}  "
            f"{_range_ms(st['lowband_nocheck']):>26}  {_pct(e['overhead']['check_on']):>20}  "
            f"{_pct(e['overhead']['check_off']):>20}"
        )
    print("overhead = median(lowband)/median(raw) - 1; [..] = min..max of the per-repetition (paired) ratios")
    n, numel = fusion_shape
    f = summary["fusion"]
    print(f"\n--- world size {ws}: {n} float32 tensors of {numel * 4} B, op=sum, ms, median [min-max] ---")
    for key in FUSION_STRATEGIES:
        print(f"  {key:<30} {_range_ms(f['stats_s'][key]):>30}")
    print("  ratios of medians (x slower than fused):")
    for k, v in f["ratios"].items():
        print(f"    {k:<50} {v:8.2f}x")


def evaluate_targets(summaries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("check_on", "check_off"):
        worst: tuple[float, str] | None = None
        for ws, summ in summaries.items():
            for label, e in summ["sweep"].items():
                if e["bytes"] >= OVERHEAD_TARGET_MIN_BYTES:
                    ov = e["overhead"][mode]["median_ratio_pct"]
                    if worst is None or ov > worst[0]:
                        worst = (ov, f"{label} at world size {ws}")
        out[f"overhead_{mode}"] = {
            "met": None if worst is None else worst[0] <= OVERHEAD_TARGET_PCT,
            "worst_pct": None if worst is None else worst[0],
            "worst_at": None if worst is None else worst[1],
        }
    for key, ratio in (
        ("fused_check_on", "unfused_nonblocking/fused"),
        ("fused_check_off", "unfused_nonblocking_nocheck/fused_nocheck"),
    ):
        vals = {ws: summ["fusion"]["ratios"][ratio] for ws, summ in summaries.items()}
        lo = min(vals.values()) if vals else None
        out[key] = {
            "ratio": ratio,
            "met": None if lo is None else lo >= FUSION_TARGET_RATIO,
            "min_ratio": lo,
            "by_world_size": vals,
        }
    return out


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("MET" if met else "NOT MET")


def print_summary(t: dict[str, Any]) -> None:
    parts = []
    for mode in ("check_on", "check_off"):
        o = t[f"overhead_{mode}"]
        detail = "" if o["met"] is None else f" (worst {o['worst_pct']:+.1f}% at {o['worst_at']})"
        parts.append(
            f"overhead<={OVERHEAD_TARGET_PCT:g}% at >=1MB, {mode.replace('_', ' ')}: {_verdict(o['met'])}{detail}"
        )
    for key, what in (("fused_check_on", "check on"), ("fused_check_off", "check off")):
        f = t[key]
        detail = "" if f["met"] is None else f" (min unfused/fused {f['min_ratio']:.1f}x)"
        parts.append(
            f"fused>={FUSION_TARGET_RATIO:g}x faster than unfused, {what}: {_verdict(f['met'])}{detail}"
        )
    print("\nTARGETS: " + "; ".join(parts))


def plot(path: Path, summaries: dict[int, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, mode, title in zip(
        axes, ("check_on", "check_off"), ("check on (default)", "check off"), strict=True
    ):
        for ws, summ in sorted(summaries.items()):
            entries = list(summ["sweep"].values())
            if not entries:
                continue
            xs = [e["bytes"] for e in entries]
            ys = [e["overhead"][mode]["median_ratio_pct"] for e in entries]
            lo = [
                max(0.0, y - e["overhead"][mode]["paired_min_pct"]) for y, e in zip(ys, entries, strict=True)
            ]
            hi = [
                max(0.0, e["overhead"][mode]["paired_max_pct"] - y) for y, e in zip(ys, entries, strict=True)
            ]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=f"world size {ws}")
        ax.axhline(
            OVERHEAD_TARGET_PCT,
            color="red",
            linestyle="--",
            linewidth=1,
            label=f"target {OVERHEAD_TARGET_PCT:g}%",
        )
        ax.axhline(0.0, color="black", linewidth=0.5)
        ax.axvline(OVERHEAD_TARGET_MIN_BYTES, color="gray", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        all_sizes = sorted({e["bytes"] for summ in summaries.values() for e in summ["sweep"].values()})
        ax.set_xticks(all_sizes, [fmt_size(b) for b in all_sizes], rotation=45)
        ax.set_yscale("symlog", linthresh=10.0)
        ax.set_xlabel("message size (float32 allreduce, op=sum)")
        ax.set_title(f"lowband.allreduce vs raw torch, {title}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("overhead % (median ratio; bars: per-rep min..max)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--world-sizes", type=parse_world_sizes, default=None, help="comma list (default 2,4)")
    ap.add_argument("--sizes", type=parse_sizes, default=None, help=f"comma list (default {DEFAULT_SIZES})")
    ap.add_argument(
        "--reps", type=int, default=None, help="repetitions per size (default clamp(2e8/bytes, 5, 50))"
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="warmup iterations per size and strategy (default 3)"
    )
    ap.add_argument(
        "--fusion-tensors", type=int, default=None, help="tensors in the fusion test (default 1000)"
    )
    ap.add_argument(
        "--fusion-size", type=parse_size, default=4096, help="bytes per fusion tensor (default 4KB)"
    )
    ap.add_argument(
        "--fusion-reps", type=int, default=None, help="repetitions of the fusion test (default 5)"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run (< 1 min): sizes {QUICK_SIZES}, 5 reps, 1 warmup, fusion of 100 tensors x 2 reps",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output (PNG goes next to it)")
    args = ap.parse_args(argv)

    sizes = args.sizes or parse_sizes(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    reps = args.reps if args.reps is not None else (5 if args.quick else None)
    if reps is not None and reps < 1:
        ap.error("--reps must be >= 1")
    settings = Settings(
        sizes=sizes,
        reps=reps,
        warmup=args.warmup if args.warmup is not None else (1 if args.quick else 3),
        fusion_tensors=args.fusion_tensors
        if args.fusion_tensors is not None
        else (100 if args.quick else 1000),
        fusion_numel=args.fusion_size // 4,
        fusion_reps=args.fusion_reps if args.fusion_reps is not None else (2 if args.quick else 5),
        fusion_warmup=1,
    )
    if settings.warmup < 1 or settings.fusion_reps < 1 or settings.fusion_tensors < 1:
        ap.error("--warmup, --fusion-reps and --fusion-tensors must be >= 1")
    world_sizes = args.world_sizes or (2, 4)
    out: Path = args.out
    png = out.with_suffix(".png")

    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    cpus = os.cpu_count() or 1
    print(
        f"lowband core overhead benchmark: world sizes {list(world_sizes)}, sizes "
        f"{[fmt_size(b) for b in sizes]}, {cpus} CPUs, torch {torch.__version__}"
    )
    if max(world_sizes) > cpus:
        print(f"note: world size {max(world_sizes)} > {cpus} CPUs: ranks share cores (oversubscribed)")

    raw_results: dict[int, dict[str, Any]] = {}
    summaries: dict[int, dict[str, Any]] = {}
    failures: dict[int, str] = {}
    wall: dict[int, float] = {}
    for ws in world_sizes:
        t0 = time.perf_counter()
        try:
            # check/trace pinned so LOWBAND_CHECK/LOWBAND_TRACE in the environment cannot change what is measured
            res = lowband.launch(
                rank_main, nprocs=ws, args=(settings,), init_kwargs={"check": True, "trace": False}
            )
        except lowband.LowbandError as exc:
            failures[ws] = str(exc)
            print(f"\nworld size {ws}: FAILED: {exc}", file=sys.stderr)
            continue
        wall[ws] = time.perf_counter() - t0
        r0 = res[0]
        assert r0 is not None
        raw_results[ws] = r0
        summaries[ws] = summarize(r0)
        print_tables(ws, summaries[ws], (settings.fusion_tensors, settings.fusion_numel))
        print(f"(world size {ws}: {wall[ws]:.1f} s including start-up)")

    targets = evaluate_targets(summaries)
    if summaries:
        print_summary(targets)

    doc = {
        "benchmark": "core_overhead",
        "metadata": {
            "date_utc": started.isoformat(timespec="seconds"),
            "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "hostname": socket.gethostname(),
            "cpu_count": cpus,
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch_version": torch.__version__,
            "lowband_version": lowband.__version__,
            "world_sizes": list(world_sizes),
            "sizes_bytes": list(sizes),
            "loadavg_start": load_start,
            "loadavg_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "settings": dataclasses.asdict(settings),
            "argv": sys.argv[1:] if argv is None else list(argv),
            "method": (
                "per iteration: dist.barrier(), perf_counter around the op only, MAX over ranks; "
                "strategies interleaved with a per-repetition rotation; inputs refilled before each iteration"
            ),
            "wall_s": {str(k): v for k, v in wall.items()},
            "failures": {str(k): v for k, v in failures.items()},
        },
        "targets": {
            "overhead_pct_max": OVERHEAD_TARGET_PCT,
            "overhead_min_bytes": OVERHEAD_TARGET_MIN_BYTES,
            "fused_min_ratio": FUSION_TARGET_RATIO,
            "results": targets,
        },
        "results": {
            str(ws): {
                "raw_s": raw_results[ws],
                **summaries[ws],
            }
            for ws in summaries
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"\nwrote {out}")
    if summaries:
        plot(png, summaries)
        print(f"wrote {png}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
