"""``lowband plan --world-sizes``: the run (its arguments already checked by :mod:`lowband.plan.cli`)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lowband.plan.links import Links


def run_scale(
    ns: argparse.Namespace, specs: Sequence[str], sizes: Sequence[int], links: dict[int, Links]
) -> int:
    """The profile measured once (a machine per rank), every spec predicted at every size, written."""
    import torch
    from tqdm import tqdm

    from lowband.plan import planner, scale
    from lowband.plan.profile import measure_profile

    out = Path(ns.out or Path("results") / f"plan-scale-{time.strftime('%Y%m%d-%H%M%S')}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each bench rank computes
    started = time.perf_counter()
    bar = tqdm(total=3 + len(specs), desc="lowband plan", unit="step", file=sys.stderr)
    try:

        def say(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update(1)

        profile = measure_profile(ns.workload, batch_size=ns.batch_size, seed=ns.seed, progress=say)
        rows: dict[str, list[planner.Entry]] = {}
        for spec in specs:
            bar.set_postfix_str(spec)
            rows[spec] = [planner.Entry(spec, planner.predict_spec(spec, profile, links[n])) for n in sizes]
            bar.update(1)
    finally:
        bar.close()
        torch.set_num_threads(threads)
    doc = scale.document(ns.workload, sizes, links, profile.to_json(), rows)
    doc["plan_seconds"] = time.perf_counter() - started
    paths = scale.write(out, doc, rows)
    print(scale.terminal(scale.table(sizes, rows)))
    print("written: " + "  ".join(str(p) for p in paths))
    return 0
