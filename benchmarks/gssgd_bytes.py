"""gs-SGD and its baselines: bytes per rank per step against each scheme's byte model, and the cost of
building CountSketch tables.

For each world size and density, a gradient the size of a bench model (``--model``, built from
``lowband.bench`` workloads; one unit, as the stage's default buckets give it) goes through the gs-SGD
(tree and allreduce), Sketched-SGD and gTop-k reducers on thread ranks with lowband's byte counters on;
the measured bytes per rank per step are printed next to :mod:`lowband.compress.sparse_costs`'s model
(they must agree exactly: the counters record the logical traffic) and next to a dense ring allreduce.
The kernel's bytes on emulated links (headers included) are the bench's to compare with the same model.
It also times building the hash tables of a 10 M-coordinate, 5-row sketch (seeded tables, one core).

Usage::

    python benchmarks/gssgd_bytes.py --quick      # smoke: P = 2, 3, density 0.01, ~20 s
    python benchmarks/gssgd_bytes.py              # P = 2, 3, 4; density 0.001 and 0.01

Writes JSON to ``--out`` (default ``benchmarks/results/gssgd_bytes.json``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import lowband
from lowband.comm.reduce import ring_bytes
from lowband.compress.gssgd import GsSGDReducer, GTopKReducer, SketchedSGDReducer
from lowband.compress.sketch import CountSketch
from lowband.compress.sparse_costs import gs_sgd_bytes, gtopk_bytes, sketched_sgd_bytes
from lowband.optim import ReduceContext, Reducer, Unit
from lowband.testing import run_threads

SCHEMES: dict[str, tuple[type[Reducer], dict[str, Any]]] = {
    "gs-sgd": (GsSGDReducer, {}),
    "gs-sgd/allreduce": (GsSGDReducer, {"reduce": "allreduce"}),
    "sketched-sgd": (SketchedSGDReducer, {}),
    "gtopk": (GTopKReducer, {}),
}


def model_size(name: str) -> int:
    from lowband.bench.workloads import WORKLOADS

    wl = WORKLOADS.get(name)()
    return sum(p.numel() for p in wl.build_model(0).parameters())


def modelled(scheme: str, red: Reducer, d: int, size: int, rank: int) -> tuple[int, int]:
    k = red.k_for(d)  # type: ignore[attr-defined]
    if scheme == "gtopk":
        return gtopk_bytes(d, size, rank, k=k)
    rows, cols = red.rows, red.cols_for(d)  # type: ignore[attr-defined]
    if scheme == "sketched-sgd":
        return sketched_sgd_bytes(d, size, rank, k=k, rows=rows, cols=cols)
    return gs_sgd_bytes(d, size, rank, k=k, rows=rows, cols=cols, reduce=red.reduce_by)  # type: ignore[attr-defined]


def measure(scheme: str, density: float, d: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    cls, opts = SCHEMES[scheme]
    red = cls(density=density, **opts)  # type: ignore[call-arg]
    unit = Unit("model", ("model",), (torch.zeros(d),))
    g = torch.Generator().manual_seed(lowband.rank())
    group = lowband.world().unchecked()
    red.reduce(unit, [torch.randn(d, generator=g)], ReduceContext(group, 0)).wait()
    lowband.reset_trace()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        red.reduce(unit, [torch.randn(d, generator=g)], ReduceContext(group, step)).wait()
    wall = (time.perf_counter() - t0) / steps
    c = lowband.counters()
    sent = sum(v["bytes_sent"] for v in c.values()) / steps
    recv = sum(v["bytes_received"] for v in c.values()) / steps
    m_sent, m_recv = modelled(scheme, red, d, group.size, group.rank)
    return {"sent": sent, "received": recv, "model_sent": m_sent, "model_received": m_recv, "step_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fmnist-cnn")
    ap.add_argument("--world-sizes", default="2,3,4")
    ap.add_argument("--densities", default="0.001,0.01")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/gssgd_bytes.json")
    a = ap.parse_args()
    if a.quick:
        a.world_sizes, a.densities, a.steps = "2,3", "0.01", 2
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    CountSketch(10_000_000, 5, 100_000, seed=1)
    tables_s = time.perf_counter() - t0
    print(f"hash tables for 10 M coordinates x 5 rows: {tables_s:.2f} s")
    d = model_size(a.model)
    dense = 4 * d
    print(f"{a.model}: d = {d:,} ({dense / 2**20:.2f} MiB float32)")
    rows = []
    for p in map(int, a.world_sizes.split(",")):
        for density in map(float, a.densities.split(",")):
            for scheme in SCHEMES:
                res = run_threads(measure, p, scheme, density, d, a.steps, timeout=300, trace=True)
                for r, x in enumerate(res):
                    ok = (x["sent"], x["received"]) == (x["model_sent"], x["model_received"])
                    rows.append({"P": p, "density": density, "scheme": scheme, "rank": r, "match": ok, **x})
                worst = max(res, key=lambda x: x["sent"] + x["received"])
                print(
                    f"P={p} density={density:<6} {scheme:<17} max rank sent+recv "
                    f"{(worst['sent'] + worst['received']) / 2**10:9.1f} KiB "
                    f"(model {(worst['model_sent'] + worst['model_received']) / 2**10:9.1f}; dense ring "
                    f"{2 * ring_bytes(dense, p) / 2**10:9.1f}) step {worst['step_s'] * 1e3:7.1f} ms "
                    f"{'ok' if all(rw['match'] for rw in rows[-p:]) else 'MISMATCH'}"
                )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": a.model, "d": d, "tables_10M_s": tables_s, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
