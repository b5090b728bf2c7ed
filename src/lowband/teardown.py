"""Closing what a rank opened: process groups, and the connections its helper threads wait on.

Used by :func:`lowband.destroy_group`, :func:`lowband.shutdown` and the interpreter-exit hook of
:mod:`lowband.runtime`.
"""

from __future__ import annotations

import datetime
import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lowband.group import Group
    from lowband.runtime import Context


def close_pg(pg: Any) -> None:
    """Close one process group on this rank (a local step): torch's registry entry, connections, threads.
    A receive pending on it is not woken by this (see :func:`break_connections`)."""
    if pg is None or pg is dist.GroupMember.NON_GROUP_MEMBER:
        return
    try:
        dist.destroy_process_group(pg)
        return
    except (ValueError, AssertionError, RuntimeError):  # not in torch's registry (made from a store)
        pass
    try:
        pg.shutdown()
    except (RuntimeError, AttributeError):
        pass


def release_pgs() -> None:
    """Free the process groups nothing refers to any more but a reference cycle, now (their C++
    destructors join their worker threads) rather than at interpreter finalization (see
    :func:`lowband.runtime._at_exit` for why that matters)."""
    gc.collect()


def lowband_threads() -> list[threading.Thread]:
    """This process's lowband helper threads (engine workers, the completion thread, window receivers), not thread ranks."""
    me = threading.current_thread()
    return [
        t
        for t in threading.enumerate()
        if t is not me and t.name.startswith("lowband-") and not t.name.startswith("lowband-rank")
    ]


_idle: set[int] = set()  # idents of helper threads now waiting for work (see :func:`idle`)
_idle_lock = threading.Lock()


@contextmanager
def idle() -> Iterator[None]:
    """Mark the calling helper thread as waiting for work (a queue, a condition), not for a peer.

    Shutdown waits for helper threads that may be blocked in a gloo wait (see
    :func:`lowband.runtime.shutdown`), never for idle ones: a strategy that was not closed (a rank that
    raised mid-step) leaves its worker waiting for a task that will never come, and waiting for it only
    delays the exit (a daemon thread in a Python-level wait is harmless at interpreter exit)."""
    me = threading.get_ident()
    with _idle_lock:
        _idle.add(me)
    try:
        yield
    finally:
        with _idle_lock:
            _idle.discard(me)


def is_idle(t: threading.Thread) -> bool:
    return t.ident in _idle


def join_threads(threads: list[threading.Thread], limit: float) -> list[threading.Thread]:
    """Wait at most ``limit`` seconds in all for ``threads`` to end or wait for work (:func:`idle`);
    returns those still busy."""
    deadline = time.monotonic() + limit
    busy = [t for t in threads if t.is_alive() and not is_idle(t)]
    while busy and time.monotonic() < deadline:
        busy[0].join(min(0.01, max(0.0, deadline - time.monotonic())))
        busy = [t for t in busy if t.is_alive() and not is_idle(t)]
    return busy


#: a tag no lowband message uses (p2p uses tags below 2**31 - 1 only for a user tag of 2**30 - 1)
_BREAK_TAG = 2**31 - 1


def break_connections(ctx: Context) -> None:
    """Close this rank's connection to every peer of every group, so that receives still pending on them
    fail now, here and at the peers. A pending gloo receive cannot be woken locally (destroying its
    process group does not), but a timed-out wait closes its connection: so post a receive nobody sends
    to and let it time out, per peer."""
    seen: set[int] = set()
    for g in [ctx.world, *ctx._groups]:
        break_group(g, seen)


def break_group(g: Group, seen: set[int] | None = None) -> None:
    """Close this rank's connections to every peer of ``g`` (its data and control process groups, each
    once: ``seen`` holds the ids of those closed already), so that every op pending or issued later on
    them fails at once, here and at the peers (:func:`break_connections`). A local step."""
    seen = set() if seen is None else seen
    for pg in (g.pg, g.ctl):
        if pg is None or id(pg) in seen:
            continue
        seen.add(id(pg))
        for peer in range(g.size):
            if peer == g.rank:
                continue
            try:
                pg.recv([torch.empty(1, device="cpu")], peer, _BREAK_TAG).wait(
                    datetime.timedelta(milliseconds=1)
                )
            except (RuntimeError, ValueError):
                pass  # timed out (the connection is closed now), or it was closed already
