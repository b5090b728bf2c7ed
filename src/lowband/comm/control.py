"""The cross-rank check's shared state and its rows in the rendezvous key-value store.

A row (``HEADER + group size`` int64) starts with a magic number and an op code, so any two ranks'
rows can be compared, and a rank checking one thing while another checks something else gets a clean
error, never a size mismatch inside gloo (which aborts the process).

Per group and rank, a :class:`ControlState` counts the group's checked ops (the op sequence number,
the same on every rank while the calls agree), remembers the signature tables verified so far as a
successor map ("after table A came table B"; the prediction every rank shares), keeps the ops this
rank issued on that prediction and whose data has not completed yet (:class:`Pending`), and whether
a mismatch has left the group unusable. Rows travel only off the predicted path: a rank publishes its
row for op ``seq`` under the key ``seq/rank`` of a store prefix of its own group
(:meth:`ControlState.meet`), and a predicted rank whose data is late answers such rows
(:meth:`ControlState.look`). :func:`lowband.comm.validate.check` explains why that is safe.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lowband.errors import CollectiveMismatchError, CommTimeoutError
from lowband.group import Group

#: first field of a row published by a rank that waits for the table before it issues the op's data
MAGIC = 0x10BA
#: first field of a row published late by a rank that issued the op's data on the prediction
FAST = 0x10BB
#: fields every row shares: magic, op code, then op-specific ints (a collective's signature uses 12
#: header fields: op, dtype, ndim, 6 dims, a hash of further dims, one argument)
HEADER = 12
F_MAGIC, F_OP = 0, 1
#: verified tables remembered per group before the map starts afresh (on every rank at once)
MAX_TABLES = 4096
#: predicted ops with data in flight remembered per group (a rank further behind gets a timeout)
MAX_PENDING = 4096
#: first and longest wait between looks at the store while data or rows are late, seconds
FIRST_LOOK, MAX_LOOK = 0.05, 0.5
#: first and longest pause between polls of the store for the other ranks' rows, seconds
POLL, MAX_POLL = 0.0002, 0.005
_NONE = "-"  # what :meth:`ControlState.present` reads for a key not published
UNUSABLE = (
    "some ranks had already issued the op their previous calls predicted, so a data op is left "
    "pending and the group is unusable from now on (create a new group, or restart)"
)

Row = tuple[int, ...]
Table = tuple[Row, ...]


def row_length(group: Group) -> int:
    """Length of every row on ``group``."""
    return HEADER + group.size


def normalized(rows: Sequence[Sequence[int]]) -> Table:
    """The table with every row's magic made :data:`MAGIC` (the FAST mark is not part of the call)."""
    return tuple((MAGIC, *r[1:]) if r and r[0] == FAST else tuple(r) for r in rows)


def _contradicts(rows: dict[int, list[int]], expect: Node | None) -> bool:
    """Whether some published row is not its rank's row of the prediction."""
    if expect is None:
        return bool(rows)
    return any(normalized([row])[0] != expect.rows[r] for r, row in rows.items())


class Node:
    """A verified table, this rank's row in it, and the table that followed it last time."""

    __slots__ = ("mine", "next", "rows")

    def __init__(self, rows: Table, mine: Row) -> None:
        self.rows, self.mine = rows, mine
        self.next: Node | None = None


@dataclass(eq=False)
class Pending:
    """An op this rank issued on the prediction ``expect`` (its row ``mine``) at sequence ``seq``."""

    seq: int
    expect: Node
    where: str
    works: list[Any] = field(default_factory=list)
    published: bool = False

    def done(self) -> bool:
        return bool(self.works) and all(w.is_completed() for w in self.works)


