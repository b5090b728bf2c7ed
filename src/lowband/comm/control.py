"""The control process group: the small rows ranks post to check each other, and what they imply.

Every row posted on a group's control process group has the same length (``HEADER + group size``
int64) and starts with a magic number and an op code, so any two ranks' rows can be compared, and a
rank checking one thing while another checks something else gets a clean error, never a size
mismatch inside gloo (which aborts the process).

Per control process group and rank, a :class:`ControlState` remembers the signature tables verified
so far as a successor map ("after table A came table B"), which lets the argument check skip its
round trip when a rank's call is the predicted one (:func:`lowband.comm.validate.check` explains why
that is safe), the rows posted without waiting that are still to be verified, and whether a mismatch
has left the group unusable.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from lowband.errors import CollectiveMismatchError
from lowband.group import Group

#: first field of a row posted by a rank that waits for the table before it issues the op's data
MAGIC = 0x10BA
#: first field of a row posted by a rank that issued the op's data at once (its call was predicted)
FAST = 0x10BB
#: fields every control row shares: magic, op code, then op-specific ints (a collective's signature
#: uses 12 header fields: op, dtype, ndim, 6 dims, a hash of further dims, one argument)
HEADER = 12
F_MAGIC, F_OP = 0, 1
#: verified tables remembered per group before the map starts afresh (on every rank at once)
MAX_TABLES = 4096
UNUSABLE = (
    "some ranks had already issued the op their previous calls predicted, so a data op is left "
    "pending and the group is unusable from now on (create a new group, or restart)"
)

Row = tuple[int, ...]
Table = tuple[Row, ...]


def row_length(group: Group) -> int:
    """Length of every control row on ``group``."""
    return HEADER + group.size


def normalized(rows: list[list[int]]) -> Table:
    """The table with every row's magic made :data:`MAGIC` (the FAST mark is not part of the call)."""
    return tuple((MAGIC, *r[1:]) if r and r[0] == FAST else tuple(r) for r in rows)


class Node:
    """A verified table, this rank's row in it, and the table that followed it last time. The
    tensors a predicted post needs (this rank's row and the whole table, marked FAST) are built once."""

    __slots__ = ("_fast_row", "_fast_table", "mine", "next", "rows")

    def __init__(self, rows: Table, mine: Row) -> None:
        self.rows, self.mine = rows, mine
        self.next: Node | None = None
        self._fast_row: torch.Tensor | None = None
        self._fast_table: torch.Tensor | None = None

    def fast_row(self) -> torch.Tensor:
        if self._fast_row is None:
            self._fast_row = torch.tensor([FAST, *self.mine[1:]], dtype=torch.int64)
        return self._fast_row

    def fast_table(self) -> torch.Tensor:
        """The table (flat) the control allgather returns when every rank's call was the predicted one."""
        if self._fast_table is None:
            flat = [v for r in self.rows for v in (FAST, *r[1:])]
            self._fast_table = torch.tensor(flat, dtype=torch.int64)
        return self._fast_table


class Posted:
    """A row posted without waiting: the allgather's work, its output, the table it must produce."""

    __slots__ = ("expect", "lock", "out", "rows", "where", "work")

    def __init__(self, out: torch.Tensor, expect: Node, where: str) -> None:
        self.out, self.expect, self.where = out, expect, where
        self.work: Any = None  # the allgather, once posted (right after the op's data is issued)
        self.rows: list[list[int]] | None = None
        self.lock = threading.Lock()


