"""Per-rank state of the BlueFog compatibility layer: the networkx graphs as the user set them, and the
integer handles of nonblocking ops.

Everything lives in ``ctx.state["lowband.compat.bluefog.torch"]`` (the test harness runs ranks as threads
of one process, so nothing here may be a module global).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from lowband.comm.handle import Handle
from lowband.errors import InvalidArgumentError
from lowband.runtime import Context, current

STATE_KEY = "lowband.compat.bluefog.torch"
MOD = "lowband.compat.bluefog.torch"


@dataclass
class CompatState:
    """One rank's compat state. ``graph``/``machine_graph`` are the networkx graphs last set (returned by
    ``load_topology``/``load_machine_topology``) and the lowband topologies made of them; ``handles`` maps BlueFog's integer handles to lowband
    handles (collectives and neighbor ops) and ``win_handles`` those of the window ops."""

    graph: Any = None
    is_weighted: bool = False
    topology: Any = None
    machine_graph: Any = None
    machine_is_weighted: bool = False
    machine_topology: Any = None
    handles: dict[int, Handle[Any]] = field(default_factory=dict)
    win_handles: dict[int, Handle[Any]] = field(default_factory=dict)
    counter: itertools.count[int] = field(default_factory=itertools.count)
    timeline: dict[str, Any] = field(default_factory=dict)
    suspended: bool = False
    timeline_file: str | None = None
    timeline_written: float = 0.0
    assoc_p: bool = False
    p_windows: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def compat_state(ctx: Context | None = None, op: str = "bluefog") -> CompatState:
    """This rank's :class:`CompatState` (created on first use)."""
    c = current(op) if ctx is None else ctx
    st = c.state.get(STATE_KEY)
    if st is None:
        st = CompatState()
        c.state[STATE_KEY] = st
    assert isinstance(st, CompatState)
    return st


def register(handle: Handle[Any], *, window: bool = False) -> int:
    """Keep ``handle`` under a fresh integer (unique on this rank) and return the integer."""
    st = compat_state(op=handle.op)
    key = next(st.counter)
    (st.win_handles if window else st.handles)[key] = handle
    return key


def lookup(op: str, handle: object, *, window: bool = False, pop: bool) -> Handle[Any]:
    """The lowband handle behind ``handle`` (an integer from a nonblocking op, or a lowband
    :class:`Handle` itself); ``pop`` forgets the integer. Unknown handles raise
    :class:`InvalidArgumentError`, as BlueFog raises ``ValueError``."""
    if isinstance(handle, Handle):
        return handle
    ctx = current(op)
    table = compat_state(ctx, op).win_handles if window else compat_state(ctx, op).handles
    if isinstance(handle, bool) or not isinstance(handle, int) or handle not in table:
        kind = "window op" if window else "nonblocking op"
        raise InvalidArgumentError(
            f"{MOD}.{op} on rank {ctx.rank}: handle={handle!r} is not the handle of a pending {kind} on this "
            "rank (each handle can be waited on once)"
        )
    return table.pop(handle) if pop else table[handle]