class ControlState:
    """What one rank knows about one group's checked ops (see the module docstring)."""

    def __init__(self, pg: Any, store: Any) -> None:
        self.pg = weakref.ref(pg)  # never keeps a freed group's process group alive
        self.store = store
        self.lock = threading.RLock()
        self.root = Node((), ())
        self.last = self.root
        self.tables: dict[Table, Node] = {}
        self.seq = 0
        self.pending: collections.deque[Pending] = collections.deque()
        self.broken: str | None = None
        #: how many checks met the other ranks in the store, and how many took the predicted path
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

    def take_seq(self) -> int:
        with self.lock:
            self.seq += 1
            return self.seq - 1

    # -- the predicted path: nothing is sent -----------------------------------------------------
    def predicted_op(self, node: Node, where: str) -> Pending:
        with self.lock:
            p = Pending(self.take_seq(), node, where)
            self.last = node
            self.predicted += 1
            self.prune()
            self.pending.append(p)
            if len(self.pending) > MAX_PENDING:
                self.pending.popleft()
        return p

    def prune(self, upto: Pending | None = None) -> None:
        """Forget the predicted ops whose data completed, oldest first, and every op up to ``upto`` (an
        op whose data completed): every rank issued those, so no rank is left waiting at them for an
        answer. Constant time per op in the steady state."""
        last = upto.seq if upto is not None else -1
        with self.lock:
            while self.pending and (self.pending[0].seq <= last or self.pending[0].done()):
                self.pending.popleft()

    # -- rows in the store ------------------------------------------------------------------------
    def publish(self, seq: int, rank: int, row: Sequence[int]) -> None:
        self.store.set(f"{seq}/{rank}", " ".join(map(str, row)))

    def present(self, seq: int, size: int) -> dict[int, list[int]]:
        """The rows published for ``seq`` so far, by group rank (never blocks: a compare-and-set that
        never sets reads a key, or says that it is missing, in one round trip)."""
        out = {}
        for r in range(size):
            v = bytes(self.store.compare_set(f"{seq}/{r}", _NONE, _NONE))
            if v != _NONE.encode():
                out[r] = [int(x) for x in v.decode().split()]
        return out

    def read_done(self, seq: int, size: int) -> None:
        """This rank needs ``seq``'s rows no more; the last rank to say so deletes them. A waiting rank
        says so only when the table lets it go on: after a mismatch the rows stay for the ranks that
        still have to see it."""
        if self.store.add(f"{seq}/n", 1) == size:
            for k in [*(f"{seq}/{r}" for r in range(size)), f"{seq}/n"]:
                self.store.delete_key(k)

    def look(self, g: Group) -> None:
        """Answer the ranks that published a row at one of this rank's pending predicted ops (they
        wait for every rank's row): publish this rank's row there, and raise the mismatch (the group
        becomes unusable) if a published row is not its rank's row of the prediction."""
        for p in list(self.pending):
            rows = self.present(p.seq, g.size)
            if not p.published and set(rows) - {g.rank}:
                self.publish(p.seq, g.rank, (FAST, *p.expect.mine[1:]))
                p.published = True
                self.read_done(p.seq, g.size)
            if _contradicts(rows, p.expect):
                rows[g.rank] = [FAST, *p.expect.mine[1:]]
                raise self.fail(mismatch(p.where, g, rows))

    # -- the deviating path: meet the other ranks in the store -----------------------------------
    def meet(
        self,
        g: Group,
        seq: int,
        row: Sequence[int],
        where: str,
        timeout: float,
        label: str = "argument check",
    ) -> list[list[int]]:
        """Publish this rank's ``row`` for ``seq`` and wait (bounded) for every rank's; meanwhile
        answer rows published at this rank's own pending predicted ops. Raises the mismatch (the
        group becomes unusable) as soon as some rank issued the predicted op's data (its row is
        FAST) while a published row is not the prediction's."""
        expect = self.prediction()
        self.publish(seq, g.rank, row)
        keys = [f"{seq}/{r}" for r in range(g.size)]
        start, look, delay = time.monotonic(), FIRST_LOOK, POLL
        next_look = start + look
        while not self.store.check(keys):  # polled: a timed-out store wait logs a warning
            now = time.monotonic()
            if now - start >= timeout:
                missing = [g.ranks[r] for r in range(g.size) if not self.store.check([keys[r]])]
                raise CommTimeoutError(
                    f"{where} ({label}): no completion within {timeout:g} s: ranks {missing} of group "
                    f"{g.name!r} did not call a checked op (a peer may be dead, slow, or calling an "
                    "unchecked op)"
                )
            if now >= next_look:
                rows = self.present(seq, g.size)
                if any(r[F_MAGIC] == FAST for r in rows.values()) and _contradicts(rows, expect):
                    raise self.fail(mismatch(where, g, rows))
                self.look(g)
                look = min(2 * look, MAX_LOOK)
                next_look = time.monotonic() + look
            time.sleep(delay)
            delay = min(2 * delay, MAX_POLL)
        out = [[int(v) for v in bytes(b).decode().split()] for b in self.store.multi_get(keys)]
        with self.lock:
            self.blocking += 1
        return out

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
    long, it looks in the store between waits (:meth:`ControlState.look`) and raises the mismatch
    (instead of waiting out the timeout) when another rank's call was not the predicted one, so its
    data will never come."""

    def __init__(self, work: Any, state: ControlState, pending: Pending, g: Group) -> None:
        self.work, self.state, self.pending, self.g = work, state, pending, g

    def wait(self, timeout: datetime.timedelta) -> bool:
        total = timeout.total_seconds()
        start = time.monotonic()
        look = FIRST_LOOK
        while True:
            left = total - (time.monotonic() - start)
            try:
                self.work.wait(datetime.timedelta(seconds=max(min(look, left), 0.0)))
                break
            except RuntimeError:
                if self.work.is_completed():
                    # it completed after the look timed out (a timed-out wait does not cancel a
                    # collective's work): one more wait returns, or raises the work's own error
                    self.work.wait(datetime.timedelta(seconds=max(left, 1.0)))
                    break
                if left <= look:
                    raise  # the whole timeout passed
            self.state.look(self.g)
            look = min(2 * look, MAX_LOOK)
        self.state.prune(self.pending)  # its data completed: every rank issued it
        return True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def get_future(self) -> Any:
        return self.work.get_future()

    def abort(self) -> None:
        """Abort the watched work's communicator, where it has one to abort (NCCL's contract)."""
        abort = getattr(self.work, "abort", None)
        if abort is not None:
            abort()


@dataclass(eq=False)
class Prediction:
    """What an op issued on a prediction hands to its handle: its data works are watched."""

    state: ControlState
    pending: Pending
    group: Group

    def watch(self, works: list[Any]) -> list[Any]:
        """The op's works, watched (an op that moves no data has none: a rank left waiting at it is
        answered at this rank's next wait for data on the group)."""
        self.pending.works = works
        return [Watched(w, self.state, self.pending, self.group) for w in works]


