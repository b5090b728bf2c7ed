"""User-facing switches for the tracer of the calling rank (see :mod:`lowband.comm.trace`)."""

from __future__ import annotations

import os
from pathlib import Path

from lowband.comm.trace import merge_chrome_traces
from lowband.runtime import current

__all__ = ["chrome_trace", "counters", "merge_chrome_traces", "reset_trace", "set_trace"]


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