class ControlState:
    """What one rank knows about one control process group (see the module docstring)."""

    def __init__(self, pg: Any) -> None:
        self.pg = weakref.ref(pg)  # never keeps a freed group's process group alive
        self.lock = threading.Lock()
        self.root = Node((), ())
        self.last = self.root
        self.tables: dict[Table, Node] = {}
        self.posted: collections.deque[Posted] = collections.deque()
        self.broken: str | None = None
        #: how many checks took the blocking exchange, and how many the predicted path
        self.blocking = 0
        self.predicted = 0

    # -- the successor map (changed only at points every rank passes with the same table) --------
    def prediction(self) -> Node | None:
        return self.last.next

    def advance(self, rows: Table, me: int) -> Node:
        """Record that the verified ``rows`` followed the last table."""
        node = self.tables.get(rows)
        if node is None:
            if len(self.tables) >= MAX_TABLES:
                self.tables.clear()
                self.root.next = None
            node = Node(rows, rows[me])
            self.tables[rows] = node
        self.last.next = node
        self.last = node
        return node

    # -- rows posted without waiting ------------------------------------------------------------
    def post_predicted(self, g: Group, node: Node, where: str) -> Posted:
        """Take the predicted path: this rank's row (marked FAST) is posted without waiting by
        :meth:`post`, right after the caller has issued the op's data (so that the control op never
        delays the data op's start)."""
        self.flush(g)
        p = Posted(torch.empty(g.size * len(node.mine), dtype=torch.int64), node, where)
        with self.lock:
            self.posted.append(p)
            self.last = node
            self.predicted += 1
        return p

    @staticmethod
    def post(p: Posted, g: Group) -> None:
        if p.work is None:
            p.work = g.control_pg._allgather_base(p.out, p.expect.fast_row())

    def flush(self, g: Group) -> None:
        """Post any row taken and not yet posted (an op that failed between its check and its
        issue), so that the control allgathers stay in the same order on every rank."""
        if self.posted and self.posted[-1].work is None:
            for p in list(self.posted):
                self.post(p, g)

    def verify(self, p: Posted, g: Group, timeout: float) -> None:
        """Wait (bounded) for a posted row's table; raise :class:`CollectiveMismatchError` (and mark
        the group unusable) unless it is the predicted one."""
        from lowband.comm.handle import comm_error

        with p.lock:
            if p.rows is None:
                try:
                    p.work.wait(datetime.timedelta(seconds=timeout))
                except RuntimeError as exc:
                    raise comm_error(f"{p.where} (argument check)", exc, timeout) from exc
                # every rank's call predicted (the steady state), else look at the rows
                same = torch.equal(p.out, p.expect.fast_table())
                p.rows = [] if same else p.out.view(g.size, -1).tolist()
        with self.lock:
            if p in self.posted:
                self.posted.remove(p)
        if p.rows and normalized(p.rows) != p.expect.rows:
            raise self.fail(mismatch(p.where, g, p.rows))

    def drain(self, g: Group, timeout: float) -> None:
        """Verify the posted rows whose tables are complete (never blocks)."""
        while self.posted:
            done = [p for p in list(self.posted) if p.work is not None and p.work.is_completed()]
            if not done:
                return
            for p in done:
                self.verify(p, g, timeout)

    def settle(self, g: Group, timeout: float) -> None:
        """Verify every posted row (bounded wait)."""
        self.flush(g)
        while self.posted:
            self.verify(self.posted[0], g, timeout)

    def fail(self, message: str) -> CollectiveMismatchError:
        """The error for a mismatch that left a data op pending; every later op on the group raises it."""
        with self.lock:
            if self.broken is None:
                self.broken = f"{message}; {UNUSABLE}"
        return CollectiveMismatchError(f"{message}; {UNUSABLE}")

    def usable(self, where: str) -> None:
        if self.broken is not None:
            raise CollectiveMismatchError(f"{where}: an earlier mismatch on this group: {self.broken}")


class Watched:
    """A data work of an op issued on a prediction. Waiting on it waits for the data; if that takes
    long, it looks at the op's control table between waits, and raises the mismatch (instead of
    waiting out the timeout) when the other ranks' calls were not the predicted ones, so their data
    will never come. (When the data arrives, every rank issued it: no check is needed then; the table
    is verified later, at the group's next op.)"""

    #: first and longest wait between looks at the control table, seconds
    FIRST_LOOK, MAX_LOOK = 0.05, 0.5

    def __init__(self, work: Any, state: ControlState, posted: Posted, g: Group) -> None:
        self.work, self.state, self.posted, self.g = work, state, posted, g

    def wait(self, timeout: datetime.timedelta) -> bool:
        total = timeout.total_seconds()
        start = time.monotonic()
        look = self.FIRST_LOOK
        while True:
            left = total - (time.monotonic() - start)
            try:
                self.work.wait(datetime.timedelta(seconds=max(min(look, left), 0.0)))
                return True
            except RuntimeError:
                if self.work.is_completed():
                    # it completed after the look timed out (a timed-out wait does not cancel a
                    # collective's work): one more wait returns, or raises the work's own error
                    self.work.wait(datetime.timedelta(seconds=max(left, 1.0)))
                    return True
                if left <= look:
                    raise  # the whole timeout passed
            if self.posted.work.is_completed():
                self.state.verify(self.posted, self.g, total)
            look = min(2 * look, self.MAX_LOOK)

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def get_future(self) -> Any:
        return self.work.get_future()