def left_pending(ctx: Any) -> bool:
    """Whether a mismatch on one of ``ctx``'s groups left a data op pending (freeing such a group's
    process group waits for that op, up to the timeout)."""
    states: dict[int, ControlState] = ctx.state.get(__name__, {})
    return any(st.broken is not None for st in states.values())


def state_of(g: Group) -> ControlState:
    """This rank's :class:`ControlState` of ``g`` (shared by its :meth:`Group.unchecked` views)."""
    from torch.distributed import PrefixStore  # type: ignore[attr-defined]

    from lowband.runtime import current, rendezvous_store

    ctx = current("the argument check")
    states: dict[int, ControlState] = ctx.state.setdefault(__name__, {})
    pg = g.control_pg
    st = states.get(id(pg))
    if st is None or st.pg() is not pg:
        for key in [k for k, v in states.items() if v.pg() is None]:
            del states[key]  # states of freed process groups
        ident = g.key or f"{g.name}{list(g.ranks)}"
        st = states[id(pg)] = ControlState(pg, PrefixStore(f"lowband/check/{ident}/", rendezvous_store(ctx)))
    return st


def mismatch(where: str, g: Group, rows: dict[int, list[int]]) -> str:
    """What differs in the published ``rows`` (by group rank): the first two ranks whose calls differ."""
    from lowband.comm.validate import describe

    ranks = sorted(rows)
    table = dict(zip(ranks, normalized([rows[r] for r in ranks]), strict=True))
    a = ranks[0]
    b = next((r for r in ranks if table[r] != table[a]), None)
    if b is None:  # same calls, but some ranks took the predicted path and others needed the table
        fast = [g.ranks[r] for r in ranks if rows[r][F_MAGIC] == FAST]
        return (
            f"{where} (group {g.name!r}): ranks {fast} issued {describe(list(table[a]), True)} without "
            "waiting for the other ranks' sizes while others asked for them"
        )
    return (
        f"{where} (group {g.name!r}): the ranks' calls differ: rank {g.ranks[a]} called "
        f"{describe(list(table[a]), True)}, rank {g.ranks[b]} called {describe(list(table[b]), True)}"
    )


def exchange(
    group: Group, row: torch.Tensor, where: str, timeout: float, *, label: str = "argument check"
) -> list[list[int]]:
    """Every rank's ``row`` (int64, :func:`row_length` long) of ``group``, met through the store at the
    group's next op sequence number (bounded by ``timeout`` seconds; ``where`` and ``label`` name the
    caller in errors). If some rank issued its op's data on a prediction meanwhile (its row is FAST),
    the ranks' calls differ and a data op is pending: every rank raises
    :class:`CollectiveMismatchError` and the group is marked unusable."""
    st = state_of(group)
    st.usable(where)
    seq = st.take_seq()
    rows = st.meet(group, seq, [int(v) for v in row.tolist()], where, timeout, label)
    if any(r[F_MAGIC] == FAST for r in rows):
        raise st.fail(mismatch(where, group, dict(enumerate(rows))))
    st.read_done(seq, group.size)  # every rank read the same table: none needs it again
    return rows


def control_allreduce(g: Group, t: torch.Tensor, op: str, timeout: float, where: str) -> torch.Tensor:
    """Elementwise ``op`` ("min" or "max") of a small CPU tensor over ``g``'s control process group, in
    place (gloo: a timed wait is safe there), bounded by ``timeout``; a failure or timeout is the lowband
    error naming ``where``. For lowband's own control values (negotiation masks, stop flags)."""
    import torch.distributed as dist

    from lowband.comm.handle import comm_error

    if g.size == 1:
        return t
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    try:
        g.control_pg.allreduce([t], opts).wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise comm_error(where, exc, timeout) from exc
    return t
