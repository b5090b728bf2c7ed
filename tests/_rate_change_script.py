"""The link-drift test's script: ``python _rate_change_script.py OUTDIR DEADLINE KIB``.

Every rank allreduces a KIB KiB float32 tensor again and again until DEADLINE (a ``time.perf_counter()``
value, CLOCK_MONOTONIC: the test's and the launcher's clock too); rank 0 writes the start and duration
of each allreduce to OUTDIR/times.json. The ranks stop together: each one's "go on" flag travels in the
allreduce itself.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import lowband


def main() -> None:
    out, deadline, kib = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    lowband.init(timeout=60, check=False)
    n = lowband.size()
    t = torch.zeros(kib * 1024 // 4, dtype=torch.float32)
    samples: list[tuple[float, float]] = []
    while True:
        t[0] = 1.0 if time.perf_counter() < deadline else 0.0
        start = time.perf_counter()
        res = lowband.allreduce(t, op="sum")
        samples.append((start, time.perf_counter() - start))
        if float(res[0]) < n:  # some rank is past the deadline
            break
    if lowband.rank() == 0:
        (out / "times.json").write_text(json.dumps(samples))


if __name__ == "__main__":
    main()
