"""DreamDDP scheduler benchmark: a reproduction of the paper's Fig. 15 (and Fig. 16(b)) on random profiles.

For every number of layers L (default 5, 10, ..., 30), communication/computation ratio (``sum(comm) /
sum(bwd)``, standing in for the bandwidth) and seed, one ``lowband.localsgd.random_profile`` is
scheduled with period H (default 5) by:

- ``dreamddp``: Algorithm 2 (memoised search over its solution set Ω) + bubble filling, with a set's
  communication time measured as in Eq. 7 (``measure="span"``, the default); ``dreamddp_sum`` the same
  with Eq. 10's sum of per-layer times (``measure="sum"``);
- ``optimal``: the exact optimum of the event model over the same search space (dynamic programme);
- ``bruteforce``: the same optimum by enumeration, where C(L+H-1, H-1) is small enough (checks the DP);
- ``enp``: equal-number partition (Example 1); ``full``: every layer averaged in the last iteration,
  overlapped with its backward; ``flsgd``: classic FLSGD, all layers averaged after the period with no
  overlap (``sum(comm)``).

Reported per schedule: the predicted extra (non-overlapped) communication time of one period,
``period_time - H * (fwd + bwd)`` by the Eq. 7 event model (the paper's Fig. 15 quantity), and the
scheduler's wall time (best of ``--reps`` calls): ``dreamddp`` (search, bubble filling and building the
``Schedule``), ``dreamddp_search`` (the search alone) and ``dreamddp_literal`` (the listing's own
enumeration of Ω, no memoisation, then the argmin). A last section times L = 200, H = 10.

Usage::

    python benchmarks/dreamddp_scheduler.py                 # full run, ~1-2 min on 2 cores
    python benchmarks/dreamddp_scheduler.py --quick         # smoke run, seconds

Writes every record, the summaries and metadata to ``--out`` (default
``benchmarks/results/dreamddp_scheduler.json``) and a figure next to it (``.png``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lowband.localsgd import (
    CostProfile,
    dreamddp_sets,
    dreamddp_solutions,
    exposed_comm_time,
    period_time,
    random_profile,
    schedule_bruteforce,
    schedule_dreamddp,
    schedule_enp,
    schedule_full,
    schedule_optimal,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "dreamddp_scheduler.json"
METHODS = ("dreamddp", "dreamddp_sum", "optimal", "bruteforce", "enp", "full", "flsgd")
TIMED = ("dreamddp", "dreamddp_search", "dreamddp_literal", "optimal", "bruteforce")
EQUAL_RTOL = 1e-9


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def best_of(reps: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """(least wall time over ``reps`` calls, last result)."""
    best, out = math.inf, None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def literal_dreamddp(p: CostProfile, H: int) -> tuple[tuple[int, ...], ...]:
    """Algorithm 2 as listed: materialise Ω, then take the argmin of the event model."""
    omega = dreamddp_solutions(p, H)
    return min(omega, key=lambda sets: period_time(p, sets))


def run_one(L: int, ratio: float, seed: int, H: int, reps: int, bf_max: int) -> dict[str, Any]:
    p = random_profile(L, seed, comm_ratio=ratio)
    rec: dict[str, Any] = {"L": L, "ratio": ratio, "seed": seed, "H": H, "extra_ms": {}, "time_ms": {}}
    compute = H * (p.fwd_total + p.bwd_total)
    rec["compute_ms"] = 1e3 * compute
    t, d = best_of(reps, lambda: schedule_dreamddp(p, H))
    rec["time_ms"]["dreamddp"] = 1e3 * t
    t, _ = best_of(reps, lambda: dreamddp_sets(p, H))
    rec["time_ms"]["dreamddp_search"] = 1e3 * t
    t, lit = best_of(reps, lambda: literal_dreamddp(p, H))
    rec["time_ms"]["dreamddp_literal"] = 1e3 * t
    t, o = best_of(reps, lambda: schedule_optimal(p, H))
    rec["time_ms"]["optimal"] = 1e3 * t
    rec["extra_ms"]["dreamddp"] = 1e3 * exposed_comm_time(p, d.sets)
    rec["extra_ms"]["dreamddp_literal"] = 1e3 * exposed_comm_time(p, lit)
    dsum = schedule_dreamddp(p, H, measure="sum")
    rec["extra_ms"]["dreamddp_sum"] = 1e3 * exposed_comm_time(p, dsum.sets)
    rec["dreamddp_sum_is_optimal"] = _close(dsum.predicted_period, o.predicted_period)
    rec["extra_ms"]["optimal"] = 1e3 * exposed_comm_time(p, o.sets)
    rec["extra_ms"]["enp"] = 1e3 * exposed_comm_time(p, schedule_enp(p, H).sets)
    rec["extra_ms"]["full"] = 1e3 * exposed_comm_time(p, schedule_full(p, H).sets)
    rec["extra_ms"]["flsgd"] = 1e3 * p.comm_total
    rec["omega"] = len(dreamddp_solutions(p, H))
    rec["filled_layers"] = sum(len(s) for s in d.sets) - L
    if math.comb(L + H - 1, H - 1) <= bf_max:
        t, b = best_of(1, lambda: schedule_bruteforce(p, H, max_candidates=bf_max))
        rec["time_ms"]["bruteforce"] = 1e3 * t
        rec["extra_ms"]["bruteforce"] = 1e3 * exposed_comm_time(p, b.sets)
    rec["dreamddp_is_optimal"] = _close(d.predicted_period, o.predicted_period)
    return rec


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= EQUAL_RTOL * max(abs(a), abs(b))


def _stats(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def summarise(records: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Per value of ``key`` ("L" or "ratio"): stats of extra comm and scheduling time for each method."""
    out: dict[str, Any] = {}
    for v in sorted({r[key] for r in records}):
        rs = [r for r in records if r[key] == v]
        out[str(v)] = {
            "extra_ms": {m: _stats([r["extra_ms"][m] for r in rs if m in r["extra_ms"]]) for m in METHODS},
            "time_ms": {m: _stats([r["time_ms"][m] for r in rs if m in r["time_ms"]]) for m in TIMED},
            "gap_ms": _stats([r["extra_ms"]["dreamddp"] - r["extra_ms"]["optimal"] for r in rs]),
            "dreamddp_optimal_share": sum(r["dreamddp_is_optimal"] for r in rs) / len(rs),
            "dreamddp_sum_optimal_share": sum(r["dreamddp_sum_is_optimal"] for r in rs) / len(rs),
            "omega": _stats([r["omega"] for r in rs]),
            "compute_ms": _stats([r["compute_ms"] for r in rs]),
        }
    return out


