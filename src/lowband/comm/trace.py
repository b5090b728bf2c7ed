"""Byte counters and a per-rank timeline of every op, exported as Chrome trace JSON (Perfetto).

Off by default. When off, an op pays one attribute read (``tracer.enabled``) and nothing else.

Bytes are *logical wire bytes*: what this rank must send and receive under the bandwidth-optimal
algorithm for the op (ring allreduce: 2(n-1)/n of the buffer each way; allgather: the other ranks'
blocks in, its own block to each peer out; alltoall and point-to-point: exact). gloo does not expose
the bytes it actually moved; docs/ARCHITECTURE.md lists the model of every op.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class OpCounter:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}


@dataclass
class Event:
    op: str
    name: str | None
    start_us: float
    end_us: float | None
    bytes_sent: int
    bytes_received: int
    group: str


class Tracer:
    """Counters and timeline of one rank. Thread-safe: completions are recorded from torch's callbacks."""

    def __init__(self, rank: int, enabled: bool = False) -> None:
        self.rank = rank
        self.enabled = enabled
        self._lock = threading.Lock()
        self._counters: dict[str, OpCounter] = defaultdict(OpCounter)
        self._events: list[Event] = []
        self._t0 = time.perf_counter()
        self._wall0 = time.time()

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def start(self, op: str, name: str | None, sent: int, received: int, group: str) -> Event:
        ev = Event(op, name, self._now_us(), None, sent, received, group)
        with self._lock:
            c = self._counters[op]
            c.calls += 1
            c.bytes_sent += sent
            c.bytes_received += received
            self._events.append(ev)
        return ev

    def end(self, ev: Event) -> None:
        if ev.end_us is None:
            ev.end_us = self._now_us()

    def reset(self) -> None:
        with self._lock:
            self._counters.clear()
            self._events.clear()

    def counters(self) -> dict[str, dict[str, int]]:
        """Per-op totals on this rank: ``{op: {calls, bytes_sent, bytes_received}}``."""
        with self._lock:
            return {op: c.as_dict() for op, c in self._counters.items()}

    def totals(self) -> dict[str, int]:
        out = {"calls": 0, "bytes_sent": 0, "bytes_received": 0}
        for c in self.counters().values():
            for k in out:
                out[k] += c[k]
        return out

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def chrome_events(self) -> list[dict[str, Any]]:
        """Complete ('X') events, one track per rank (pid = rank), timestamps in microseconds."""
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}
        ]
        base = self._wall0 * 1e6
        for ev in self.events():
            end = ev.end_us if ev.end_us is not None else ev.start_us
            out.append(
                {
                    "name": ev.name or ev.op,
                    "cat": ev.op,
                    "ph": "X",
                    "pid": self.rank,
                    "tid": ev.group,
                    "ts": base + ev.start_us,
                    "dur": max(end - ev.start_us, 0.0),
                    "args": {
                        "op": ev.op,
                        "bytes_sent": ev.bytes_sent,
                        "bytes_received": ev.bytes_received,
                        "completed": ev.end_us is not None,
                    },
                }
            )
        return out

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write this rank's timeline as Chrome trace JSON; merge ranks with :func:`merge_chrome_traces`."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"traceEvents": self.chrome_events(), "displayTimeUnit": "ms"}))
        return p


def merge_chrome_traces(paths: list[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Merge per-rank trace files into one file that shows every rank as its own process."""
    events: list[Any] = []
    for path in paths:
        events.extend(json.loads(Path(path).read_text())["traceEvents"])
    o = Path(out)
    o.parent.mkdir(parents=True, exist_ok=True)
    o.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return o