class Guard:
    """The only "work" of an op issued on a prediction that moves no data (an empty tensor): waiting
    on it waits for the control table and raises the mismatch if the prediction was wrong."""

    def __init__(self, state: ControlState, posted: Posted, g: Group) -> None:
        self.state, self.posted, self.g = state, posted, g

    def wait(self, timeout: datetime.timedelta) -> bool:
        self.state.verify(self.posted, self.g, timeout.total_seconds())
        return True

    def is_completed(self) -> bool:
        return bool(self.posted.work.is_completed())

    def get_future(self) -> Any:
        return self.posted.work.get_future()


@dataclass(eq=False)
class Prediction:
    """What an op issued on a prediction hands to its handle: its data works are watched."""

    state: ControlState
    posted: Posted
    group: Group

    def post(self) -> None:
        """Post this rank's row (call right after issuing the op's data works)."""
        self.state.post(self.posted, self.group)

    def watch(self, works: list[Any]) -> list[Any]:
        """The op's works, watched (a lone guard when the op moves no data)."""
        if not works:
            return [Guard(self.state, self.posted, self.group)]
        return [Watched(w, self.state, self.posted, self.group) for w in works]


def left_pending(ctx: Any) -> bool:
    """Whether a mismatch on one of ``ctx``'s groups left a data op pending (freeing such a group's
    process group waits for that op, up to the timeout)."""
    states: dict[int, ControlState] = ctx.state.get(__name__, {})
    return any(st.broken is not None for st in states.values())


def state_of(g: Group) -> ControlState:
    """This rank's :class:`ControlState` of ``g``'s control process group."""
    from lowband.runtime import current

    ctx = current("the argument check")
    states: dict[int, ControlState] = ctx.state.setdefault(__name__, {})
    pg = g.control_pg
    st = states.get(id(pg))
    if st is None or st.pg() is not pg:
        for key in [k for k, v in states.items() if v.pg() is None]:
            del states[key]  # states of freed process groups
        st = states[id(pg)] = ControlState(pg)
    return st


def mismatch(where: str, g: Group, rows: list[list[int]]) -> str:
    """What differs in ``rows``: the first rank whose call differs from the group's first rank's."""
    from lowband.comm.validate import describe

    table = normalized(rows)
    r = next((i for i, row in enumerate(table) if row != table[0]), None)
    if r is None:  # same calls, but some ranks took the predicted path and others needed the table
        fast = [g.ranks[i] for i, row in enumerate(rows) if row[F_MAGIC] == FAST]
        return (
            f"{where} (group {g.name!r}): ranks {fast} issued {describe(list(table[0]), True)} without "
            "waiting for the other ranks' sizes while others asked for them"
        )
    return (
        f"{where} (group {g.name!r}): the ranks' calls differ: rank {g.ranks[0]} called "
        f"{describe(list(table[0]), True)}, rank {g.ranks[r]} called {describe(list(table[r]), True)}"
    )


def exchange(
    group: Group,
    row: torch.Tensor,
    where: str,
    timeout: float,
    *,
    expect: Node | None = None,
    label: str = "argument check",
) -> list[list[int]]:
    """Allgather ``row`` (int64, :func:`row_length` long) from every rank of ``group`` on its control
    process group and return the ``group.size`` rows (bounded by ``timeout`` seconds; ``where`` and
    ``label`` name the caller in errors).

    Rows this rank posted earlier without waiting are verified first. If some rank issued its op's
    data on a prediction (its row is marked FAST) and the table is not ``expect``'s, the ranks' calls
    differ and a data op is pending: every rank raises :class:`CollectiveMismatchError` and the group
    is marked unusable.
    """
    from lowband.comm.handle import comm_error

    st = state_of(group)
    st.usable(where)
    st.settle(group, timeout)
    out = torch.empty(group.size * row.numel(), dtype=torch.int64)
    try:
        work = group.control_pg._allgather_base(out, row)
        work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise comm_error(f"{where} ({label})", exc, timeout) from exc
    rows: list[list[int]] = out.view(group.size, row.numel()).tolist()
    st.blocking += 1
    if any(r[F_MAGIC] == FAST for r in rows) and (expect is None or normalized(rows) != expect.rows):
        raise st.fail(mismatch(where, group, rows))
    return rows
