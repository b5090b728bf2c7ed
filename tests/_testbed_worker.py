"""One rank of the testbed's shaping test: timed allreduces of a float32 tensor on emulated links.

Run by ``Testbed.spawn`` (env:// from the testbed's environment). Prints one JSON line: this rank's
per-repetition times and the bytes its testbed interface sent and received during each repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import lowband
from lowband.testbed import read_iface_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=16.0, help="tensor size in MiB")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lowband.init(timeout=120, check=False)
    ifname = os.environ["LOWBAND_TESTBED_IFNAME"]
    t = torch.ones(int(args.mib * 2**20) // 4, dtype=torch.float32)
    lowband.allreduce(t, op="sum")  # warm-up: connections, slow start
    times, tx, rx = [], [], []
    for _ in range(args.reps):
        lowband.barrier()
        tx0, rx0 = read_iface_bytes(ifname)
        start = time.perf_counter()
        out = lowband.allreduce(t, op="sum")
        times.append(time.perf_counter() - start)
        lowband.barrier()  # every rank's sends have left its interface: count them all
        tx1, rx1 = read_iface_bytes(ifname)
        tx.append(tx1 - tx0)
        rx.append(rx1 - rx0)
        if not bool((out == lowband.size()).all()):
            raise AssertionError(f"rank {lowband.rank()}: wrong allreduce result")
    print(json.dumps({"rank": lowband.rank(), "times": times, "tx": tx, "rx": rx}), flush=True)
    lowband.shutdown()


if __name__ == "__main__":
    main()