def _fmt(s: dict[str, float], digits: int = 2) -> str:
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def print_table(title: str, key: str, summ: dict[str, Any]) -> None:
    print(f"\n{title}")
    cols = ["dreamddp", "dreamddp_sum", "optimal", "enp", "full", "flsgd"]
    head = f"{key:>6} | " + " | ".join(f"{c:>22}" for c in cols) + " | =opt (sum) | gap max"
    print(head)
    print("-" * len(head))
    for v, s in summ.items():
        row = " | ".join(f"{_fmt(s['extra_ms'][c]):>22}" for c in cols)
        share = f"{100 * s['dreamddp_optimal_share']:3.0f}% ({100 * s['dreamddp_sum_optimal_share']:3.0f}%)"
        print(f"{v:>6} | {row} | {share} | {s['gap_ms']['max']:.3f}")


def print_times(summ: dict[str, Any]) -> None:
    print("\nscheduling wall time, ms, median [min-max] over ratios and seeds")
    head = "     L | " + " | ".join(f"{m:>24}" for m in TIMED) + " | |Omega| max"
    print(head)
    print("-" * len(head))
    for v, s in summ.items():
        row = " | ".join(f"{_fmt(s['time_ms'][m], 3):>24}" for m in TIMED)
        print(f"{v:>6} | {row} | {s['omega']['max']:.0f}")


def big_case(L: int, H: int, seeds: int, ratios: list[float], reps: int) -> dict[str, Any]:
    rows = []
    for r in ratios:
        for seed in range(seeds):
            p = random_profile(L, seed, comm_ratio=r)
            td, d = best_of(reps, functools.partial(schedule_dreamddp, p, H))
            to, o = best_of(reps, functools.partial(schedule_optimal, p, H))
            rows.append(
                {
                    "ratio": r,
                    "seed": seed,
                    "dreamddp_ms": 1e3 * td,
                    "optimal_ms": 1e3 * to,
                    "extra_dreamddp_ms": 1e3 * exposed_comm_time(p, d.sets),
                    "extra_optimal_ms": 1e3 * exposed_comm_time(p, o.sets),
                    "dreamddp_is_optimal": _close(d.predicted_period, o.predicted_period),
                }
            )
    return {
        "L": L,
        "H": H,
        "rows": rows,
        "dreamddp_ms": _stats([x["dreamddp_ms"] for x in rows]),
        "optimal_ms": _stats([x["optimal_ms"] for x in rows]),
        "dreamddp_optimal_share": sum(x["dreamddp_is_optimal"] for x in rows) / len(rows),
        "gap_ms": _stats([x["extra_dreamddp_ms"] - x["extra_optimal_ms"] for x in rows]),
    }


