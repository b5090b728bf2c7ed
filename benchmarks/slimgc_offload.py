"""Asynchronous compression on a CPU host: how much of the compression a worker thread hides behind
backward, and what the two threads cost each other (torch's intra-op pool is shared).

One process, no communication. A small MLP's forward+backward and the compression of all its gradients
(one compressor call per parameter tensor, with error feedback, as SlimGC's executor does), measured
side by side in one run, interleaved, for each ``torch.set_num_threads``:

- ``backward``: forward + backward alone;
- ``compress``: compressing the gradients alone;
- ``inline``: backward, then compression on the same thread (the paper's baseline, serial);
- ``offload``: backward while a worker thread compresses the previous step's gradients (the executor's
  overlap, with nothing to wait for but the worker at the end of the step).

Prints the medians and ``offload / inline`` (below 1: the worker hides compression) and
``offload / max(backward, compress)`` (1: perfect overlap; higher: the two threads slow each other).

Usage: ``python benchmarks/slimgc_offload.py [--compressor SPEC] [--reps N] [--out PATH]`` (~30 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowband.compress import COMPRESSORS, CompressContext, ResidualMemory, make_compressor


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _backward(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    m.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(m(x), y).backward()  # type: ignore[no-untyped-call]
    return [p.grad.detach().clone() for p in m.parameters() if p.grad is not None]


def _compress(spec: str, memory: ResidualMemory, grads: list[torch.Tensor], step: int) -> None:
    c = make_compressor(spec)
    for k, g in enumerate(grads):
        ctx = CompressContext(f"p{k}", step)
        segs = ((f"p{k}", g.numel()),)
        p = memory.compensate(segs, g.reshape(-1))
        payload = c.compress(p, ctx)
        memory.update(segs, p, c.decompress(payload, ctx))


def run(spec: str, reps: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    m = _model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 512, generator=g), torch.randint(0, 10, (256,), generator=g)
    mem = ResidualMemory()
    grads = _backward(m, x, y)
    times: dict[str, list[float]] = {"backward": [], "compress": [], "inline": [], "offload": []}
    for r in range(reps + 2):
        t0 = time.perf_counter()
        grads = _backward(m, x, y)
        t1 = time.perf_counter()
        _compress(spec, mem, grads, r)
        t2 = time.perf_counter()
        grads = _backward(m, x, y)
        _compress(spec, mem, grads, r)
        t3 = time.perf_counter()
        prev = grads
        worker = threading.Thread(target=_compress, args=(spec, mem, prev, r))
        t4 = time.perf_counter()
        worker.start()
        grads = _backward(m, x, y)
        worker.join()
        t5 = time.perf_counter()
        if r >= 2:  # the first repetitions warm caches and allocators
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t5 - t4)):
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "threads": threads,
        "median_s": med,
        "offload_over_inline": med["offload"] / med["inline"],
        "offload_over_ideal": med["offload"] / max(med["backward"], med["compress"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = "onebit:threshold=0.5" if "onebit" in COMPRESSORS.names() else "bf16"
    ap.add_argument("--compressor", default=default)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results/slimgc_offload.json")
    a = ap.parse_args()
    results = [run(a.compressor, a.reps, t) for t in (1, 2)]
    for res in results:
        med = res["median_s"]
        print(
            f"threads={res['threads']}: backward {med['backward'] * 1e3:.1f} ms, compress {med['compress'] * 1e3:.1f} ms, "
            f"inline {med['inline'] * 1e3:.1f} ms, offload {med['offload'] * 1e3:.1f} ms; "
            f"offload/inline {res['offload_over_inline']:.2f}, offload/max(backward, compress) "
            f"{res['offload_over_ideal']:.2f}"
        )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"compressor": a.compressor, "reps": a.reps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
