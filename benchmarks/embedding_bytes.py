"""Embedding gradient sizes per rank and step: original, coalesced and prioritised (the table "average
sparse embedding gradient size in vertical sparse scheduling" of "EmbRace: Accelerating Sparse
Communication for Distributed Training of Deep Neural Networks").

For each embedding table of a workload, from the batches every rank trains on (the bench's own seeded
batch streams, the ids each table is called on: ``Workload.lookup_ids``):

- original: one gradient row per id looked up (a torch sparse gradient before coalescing);
- coalesced: one row per distinct id of the rank's batch (duplicates summed);
- prioritised: the coalesced rows that the next batch of any rank reads, which vertical scheduling
  sends before the next lookup (the rest are delayed to idle time).

Sizes are the values' bytes (rows x dimension x 4); indices are not counted. Pure arithmetic on the
ids: no network, a few seconds.

Usage::

    python benchmarks/embedding_bytes.py -w wordlm-sampled -w wordgpt -n 4 --steps 50

Writes ``embedding_bytes.json`` and ``embedding_bytes.md`` to ``--out`` (default
``benchmarks/results/embedding_bytes/``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from lowband.bench.workloads import get_workload

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "embedding_bytes"
MB = 1e6


def table_shapes(wl: Any) -> dict[str, tuple[int, int]]:
    """Each embedding table of the workload's model (by module name): (rows, dimension)."""
    model = wl.build_model(0)
    return {
        n: (int(m.num_embeddings), int(m.embedding_dim))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding)
    }


def measure(name: str, n: int, steps: int, batch_size: int | None, seed: int) -> dict[str, Any]:
    wl = get_workload(name)
    if not hasattr(wl, "lookup_ids"):
        raise SystemExit(f"workload {name!r} has no lookup_ids(batch): it names no embedding tables")
    shapes = table_shapes(wl)
    bs = batch_size or wl.default_batch_size
    streams = [wl.batches(r, n, bs, seed) for r in range(n)]
    ids = [[wl.lookup_ids(next(s)) for s in streams] for _ in range(steps + 1)]  # [step][rank][table]
    out: dict[str, Any] = {"workload": name, "world_size": n, "batch_size": bs, "steps": steps, "tables": {}}
    for table, (num_rows, dim) in shapes.items():
        orig, coal, prio = [], [], []
        for k in range(steps):
            nxt = torch.unique(torch.cat([ids[k + 1][r][table].flatten() for r in range(n)]))
            for r in range(n):
                mine = ids[k][r][table].flatten()
                rows = torch.unique(mine)
                orig.append(mine.numel() * dim * 4 / MB)
                coal.append(rows.numel() * dim * 4 / MB)
                prio.append(int(torch.isin(rows, nxt).sum()) * dim * 4 / MB)
        out["tables"][table] = {
            "rows": num_rows,
            "dim": dim,
            "original_mb": statistics.mean(orig),
            "coalesced_mb": statistics.mean(coal),
            "prioritised_mb": statistics.mean(prio),
        }
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | table | N | batch | original MB | coalesced MB | prioritised MB | coalesced / original | "
        "prioritised / coalesced |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for t, v in res["tables"].items():
            lines.append(
                f"| {res['workload']} | {t} | {res['world_size']} | {res['batch_size']} | {v['original_mb']:.3f} | "
                f"{v['coalesced_mb']:.3f} | {v['prioritised_mb']:.3f} | "
                f"{v['coalesced_mb'] / v['original_mb']:.1%} | {v['prioritised_mb'] / v['coalesced_mb']:.1%} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("-w", "--workload", action="append", help="repeatable; default wordlm-sampled and wordgpt")
    p.add_argument("-n", "--world-size", type=int, action="append", help="repeatable; default 4")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    a = p.parse_args()
    results = [
        measure(w, n, a.steps, a.batch_size, a.seed)
        for w in (a.workload or ["wordlm-sampled", "wordgpt"])
        for n in (a.world_size or [4])
    ]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "embedding_bytes.json").write_text(json.dumps(results, indent=1) + "\n")
    md = markdown(results)
    (out / "embedding_bytes.md").write_text(md)
    print(md, end="")
    print(f"results: {out / 'embedding_bytes.json'}")


if __name__ == "__main__":
    main()
