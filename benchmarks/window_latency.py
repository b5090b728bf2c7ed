"""Latency of the one-sided window operations and the window service's threads per rank.

    python benchmarks/window_latency.py [--ranks 2 4] [--reps 200] [--get-reps 40] [--rounds 1] [--out DIR]

Ranks are threads of this process (``lowband.testing.run_threads``, one torch thread each; they share
one GIL) or, with ``--processes``, processes (``run_processes``). Per world
size, on a window over ``exponential_two(n)`` (every rank a window peer of every other up to n = 4):

- ``put_rtt_us``: a blocking ``win_put`` of 4 float32 elements from rank 0 to rank 1 (header, payload,
  applied, status answered), the median of ``--reps``, every other rank idle;
- ``put_rtt_all_us``: the same while every rank puts to all its out-neighbors at once (median over the
  ranks' medians);
- ``get_1mb_ms``: a blocking ``win_get`` of 1 MiB (262144 float32) by rank 0 from one in-neighbor;
- ``service_threads_per_rank``: the window service's threads (``lowband.teardown.lowband_threads``
  named ``lowband-win*``) per rank while the window exists (threads of all ranks / ranks, or of one
  process);
- ``cpu_idle_pct``: the CPU time of rank 0's process over 1 s in which every rank waits in
  ``time.sleep`` with its window open (what the service costs while nothing arrives), in percent of one
  core (with thread ranks: every rank's).

Prints one line per world size and round and writes ``window-latency.json`` to ``--out`` (if given). Timings on a
shared 2-core machine measure scheduling as much as the code: compare only runs made side by side.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import lowband
from lowband.decentral import window as W
from lowband.teardown import lowband_threads
from lowband.testing import run_processes, run_threads
from lowband.topology import exponential_two


def _service_threads() -> int:
    return sum(1 for t in lowband_threads() if t.name.startswith("lowband-win"))


def _bench(reps: int, get_reps: int) -> dict[str, Any]:
    r, n = lowband.rank(), lowband.size()
    topo = exponential_two(n)
    small = torch.zeros(4)
    W.win_create(small, "small", topology=topo)
    big = torch.full((262144,), float(r))
    W.win_create(big, "big", topology=topo)
    lowband.barrier()
    out: dict[str, Any] = {"threads": _service_threads()}
    if r == 0:
        for _ in range(10):  # warm-up
            W.win_put(small, "small", dst_weights={1: 1.0})
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            W.win_put(small, "small", dst_weights={1: 1.0})
            ts.append(time.perf_counter() - t0)
        out["put_rtt_us"] = statistics.median(ts) * 1e6
        src = next(iter(topo.in_neighbors(0)))
        W.win_get("big", src_weights={src: 1.0})
        gs = []
        for _ in range(get_reps):
            t0 = time.perf_counter()
            W.win_get("big", src_weights={src: 1.0})
            gs.append(time.perf_counter() - t0)
        out["get_1mb_ms"] = statistics.median(gs) * 1e3
    lowband.barrier()
    dsts = {d: 1.0 for d in topo.out_neighbors(r)}
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        W.win_put(small, "small", dst_weights=dsts)
        ts.append(time.perf_counter() - t0)
    out["put_rtt_all_us"] = statistics.median(ts) * 1e6
    lowband.barrier()
    if r == 0:
        c0, w0 = time.process_time(), time.perf_counter()
    time.sleep(1.0)
    if r == 0:
        out["cpu_idle_pct"] = 100 * (time.process_time() - c0) / (time.perf_counter() - w0)
    lowband.barrier()
    W.win_free()
    return out


def _set_knobs(spin_us: float | None, max_sleep_us: float | None) -> dict[str, float]:
    """Set the listener's polling constants (when this code has a listener); returns them."""
    try:
        from lowband.decentral import window_listener as wl
    except ImportError:  # one receiver thread per peer: nothing polls
        return {}
    if spin_us is not None:
        wl.SPIN_S = spin_us * 1e-6
    if max_sleep_us is not None:
        wl.MAX_SLEEP_S = max_sleep_us * 1e-6
    return {"spin_us": wl.SPIN_S * 1e6, "warm_us": wl.WARM_S * 1e6, "max_sleep_us": wl.MAX_SLEEP_S * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--get-reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1, help="runs per world size (one row each)")
    ap.add_argument("--processes", action="store_true", help="ranks as processes (one GIL each)")
    ap.add_argument("--out", default="", help="folder for window-latency.json")
    ap.add_argument("--spin-us", type=float, default=None, help="the listener's SPIN_S, in microseconds")
    ap.add_argument("--max-sleep-us", type=float, default=None, help="the listener's MAX_SLEEP_S, in us")
    ns = ap.parse_args()
    torch.set_num_threads(1)
    knobs = _set_knobs(ns.spin_us, ns.max_sleep_us)
    rows = []
    for n in ns.ranks:
        for _ in range(ns.rounds):
            run = run_processes if ns.processes else run_threads
            res = run(functools.partial(_bench, ns.reps, ns.get_reps), n, timeout=600)
            row = {
                **knobs,
                "ranks": n,
                "ranks_are": "processes" if ns.processes else "threads",
                "put_rtt_us": round(res[0]["put_rtt_us"], 1),
                "put_rtt_all_us": round(statistics.median(x["put_rtt_all_us"] for x in res), 1),
                "get_1mb_ms": round(res[0]["get_1mb_ms"], 3),
                "service_threads_per_rank": max(x["threads"] for x in res) / (1 if ns.processes else n),
                "cpu_idle_pct": round(res[0]["cpu_idle_pct"], 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if ns.out:
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        (Path(ns.out) / "window-latency.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
