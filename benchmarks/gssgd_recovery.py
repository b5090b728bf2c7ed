"""gs-SGD's recovery of the coordinates to apply, measured on a real gradient: how many of the summed
gradient's true top-k coordinates each recovery mode finds in the summed CountSketch.

The gradient is the ``fmnist-cnn`` bench workload's (model seed 0, ``P`` ranks of the bench's seeded
data shards, batch 32 per rank): ``--warm-steps`` steps of synchronous SGD (the workload's optimizer on
the ranks' averaged gradient, as DDP trains) and then, for each of ``--measure-steps`` more steps, every
rank's gradient is cut into the gradient stage's units (the strategies' default buckets of 25 MB, the
first of 1 MB), each rank's vector is sketched with the tables gs-SGD builds for that unit (5 rows,
``10 k`` columns capped at ``numel / 5``, seeded per unit), the sketches are summed (what the tree or
the allreduce delivers) and the reducer's own recovery (:meth:`SketchingReducer.recover`) chooses the
coordinates, with oversampling's exact second round (:func:`keep_largest`) where ``oversample > 1``.
The vector sketched is the plain gradient (the first compressed step of a run, whose error-feedback
residual is still empty).

Per density, recovery mode and oversampling: ``recall`` (the chosen coordinates that are among the
summed gradient's ``k`` largest ``|g_i|``, over all units' ``k``), ``energy`` (the chosen coordinates'
share of the top-k's squared norm), and, to check HEAVYMIX against its definition, how many coordinates
it finds heavy in the sketch (``est_i^2 >= est ||g||^2 / k``) and how many are heavy in the exact summed
gradient (``g_i^2 >= ||g||^2 / k``): at most ``k`` by construction, few on a dense CNN gradient, which is
why HEAVYMIX fills most of ``k`` at random. ``random`` is the recall of ``k`` uniform coordinates,
``k / d``.

Usage::

    python benchmarks/gssgd_recovery.py            # P = 4, densities 0.01 and 0.001, 3 gradients (~1 min)
    python benchmarks/gssgd_recovery.py --quick    # P = 2, density 0.01, 1 gradient

Writes JSON to ``--out`` (default ``benchmarks/results/gssgd-recovery/recovery.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from lowband.bench.workloads import WORKLOADS
from lowband.compress.gssgd import RECOVERIES, GsSGDReducer
from lowband.compress.heavymix import candidates, keep_largest, topk_indices
from lowband.compress.sketch import CountSketch
from lowband.optim.reducer import Unit
from lowband.optim.units import model_units

Tensor = torch.Tensor


def rank_gradients(
    wl: Any, model: torch.nn.Module, batches: list[Any], units: list[Unit]
) -> list[list[Tensor]]:
    """``[rank][unit]``: every rank's flat float32 gradient per unit (the stage's flattening order)."""
    out = []
    for it in batches:
        model.zero_grad(set_to_none=True)
        wl.loss(model, next(it)).backward()
        out.append([torch.cat([p.grad.reshape(-1) for p in u.params]).detach().clone() for u in units])
    return out


def sgd_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, grads: list[list[Tensor]], units: list[Unit]
) -> None:
    """One synchronous step on the ranks' averaged gradient (DDP's update)."""
    for i, u in enumerate(units):
        mean = torch.stack([g[i] for g in grads]).mean(0)
        pos = 0
        for p in u.params:
            p.grad = mean[pos : pos + p.numel()].view_as(p).clone()
            pos += p.numel()
    opt.step()


def measure_unit(
    unit: Unit, per_rank: list[Tensor], density: float, recovery: str, oversample: float, step: int
) -> dict[str, Any]:
    red = GsSGDReducer(density=density, recovery=recovery, oversample=oversample)
    total = torch.stack(per_rank).sum(0)
    d = total.numel()
    k = red.k_for(d)
    sk = CountSketch(d, red.rows, red.cols_for(d), seed=red.unit_seed(unit.key))
    table = sk.zeros(total.dtype)
    for g in per_rank:  # linear: the sum the tree (or the allreduce) delivers
        sk.accumulate(table, g)
    m = candidates(k, oversample, d)
    idx = red.recover(sk, table, m, unit, step)
    if m > k:  # the exact second round of the candidates, then the k largest
        idx, _ = keep_largest(idx, total[idx], k)
    true = topk_indices(total, k)
    g2 = total.double().square()
    est2 = sk.estimate(table).double().square()
    return {
        "unit": unit.key,
        "d": d,
        "k": k,
        "cols": sk.cols,
        "hits": int(torch.isin(idx, true).sum()),
        "energy_chosen": float(g2[idx].sum()),
        "energy_topk": float(g2[true].sum()),
        "energy_total": float(g2.sum()),
        "heavy_in_sketch": int((est2 >= sk.norm_sq_tensor(table) / k).sum()),
        "heavy_exact": int((g2 >= g2.sum() / k).sum()),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    k = sum(r["k"] for r in rows)
    d = sum(r["d"] for r in rows)
    return {
        "recall": sum(r["hits"] for r in rows) / k,
        "energy": sum(r["energy_chosen"] for r in rows) / sum(r["energy_topk"] for r in rows),
        "heavy_in_sketch": sum(r["heavy_in_sketch"] for r in rows),
        "heavy_exact": sum(r["heavy_exact"] for r in rows),
        "k": k,
        "random": k / d,
        "topk_share_of_norm": sum(r["energy_topk"] for r in rows) / sum(r["energy_total"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="ranks whose gradients are summed (default 4)")
    ap.add_argument("--densities", default="0.01,0.001")
    ap.add_argument("--oversample", default="1,2,4", help="oversampling factors to measure (1: none)")
    ap.add_argument("--warm-steps", type=int, default=5, help="SGD steps before the first gradient measured")
    ap.add_argument("--measure-steps", type=int, default=3, help="gradients measured (consecutive steps)")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank (the bench's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="P = 2, density 0.01, one gradient")
    ap.add_argument("--out", default="benchmarks/results/gssgd-recovery/recovery.json")
    a = ap.parse_args()
    if a.quick:
        a.world, a.densities, a.measure_steps, a.oversample = 2, "0.01", 1, "1,2"
    densities = [float(x) for x in a.densities.split(",")]
    oversamples = [float(x) for x in a.oversample.split(",")]
    torch.set_num_threads(1)

    wl = WORKLOADS.get("fmnist-cnn")()
    model = wl.build_model(a.seed)
    opt = wl.make_optimizer(model.parameters())
    units = model_units(model, 25.0, 1.0)
    batches = [iter(wl.batches(r, a.world, a.batch_size, a.seed)) for r in range(a.world)]
    t0 = time.perf_counter()
    for _ in range(a.warm_steps):
        sgd_step(model, opt, rank_gradients(wl, model, batches, units), units)
    rows: dict[tuple[float, str, float], list[dict[str, Any]]] = {}
    for s in range(a.measure_steps):
        grads = rank_gradients(wl, model, batches, units)
        step = a.warm_steps + s
        for density in densities:
            for recovery in RECOVERIES:
                for over in oversamples:
                    for i, u in enumerate(units):
                        r = measure_unit(u, [g[i] for g in grads], density, recovery, over, step)
                        rows.setdefault((density, recovery, over), []).append({**r, "step": step})
        sgd_step(model, opt, grads, units)

    results = [
        {"density": dens, "recovery": rec, "oversample": over, **summarize(rs), "units": rs}
        for (dens, rec, over), rs in rows.items()
    ]
    print(f"fmnist-cnn, P = {a.world}, units {[u.key for u in units]}, gradients at steps "
          f"{a.warm_steps}..{a.warm_steps + a.measure_steps - 1} ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    print(f"{'density':>8} {'recovery':>9} {'over':>5} {'recall':>7} {'energy':>7} {'random':>7} "
          f"{'heavy(sketch)':>13} {'heavy(exact)':>12} {'k':>7} {'top-k share':>11}")  # fmt: skip
    for r in results:
        print(f"{r['density']:>8} {r['recovery']:>9} {r['oversample']:>5} {r['recall']:>7.3f} "
              f"{r['energy']:>7.3f} {r['random']:>7.4f} {r['heavy_in_sketch']:>13} {r['heavy_exact']:>12} "
              f"{r['k']:>7} {r['topk_share_of_norm']:>11.3f}")  # fmt: skip
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(a).items() if k != "out"}
    meta = {
        "workload": "fmnist-cnn",
        "data": wl.describe(),
        "commit": commit,
        "torch": torch.__version__,
        "host": platform.node(),
    }
    out.write_text(json.dumps({"config": config, "meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
