"""Compressor throughput: compress and decompress speed of every registered compressor, per CPU core.

For each compressor in ``lowband.compress.COMPRESSORS`` (built with its default options; a spec such as
``qsgd:levels=3`` may be given instead with ``--compressors``) and each size of float32 input (default
64 KB, 1 MB, 16 MB), on one thread (``torch.set_num_threads(1)``):

- one sample times ``k`` calls of ``compress`` on the same input (each with its own step, so random
  compressors draw fresh numbers), then ``k`` calls of ``decompress`` on the payloads; ``k`` is chosen
  once per cell so that a sample lasts at least ``--min-sample-ms``;
- ``--reps`` samples (after one warm-up sample) give the median and the range (min, max) of the
  throughput, in MB/s of float32 input (MB = 10**6 bytes), of compress, decompress and the round trip.

The payload's wire size and compression ratio are recorded too. A compressor that cannot be built with
default options or fails is reported with its error and skipped.

Usage::

    python benchmarks/compressor_throughput.py                       # all compressors, 64KB,1MB,16MB
    python benchmarks/compressor_throughput.py --quick               # smoke run: 64KB, 3 reps
    python benchmarks/compressor_throughput.py --compressors onebit,qsgd:levels=3 --sizes 1MB

Prints a table and writes raw samples, summaries and metadata as JSON to ``--out`` (default
``benchmarks/results/compressor_throughput.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from lowband.compress import COMPRESSORS, CompressContext, Compressor, Payload, make_compressor

UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}
DEFAULT_SIZES = "64KB,1MB,16MB"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "compressor_throughput.json"


def parse_size(text: str) -> int:
    """``"64KB"`` -> 65536 (binary units; a bare number is bytes); a positive multiple of 4."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 64KB, 1MB, 16MB")
    unit = m.group(2) or "B"
    nbytes = int(float(m.group(1)) * UNITS[unit if unit.endswith("B") else unit + "B"])
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} = {nbytes} bytes is not a positive multiple of 4")
    return nbytes


def fmt_size(nbytes: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}"
    return f"{nbytes}B"


def summary(mbps: list[float]) -> dict[str, float]:
    return {"median": statistics.median(mbps), "min": min(mbps), "max": max(mbps)}


def sample(c: Compressor, x: torch.Tensor, k: int, first_step: int) -> tuple[float, float, Payload]:
    """Seconds for ``k`` compress calls, then for ``k`` decompress calls of their payloads."""
    ctxs = [CompressContext("bench", first_step + i, 0, 0) for i in range(k)]
    t0 = time.perf_counter()
    payloads = [c.compress(x, ctx) for ctx in ctxs]
    t1 = time.perf_counter()
    for ctx, p in zip(ctxs, payloads):
        c.decompress(p, ctx)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, payloads[-1]


def measure(c: Compressor, nbytes: int, reps: int, min_sample_s: float) -> dict[str, Any]:
    x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(nbytes), dtype=torch.float32)
    comp_s, dec_s, payload = sample(c, x, 1, 0)  # warm-up, and the calibration of k
    k = max(1, min(1000, int(min_sample_s / max(comp_s + dec_s, 1e-9)) + 1))
    mb = nbytes / 1e6
    raw: list[dict[str, float]] = []
    step = 1
    for _ in range(reps):
        comp_s, dec_s, payload = sample(c, x, k, step)
        step += k
        raw.append({"compress_s": comp_s / k, "decompress_s": dec_s / k})
    return {
        "calls_per_sample": k,
        "wire_bytes": payload.nbytes,
        "ratio": nbytes / payload.nbytes if payload.nbytes else float("inf"),
        "compress_MBps": summary([mb / r["compress_s"] for r in raw]),
        "decompress_MBps": summary([mb / r["decompress_s"] for r in raw]),
        "roundtrip_MBps": summary([mb / (r["compress_s"] + r["decompress_s"]) for r in raw]),
        "samples": raw,
    }


def run(specs: Sequence[str], sizes: Sequence[int], reps: int, min_sample_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    cells = [(s, n) for s in specs for n in sizes]
    with tqdm(total=len(cells), desc="compressors", unit="cell", file=sys.stderr, delay=3.0) as bar:
        for spec in specs:
            entry: dict[str, Any] = {"sizes": {}}
            results[spec] = entry
            try:
                c = make_compressor(spec)
                entry["repr"] = repr(c)
            except Exception as exc:  # a compressor that needs options: reported, not measured
                entry["error"] = f"{type(exc).__name__}: {exc}"
                bar.update(len(sizes))
                continue
            for nbytes in sizes:
                bar.set_postfix_str(f"{spec} {fmt_size(nbytes)}", refresh=False)
                try:
                    entry["sizes"][fmt_size(nbytes)] = measure(c, nbytes, reps, min_sample_s)
                except Exception as exc:
                    entry["sizes"][fmt_size(nbytes)] = {"error": f"{type(exc).__name__}: {exc}"}
                bar.update(1)
    return results


def table(results: dict[str, Any]) -> str:
    head = f"{'compressor':<22} {'size':>6} {'ratio':>7} {'compress MB/s':>24} {'decompress MB/s':>24}"
    lines = [head, "-" * len(head)]

    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:9.1f} [{s['min']:.0f}-{s['max']:.0f}]"

    for spec, entry in results.items():
        if "error" in entry:
            lines.append(f"{spec:<22} not measured: {entry['error']}")
            continue
        for size, r in entry["sizes"].items():
            if "error" in r:
                lines.append(f"{spec:<22} {size:>6} failed: {r['error']}")
                continue
            lines.append(
                f"{spec:<22} {size:>6} {r['ratio']:7.1f} {cell(r['compress_MBps']):>24} {cell(r['decompress_MBps']):>24}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--compressors", default="", help="comma-separated specs (default: every registered)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"float32 input sizes (default {DEFAULT_SIZES})")
    ap.add_argument("--reps", type=int, default=9, help="timed samples per cell (default 9)")
    ap.add_argument("--min-sample-ms", type=float, default=50.0, help="shortest sample (default 50 ms)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 64KB, 3 reps, 10 ms samples")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.reps, args.min_sample_ms = "64KB", 3, 10.0
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    specs = [s for s in args.compressors.split(",") if s.strip()] or list(COMPRESSORS)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    started = time.perf_counter()
    results = run(specs, sizes, args.reps, args.min_sample_ms / 1e3)
    doc = {
        "benchmark": "compressor_throughput",
        "unit": "MB/s of float32 input (MB = 1e6 bytes), one thread",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        "min_sample_ms": args.min_sample_ms,
        "sizes": [fmt_size(n) for n in sizes],
        "wall_s": time.perf_counter() - started,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(results))
    print(f"\n{len(specs)} compressors x {len(sizes)} sizes in {doc['wall_s']:.1f} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