def plot(
    path: Path, by_l: dict[str, Any], by_ratio: dict[str, Any], H: int, ratio_l: float, l_ratio: int
) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    styles = {
        "dreamddp": "o-",
        "dreamddp_sum": "o:",
        "optimal": "s--",
        "enp": "^-",
        "full": "v-",
        "flsgd": "x:",
    }
    for ax, summ, xlabel, title in (
        (axes[0], by_l, "layers L", f"(a) extra comm vs L (H={H}, ratio {ratio_l:g})"),
        (axes[1], by_ratio, "comm / backward ratio", f"(b) extra comm vs ratio (H={H}, L={l_ratio})"),
    ):
        xs = [float(k) for k in summ]
        for m, style in styles.items():
            med = [summ[k]["extra_ms"][m]["median"] for k in summ]
            lo = [summ[k]["extra_ms"][m]["median"] - summ[k]["extra_ms"][m]["min"] for k in summ]
            hi = [summ[k]["extra_ms"][m]["max"] - summ[k]["extra_ms"][m]["median"] for k in summ]
            hollow = {"markerfacecolor": "none", "markersize": 10} if m == "optimal" else {}
            ax.errorbar(xs, med, yerr=[lo, hi], fmt=style, capsize=3, label=m, alpha=0.85, **hollow)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("non-overlapped comm per period (ms)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    axes[1].set_xticks([float(k) for k in by_ratio], [f"{float(k):g}" for k in by_ratio])
    axes[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax = axes[2]
    for m, style in zip(TIMED, ("o-", "o--", "d-", "s--", "x:")):
        ks = [k for k in by_l if by_l[k]["time_ms"][m]]
        ax.plot([float(k) for k in ks], [by_l[k]["time_ms"][m]["median"] for k in ks], style, label=m)
    ax.set_yscale("log")
    ax.set_xlabel("layers L")
    ax.set_ylabel("scheduling wall time (ms, median)")
    ax.set_title(f"(c) scheduling time (H={H})", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="5,10,15,20,25,30", help="numbers of layers L (comma separated)")
    ap.add_argument("--H", type=int, default=5, help="period: local iterations per synchronisation round")
    ap.add_argument("--ratios", default="0.25,0.5,1,2,4,8", help="sum(comm) / sum(bwd) values")
    ap.add_argument("--seeds", type=int, default=8, help="random profiles per (L, ratio)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per scheduler (best of)")
    ap.add_argument("--bruteforce-max", type=int, default=100_000, help="largest brute-force candidate count")
    ap.add_argument("--big-L", type=int, default=200)
    ap.add_argument("--big-H", type=int, default=10)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer layers, ratios and seeds")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.ratios, args.seeds, args.reps = "5,15,30", "0.5,2", 2, 1
    layers, ratios = _ints(args.layers), _floats(args.ratios)
    jobs = [(L, r, s) for L in layers for r in ratios for s in range(args.seeds)]
    records = [
        run_one(L, r, s, args.H, args.reps, args.bruteforce_max)
        for L, r, s in tqdm(jobs, desc="schedules", unit="profile")
    ]
    # Fig. 15(a): vary L at the middle ratio; Fig. 15(b): vary the ratio at the largest L
    ratio_l = ratios[len(ratios) // 2]
    l_ratio = max(layers)
    by_l = summarise([r for r in records if r["ratio"] == ratio_l], "L")
    by_ratio = summarise([r for r in records if r["L"] == l_ratio], "ratio")
    times_by_l = summarise(records, "L")
    bf_ok = [
        _close(r["extra_ms"]["bruteforce"] + r["compute_ms"], r["extra_ms"]["optimal"] + r["compute_ms"])
        for r in records
        if "bruteforce" in r["extra_ms"]
    ]
    big = big_case(args.big_L, args.big_H, max(2, args.seeds // 2), ratios, args.reps)

    print(f"\npredicted extra (non-overlapped) communication per period of H={args.H}, ms, median [min-max];")
    print(
        "=opt: share of profiles where DreamDDP (span; sum) reaches the optimum; gap: worst DreamDDP - optimum"
    )
    print_table(f"(a) by number of layers, comm/bwd ratio {ratio_l:g}, {args.seeds} seeds", "L", by_l)
    print_table(f"(b) by comm/bwd ratio, L={l_ratio}, {args.seeds} seeds", "ratio", by_ratio)
    print_times(times_by_l)
    n_opt = sum(r["dreamddp_is_optimal"] for r in records)
    n_sum = sum(r["dreamddp_sum_is_optimal"] for r in records)
    print(f"\nDreamDDP optimal in {n_opt}/{len(records)} profiles (measure='sum': {n_sum}); worst gap to the optimum "
          f"{max(r['extra_ms']['dreamddp'] - r['extra_ms']['optimal'] for r in records):.3f} ms; "
          f"DP == brute force in {sum(bf_ok)}/{len(bf_ok)} profiles where brute force ran")  # fmt: skip
    print(
        f"L={big['L']}, H={big['H']}: DreamDDP {_fmt(big['dreamddp_ms'], 1)} ms, DP optimum "
        f"{_fmt(big['optimal_ms'], 1)} ms; DreamDDP optimal in {100 * big['dreamddp_optimal_share']:.0f}% "
        f"(gap {_fmt(big['gap_ms'], 3)} ms)"
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    result = {
        "meta": meta,
        "by_layers": by_l,
        "by_ratio": by_ratio,
        "times_by_layers": times_by_l,
        "dp_equals_bruteforce": {"ok": sum(bf_ok), "checked": len(bf_ok)},
        "big": big,
        "records": records,
    }
    args.out.write_text(json.dumps(result, indent=1))
    png = args.out.with_suffix(".png")
    plot(png, by_l, by_ratio, args.H, ratio_l, l_ratio)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
