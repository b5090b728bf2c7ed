"""User-facing switches for the tracer of the calling rank (see :mod:`lowband.comm.trace`)."""

from __future__ import annotations

import os
from pathlib import Path

from lowband.comm.trace import merge_chrome_traces
from lowband.runtime import current

__all__ = ["chrome_trace", "counters", "gather_counters", "merge_chrome_traces", "reset_trace", "set_trace"]


def set_trace(enabled: bool = True) -> None:
    """Turn byte counters and the timeline on or off for this rank."""
    current("set_trace").tracer.enabled = bool(enabled)


def reset_trace() -> None:
    current("reset_trace").tracer.reset()


def counters() -> dict[str, dict[str, int]]:
    """This rank's per-op counters: ``{op: {calls, bytes_sent, bytes_received}}``."""
    return current("counters").tracer.counters()


def chrome_trace(path: str | os.PathLike[str]) -> Path:
    """Write this rank's timeline as Chrome trace JSON (open it in https://ui.perfetto.dev)."""
    return current("chrome_trace").tracer.export_chrome_trace(path)


def gather_counters() -> dict[int, dict[str, dict[str, int]]]:
    """Every rank's counters, on every rank: ``{rank: {op: {calls, bytes_sent, bytes_received}}}``.

    A collective over the world (call it on every rank); it is not itself counted.
    """
    import json

    import torch

    from lowband.comm.base import host_value
    from lowband.comm.collectives import allgather

    ctx = current("gather_counters")
    mine = json.dumps(ctx.tracer.counters()).encode()
    was, ctx.tracer.enabled = ctx.tracer.enabled, False
    try:
        raw = (
            torch.frombuffer(bytearray(mine), dtype=torch.uint8)
            if mine
            else torch.empty(0, dtype=torch.uint8, device="cpu")
        )
        sizes = allgather(host_value(torch.tensor([raw.numel()], device="cpu")), name="gather_counters.sizes")
        blob = allgather(host_value(raw), sizes=sizes.tolist(), name="gather_counters")
    finally:
        ctx.tracer.enabled = was
    out: dict[int, dict[str, dict[str, int]]] = {}
    pos = 0
    for r, n in enumerate(sizes.tolist()):
        out[r] = json.loads(bytes(blob[pos : pos + n].tolist()).decode())
        pos += n
    return out
