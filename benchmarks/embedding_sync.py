"""Time to synchronise one embedding table's gradient against its density, for AllReduce, AllGather,
AlltoAll and PS (the figure "communication overheads of embedding gradient with different sparsity"
of "EmbRace: Accelerating Sparse Communication for Distributed Training of Deep Neural Networks"),
measured on the testbed's emulated links (or loopback) and compared with the paper's Table 2 after an
alpha-beta fit.

The ops are ``lowband bench --collectives`` ops (``allreduce``, ``emb_allgather``, ``emb_alltoall``,
``emb_ps``: :mod:`lowband.bench.embedding_ops`), so the ranks start, alternate and are timed exactly
as there: each rank in its own network namespace with the tbf-shaped link when run as root, ops
alternated round by round, a sample = the slowest rank's time from a common barrier to completion.

Then, from the medians: the link (bandwidth B, latency beta) fitted to Table 2's formulas over every
scheme and density (least squares on the relative error), each point's relative error against the
fitted model, the same with the exact bytes each rank sends (ids and the colocated servers counted:
:mod:`lowband.sparse.costs`), and the crossover density of each sparse scheme against the dense
AllReduce, measured (interpolated in log density) and modelled.

Usage::

    python benchmarks/embedding_sync.py -n 4 --rate 100mbit                     # flat, ~5-10 min
    python benchmarks/embedding_sync.py -n 4 --rate 100mbit --ranks-per-machine 2 --intra-rate 10gbit
    python benchmarks/embedding_sync.py --quick                                 # loopback smoke run

Writes ``embedding_sync.json`` and ``embedding_sync.png`` to ``--out`` (default
``benchmarks/results/embedding_sync/``), next to the bench's own results.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import textwrap
from pathlib import Path
from typing import Any

from lowband.bench.collectives import parse_size
from lowband.bench.config import BenchConfig
from lowband.bench.embedding_ops import ROW_SETS, table_rows, touched_rows
from lowband.bench.runner import run_bench
from lowband.sparse import costs
from lowband.sparse.rows import RowPartition

OPS = {"allgather": "emb_allgather", "alltoall": "emb_alltoall", "ps": "emb_ps"}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "embedding_sync"


def spec(scheme: str, density: float, dim: int, partition: str) -> str:
    if scheme == "allreduce":
        return "allreduce"
    extra = f",partition={partition}" if scheme == "ps" else ""
    return f"{OPS[scheme]}:density={density:g},dim={dim}{extra}"


def exact_bytes(scheme: str, density: float, size: int, dim: int, n: int, partition: str) -> float:
    """Bytes the busiest rank sends per op (mean over the row sets the ops cycle through)."""
    v = table_rows(size, dim)
    if scheme == "allreduce":
        return costs.allreduce_bytes(v * dim, 4, n) if n > 1 else 0.0
    per_set = []
    for w in range(ROW_SETS):
        sets = [touched_rows(v, density, q, w) for q in range(n)]
        k = [s.numel() for s in sets]
        if scheme == "allgather":
            per_set.append(costs.sparse_allgather_bytes(k, dim, 4))
        elif scheme == "alltoall":
            dims = costs.column_split(dim, n)
            per_set.append(
                max(
                    costs.column_lookup_bytes(k, dims, r, 4) + costs.column_gradient_bytes(k[r], dims, r, 4)
                    for r in range(n)
                )
            )
        else:
            part = RowPartition(partition, v, n)
            counts = [part.by_owner(s)[1] for s in sets]
            per_set.append(
                max(
                    costs.ps_push_bytes(counts[r], r, dim, 4)
                    + costs.ps_reply_bytes([counts[q][r] for q in range(n)], r, dim, 4)
                    for r in range(n)
                )
            )
    return statistics.fmean(per_set)


def crossing(xs: list[float], ys: list[float], ref: list[float]) -> tuple[float | None, str]:
    """Where ``ys`` first reaches ``ref`` (interpolated in log density): ``(density, "between")``;
    ``(first density, "at or below")`` when it is not faster even there; ``(None, "never")``."""
    for i, (y, r) in enumerate(zip(ys, ref)):
        if y >= r:
            if i == 0:
                return xs[0], "at or below"
            lo, hi = math.log(xs[i - 1]), math.log(xs[i])
            d0, d1 = ys[i - 1] - ref[i - 1], y - r
            return (math.exp(lo + (hi - lo) * (-d0) / (d1 - d0)) if d1 != d0 else xs[i]), "between"
    return None, "never"


def analyse(rows: dict[str, Any], args: argparse.Namespace, size: int, n_machines: int) -> dict[str, Any]:
    n, dim, dens = args.world_size, args.dim, args.densities
    schemes = ["allreduce", "allgather", "alltoall", "ps"]
    pts: list[dict[str, Any]] = []
    for scheme in schemes:
        for d in dens:
            r = rows[spec(scheme, d, dim, args.partition)][str(size)]
            b2, l2 = costs.table2_terms(scheme, n, n_machines, d, size)
            pts.append({
                "scheme": scheme, "density": d, "median_s": r["median_s"], "min_s": r["min_s"],
                "max_s": r["max_s"], "table2_bytes": b2, "latencies": l2,
                "exact_bytes": exact_bytes(scheme, d, size, dim, n, args.partition),
                "wire_bytes_sent": r["max_rank_bytes_sent_per_op"],
            })  # fmt: skip
    fits = {}
    for key in ("table2_bytes", "exact_bytes"):
        bw, lat = costs.fit_link([(p[key], p["latencies"], p["median_s"]) for p in pts])
        errs = []
        for p in pts:
            pred = p[key] / bw + p["latencies"] * lat
            p[f"model_s_{key}"] = pred
            p[f"rel_err_{key}"] = pred / p["median_s"] - 1
            errs.append(abs(p[f"rel_err_{key}"]))
        fits[key] = {
            "bandwidth_bytes_per_s": bw, "bandwidth_mbit": bw * 8 / 1e6, "latency_s": lat,
            "max_abs_rel_err": max(errs), "median_abs_rel_err": statistics.median(errs),
            "within_20pct": sum(e <= 0.2 for e in errs), "points": len(errs),
        }  # fmt: skip
    ar = [p["median_s"] for p in pts if p["scheme"] == "allreduce"]
    bw, lat = fits["table2_bytes"]["bandwidth_bytes_per_s"], fits["table2_bytes"]["latency_s"]
    cross = {}
    for scheme in schemes[1:]:
        ys = [p["median_s"] for p in pts if p["scheme"] == scheme]
        where, how = crossing(dens, ys, ar)
        cross[scheme] = {
            "measured": where,
            "measured_how": how,
            "table2": costs.crossover_density(scheme, n, n_machines, size, bw, lat)
            if math.isfinite(bw)
            else None,
        }
    return {"points": pts, "fit": fits, "crossover_density": cross}


def title_of(res: dict[str, Any]) -> str:
    """Two lines: the table and the ranks, then the testbed (long for two-tier layouts)."""
    head = (
        f"embedding gradient of {res['table_bytes'] / 1e6:g} MB, N={res['world_size']} "
        f"on {res['machines']} machines"
    )
    return head + "\n" + textwrap.fill(str(res["testbed"]), 90)


def plot(res: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"allreduce": "tab:gray", "allgather": "tab:orange", "alltoall": "tab:blue", "ps": "tab:green"}
    cross = res["crossover_density"]
    for scheme, c in colors.items():
        ps = [p for p in res["points"] if p["scheme"] == scheme]
        xs = [p["density"] for p in ps]
        med = [p["median_s"] * 1e3 for p in ps]
        err = [
            [m - p["min_s"] * 1e3 for m, p in zip(med, ps)],
            [p["max_s"] * 1e3 - m for m, p in zip(med, ps)],
        ]
        label = scheme
        if scheme in cross:
            cx = cross[scheme]
            if cx["measured_how"] == "never":
                label += " (faster than allreduce at every density)"
            else:
                sign = "<=" if cx["measured_how"] == "at or below" else "at"
                label += f" (= allreduce {sign} {cx['measured']:.3g})"
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, color=c, label=label)
        ax.plot(xs, [p["model_s_table2_bytes"] * 1e3 for p in ps], "--", color=c, alpha=0.6)
    ax.plot([], [], "--", color="black", alpha=0.6, label="Table 2, fitted B and beta")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("gradient density (rows touched per rank / rows)")
    ax.set_ylabel("time to synchronise (ms, slowest rank)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--world-size", type=int, default=4)
    p.add_argument("--rate", default="100mbit", help="per-rank link rate; 'none' = unshaped loopback")
    p.add_argument("--ranks-per-machine", type=int, default=1)
    p.add_argument("--intra-rate", default=None)
    p.add_argument("--mode", choices=["auto", "netns", "loopback"], default="auto")
    p.add_argument("--table", default="16MB", help="table (gradient) size, e.g. 16MB")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--densities", default="0.001,0.003,0.01,0.03,0.1,0.3,1")
    p.add_argument("--partition", choices=["modulo", "range"], default="modulo")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--quick", action="store_true", help="loopback, 2 ranks, 1 MB, 3 densities, 1 round")
    p.add_argument("--replot", metavar="JSON", help="redraw the plot of a saved embedding_sync.json and exit")
    args = p.parse_args()
    if args.replot:
        saved = Path(args.replot)
        res = json.loads(saved.read_text())
        plot(res, saved.with_suffix(".png"), title_of(res))
        return
    if args.quick:
        args.world_size, args.rate, args.mode, args.table = 2, "none", "loopback", "1MB"
        args.densities, args.rounds, args.reps = "0.01,0.1,1", 1, 2
    rate = None if args.rate.lower() in ("none", "unshaped", "0") else args.rate
    args.densities = sorted(float(x) for x in args.densities.split(","))
    size = parse_size(args.table)
    specs = ["allreduce"] + [
        spec(s, d, args.dim, args.partition) for d in args.densities for s in ("allgather", "alltoall", "ps")
    ]
    out = Path(args.out)
    cfg = BenchConfig(
        collectives=specs, sizes=[size], world_size=args.world_size, rate=rate,
        ranks_per_machine=args.ranks_per_machine, intra_rate=args.intra_rate,
        mode="loopback" if rate is None else args.mode, rounds=args.rounds, warmup_rounds=0, reps=args.reps,
        out_dir=str(out),
    )  # fmt: skip
    bench = run_bench(cfg)
    machines = args.world_size // args.ranks_per_machine
    res = analyse(bench["summary"]["rows"], args, size, machines)
    res.update({
        "testbed": bench["testbed"], "shaped": bench["shaped"], "started": bench["started"],
        "world_size": args.world_size, "machines": machines, "table_bytes": size, "dim": args.dim,
        "rows": table_rows(size, args.dim), "partition": args.partition, "rounds": args.rounds, "reps": args.reps,
    })  # fmt: skip
    (out / "embedding_sync.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "embedding_sync.png", title_of(res))
    f = res["fit"]["table2_bytes"]
    print(f"fitted link: {f['bandwidth_mbit']:.1f} Mbit/s, latency {f['latency_s'] * 1e3:.3f} ms")
    for key, fit in res["fit"].items():
        print(
            f"model ({key}): median |rel err| {fit['median_abs_rel_err']:.1%}, max {fit['max_abs_rel_err']:.1%}, "
            f"{fit['within_20pct']}/{fit['points']} points within 20%"
        )
    for scheme, c in res["crossover_density"].items():
        print(
            f"crossover vs allreduce, {scheme}: measured {c['measured']} ({c['measured_how']}), Table 2 {c['table2']}"
        )
    print(f"results: {out / 'embedding_sync.json'}  plot: {out / 'embedding_sync.png'}")


if __name__ == "__main__":
    main()
