"""Transport of the one-sided window operations: a dedicated gloo process group per lowband group and,
on every rank, one receiver thread per neighbor that applies what that neighbor asks for.

torch.distributed has no one-sided operations, so each rank runs a small service. For each peer ``p``
(a rank that is an in- or out-neighbor of this rank in some window's static topology) a receiver thread
waits on a point-to-point receive of a request header from ``p`` (tag 0) on the window process group,
reads the payload that follows it (tag 1), and applies the request to this rank's window: PUT
(overwrite the buffer kept for ``p``), ACCUMULATE (add to it), GET (answer with this rank's registered
tensor), LOCK/UNLOCK (the window's distributed mutex, :mod:`lowband.decentral.mutex`) or STOP. Every
request is answered on a reply tag the requester posted a receive for before sending: a status, and for
GET the data. So a request is complete, on the requester's side, once it has been *applied* at the
destination; the destination's main thread takes no part in it.

Why one receive per peer and not ``recv_anysource``: in torch 2.13's gloo an any-source receive is not
woken when a peer dies or closes its process group, and a timed-out gloo wait closes every connection of
the process group. A receive from a given peer fails at once when that peer dies or shuts down, so
receivers wait without a timeout and still end when their peer goes; everything else waits bounded by
the runtime timeout. One process group carries the traffic of all windows of a group; one receiver per
peer keeps each pair's requests in order (per-pair FIFO).

Teardown: ``win_free`` of a group's last window sends STOP to every peer after its barrier, and the
receivers exit. A thread rank's ``lowband.shutdown`` closes the process group, which ends the peers'
receivers for it. In a process whose windows were never freed an ``atexit`` hook sends STOP to every peer
and waits briefly for its own receivers (a thread still blocked in gloo at interpreter exit aborts the
process); call ``win_free`` before exiting.

Wire format: a request header is ``int64[6] = [kind, window id, flags, reply tag, numel, dtype code]``;
window ids are given in creation order (creation is collective, so they agree across ranks).
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]
from torch.distributed.distributed_c10d import _get_default_store

from lowband.comm.handle import Handle, comm_error
from lowband.comm.validate import CODE_DTYPES, DTYPE_CODES
from lowband.errors import CommFailedError, CommTimeoutError, InvalidArgumentError, LowbandError
from lowband.group import Group
from lowband.runtime import Context, current
from lowband.topology import Topology

if TYPE_CHECKING:  # mutex.py imports this module
    from lowband.decentral.mutex import WindowMutex

STATE_KEY = "lowband.decentral.window"

PUT, ACCUMULATE, GET, LOCK, UNLOCK, STOP = 1, 2, 3, 4, 5, 6
KIND_NAMES = {
    PUT: "win_put",
    ACCUMULATE: "win_accumulate",
    GET: "win_get",
    LOCK: "win_mutex",
    UNLOCK: "win_mutex",
}
F_MUTEX = 1

OK, UNKNOWN, NOT_NEIGHBOR, MISMATCH, NOT_HOLDER = 0, 1, 2, 3, 4
STATUS_TEXT = {
    UNKNOWN: "has no such window (freed, or never created there)",
    NOT_NEIGHBOR: "is not a neighbor of the requesting rank in the window's static topology",
    MISMATCH: "has a window of another dtype or size",
    NOT_HOLDER: "is not held by the requesting rank",
}

HEADER = 6
TAG_HEADER, TAG_PAYLOAD, _TAG_REPLY = 0, 1, 2
_TAG_SPAN = 1 << 29
#: receivers wait for their peer's next request without a timeout (see the module docstring)
_IDLE = datetime.timedelta(days=3650)


@dataclass(eq=False)
class WindowRecord:
    """One window on one rank: the caller's tensor, one buffer per in-neighbor, their versions."""

    name: str
    wid: int
    tensor: torch.Tensor
    topology: Topology
    me: int
    in_nbrs: tuple[int, ...]
    out_nbrs: tuple[int, ...]
    buffers: dict[int, torch.Tensor]
    versions: dict[int, int]
    mutex: WindowMutex
    #: guards ``buffers``, ``versions`` and the registered tensor's content against concurrent appliers
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: ranks whose mutex of this window this rank holds (inside ``win_mutex``)
    held: set[int] = field(default_factory=set)

    @property
    def data(self) -> torch.Tensor:
        return self.tensor.detach()

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.in_nbrs) | set(self.out_nbrs)))


def open_channel(ctx: Context, g: Group) -> Group:
    """A new gloo process group over ``g``'s ranks for window traffic. Only ``g``'s members call it
    (all of them, in the same order). It is made from the rendezvous store directly (the test harness's
    store, else torch's default store), so it is not in torch's group registry and only members take
    part; it is registered with the runtime so that ``lowband.shutdown`` of a thread rank closes it."""
    ranks = list(g.ranks)
    counts: dict[tuple[int, ...], int] = ctx.state.setdefault(STATE_KEY + ".channels", {})
    gen = counts.get(tuple(ranks), 0)
    counts[tuple(ranks)] = gen + 1
    store = ctx.store if ctx.threaded else _get_default_store()
    key = f"lowband/window/{'.'.join(map(str, ranks))}/{gen}"
    pg = dist.ProcessGroupGloo(PrefixStore(key, store), g.rank, g.size, ctx.timeout_td())
    chan = Group(pg, tuple(ranks), g.rank, f"{g.name}/windows")
    ctx._groups.append(chan)
    return chan


class WindowService:
    """One rank's window service for one lowband group (see the module docstring)."""

    def __init__(self, ctx: Context, group: Group, chan: Group | None) -> None:
        # (no reference to ``ctx``: the context holds this service in ``ctx.state``)
        self.rank = ctx.rank
        self.timeout = ctx.config.timeout
        self.group = group
        self.chan = chan
        self.windows: dict[int, WindowRecord] = {}
        self.next_wid = 0
        self.error: LowbandError | None = None
        self.pending: list[Handle[Any]] = []
        self.receivers: dict[int, threading.Thread] = {}
        self.stopping = False
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._tags = itertools.count()
        self._td = ctx.timeout_td()

    # -- errors ---------------------------------------------------------------------------------

    def fail(self, exc: LowbandError) -> None:
        """Record a service failure; it is raised by this rank's next window call (and every later one)."""
        with self._lock:
            if self.error is None:
                self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    # -- windows and peers (main thread) --------------------------------------------------------

    def register(self, rec: WindowRecord) -> None:
        with self._lock:
            self.windows[rec.wid] = rec

    def drop(self, wid: int) -> None:
        with self._lock:
            self.windows.pop(wid, None)

    def start_receivers(self, peers: tuple[int, ...]) -> None:
        """Start a receiver thread for each of ``peers`` that has none yet."""
        if self.chan is None:
            return
        self.stopping = False
        for p in peers:
            if p not in self.receivers:
                t = threading.Thread(
                    target=self._loop, args=(p,), name=f"lowband-win-r{self.rank}-from{p}", daemon=True
                )
                self.receivers[p] = t
                t.start()

    def track(self, h: Handle[Any]) -> None:
        self.pending = [x for x in self.pending if not x.done()]
        self.pending.append(h)

    def wait_pending(self) -> None:
        pending, self.pending = self.pending, []
        for h in pending:
            h.wait()

    def stop(self, where: str) -> None:
        """Send STOP to every peer and join this rank's receivers (after the collective barrier of
        ``win_free``, when no request can be in flight)."""
        if self.chan is None or not self.receivers:
            return
        for w in self._send_stops():
            self.wait_work(w, where)
        for p, t in self.receivers.items():
            t.join(self.timeout)
            if t.is_alive():
                raise CommTimeoutError(
                    f"{where}: the receiver for rank {p} did not stop within {self.timeout:g} s"
                )
        self.receivers.clear()

    def _send_stops(self) -> list[Any]:
        assert self.chan is not None
        self.stopping = True
        with self._send_lock:
            return [
                self.chan.pg.send([torch.tensor([STOP, -1, 0, 0, 0, 0], dtype=torch.int64)], p, TAG_HEADER)
                for p in sorted(self.receivers)
            ]

    def close_at_exit(self, budget: float = 2.0) -> None:
        """Best effort at interpreter exit when windows were not freed: tell every peer to stop its
        receiver for this rank and give this rank's receivers ``budget`` seconds to be told the same
        (a thread still blocked in gloo at exit aborts the process)."""
        if self.chan is None or not self.receivers:
            return
        try:
            works = self._send_stops()
        except RuntimeError:
            works = []
        for w in works:
            try:
                w.wait(datetime.timedelta(seconds=budget))
            except RuntimeError:
                pass  # that peer is gone already
        for t in self.receivers.values():
            t.join(budget)

    # -- requests (the requesting side) ---------------------------------------------------------

    def request(
        self,
        dst: int,
        kind: int,
        wid: int,
        *,
        mutexed: bool = False,
        payload: torch.Tensor | None = None,
        numel: int = 0,
        dtype: torch.dtype = torch.float32,
        reply: torch.Tensor | None = None,
    ) -> tuple[list[Any], torch.Tensor]:
        """Post the reply receive(s) then send one request to ``dst``; returns the works and the status
        tensor (valid once the works are complete). ``reply`` receives GET's data."""
        assert self.chan is not None
        pg = self.chan.pg
        tag = _TAG_REPLY + 2 * (next(self._tags) % _TAG_SPAN)
        status = torch.full((1,), -1, dtype=torch.int64)
        works: list[Any] = [pg.recv([status], dst, tag)]
        if reply is not None and reply.numel():
            works.append(pg.recv([reply], dst, tag + 1))
        flags = F_MUTEX if mutexed else 0
        hdr = torch.tensor([kind, wid, flags, tag, numel, DTYPE_CODES[dtype]], dtype=torch.int64)
        with self._send_lock:  # a header and its payload leave back to back
            works.append(pg.send([hdr], dst, TAG_HEADER))
            if payload is not None and payload.numel():
                works.append(pg.send([payload], dst, TAG_PAYLOAD))
        return works, status

    def wait_work(self, work: Any, where: str) -> None:
        try:
            work.wait(self._td)
        except RuntimeError as exc:
            raise comm_error(where, exc, self.timeout) from exc

    # -- the serving side (receiver threads) ----------------------------------------------------

    def _loop(self, src: int) -> None:
        assert self.chan is not None
        pg = self.chan.pg
        where = f"lowband window service on rank {self.rank}"
        while True:
            hdr = torch.empty(HEADER, dtype=torch.int64)
            try:
                pg.recv([hdr], src, TAG_HEADER).wait(_IDLE)
            except RuntimeError as exc:
                if not self.stopping:
                    self.fail(CommFailedError(f"{where}: lost rank {src} (it may have died): {exc}"))
                return
            vals = [int(v) for v in hdr.tolist()]
            if vals[0] == STOP:
                return
            try:
                self._serve(src, vals)
            except LowbandError as exc:
                self.fail(exc)
                return
            except Exception as exc:
                self.fail(CommFailedError(f"{where}: serving a request from rank {src} failed: {exc!r}"))
                return

    def _recv(self, t: torch.Tensor, src: int, tag: int, where: str) -> None:
        assert self.chan is not None
        self.wait_work(self.chan.pg.recv([t], src, tag), where)

    def _serve(self, src: int, vals: list[int]) -> None:
        kind, wid, flags, tag, numel, code = vals
        where = f"lowband window service on rank {self.rank} ({KIND_NAMES.get(kind, '?')} from rank {src})"
        dtype = CODE_DTYPES.get(code)
        if kind not in KIND_NAMES or dtype is None or numel < 0:
            raise CommFailedError(f"{where}: malformed request header {vals}")
        payload: torch.Tensor | None = None
        if kind in (PUT, ACCUMULATE):
            payload = torch.empty(numel, dtype=dtype)
            if numel:
                self._recv(payload, src, TAG_PAYLOAD, where)
        with self._lock:
            rec = self.windows.get(wid)
        status = _vet(rec, src, kind, numel, dtype)
        if rec is None or status != OK:
            self._reply(src, tag, status, torch.zeros(numel, dtype=dtype) if kind == GET else None)
            return
        mutexed = bool(flags & F_MUTEX)
        if payload is not None:
            pl = payload
            add = kind == ACCUMULATE
            rec.mutex.submit(
                src, lambda: self._guard(src, lambda: self._apply(rec, src, pl, add, tag)), mutexed=mutexed
            )
        elif kind == GET:
            rec.mutex.submit(
                src, lambda: self._guard(src, lambda: self._answer_get(rec, src, tag)), mutexed=mutexed
            )
        elif kind == LOCK:
            rec.mutex.request(src, lambda: self._guard(src, lambda: self._reply(src, tag, OK)))
        else:
            self._reply(src, tag, OK if rec.mutex.unlock(src) else NOT_HOLDER)

    def _guard(self, src: int, fn: Callable[[], None]) -> None:
        """Run a (possibly deferred) action; record its failure instead of raising it into the thread
        that happened to run it."""
        try:
            fn()
        except LowbandError as exc:
            self.fail(exc)
        except Exception as exc:
            self.fail(
                CommFailedError(
                    f"lowband window service on rank {self.rank}: a request from rank {src} failed: {exc!r}"
                )
            )

    def _apply(self, rec: WindowRecord, src: int, payload: torch.Tensor, add: bool, tag: int) -> None:
        with rec.lock:
            buf = rec.buffers[src]
            val = payload.view(buf.shape)
            buf.add_(val) if add else buf.copy_(val)
            rec.versions[src] += 1
        self._reply(src, tag, OK)

    def _answer_get(self, rec: WindowRecord, src: int, tag: int) -> None:
        with rec.lock:
            snap = rec.data.clone(memory_format=torch.contiguous_format).view(-1)
        self._reply(src, tag, OK, snap)

    def _reply(self, dst: int, tag: int, status: int, data: torch.Tensor | None = None) -> None:
        assert self.chan is not None
        pg = self.chan.pg
        where = f"lowband window service on rank {self.rank} (reply to rank {dst})"
        works = [pg.send([torch.tensor([status], dtype=torch.int64)], dst, tag)]
        if data is not None and data.numel():
            works.append(pg.send([data], dst, tag + 1))
        for w in works:
            self.wait_work(w, where)


def _vet(rec: WindowRecord | None, src: int, kind: int, numel: int, dtype: torch.dtype) -> int:
    if rec is None:
        return UNKNOWN
    if kind in (PUT, ACCUMULATE, GET) and (numel != rec.data.numel() or dtype != rec.data.dtype):
        return MISMATCH
    allowed = {PUT: rec.in_nbrs, ACCUMULATE: rec.in_nbrs, GET: rec.out_nbrs}.get(kind, rec.peers)
    return OK if src in allowed else NOT_NEIGHBOR


@dataclass
class WindowRegistry:
    """This rank's windows: the service of each group (keyed by its process group, held so that its id
    cannot be reused) and every window by name."""

    services: dict[int, tuple[Any, WindowService]] = field(default_factory=dict)
    by_name: dict[str, tuple[WindowService, WindowRecord]] = field(default_factory=dict)


def registry(ctx: Context) -> WindowRegistry:
    reg = ctx.state.get(STATE_KEY)
    if reg is None:
        reg = WindowRegistry()
        ctx.state[STATE_KEY] = reg
    assert isinstance(reg, WindowRegistry)
    return reg


def service_for(ctx: Context, g: Group) -> WindowService:
    """The service of group ``g`` on this rank, opening its process group on first use (collective
    over ``g``: called from ``win_create``)."""
    reg = registry(ctx)
    entry = reg.services.get(id(g.pg))
    if entry is None:
        chan = open_channel(ctx, g) if g.size > 1 else None
        svc = WindowService(ctx, g, chan)
        if chan is not None and not ctx.threaded:
            atexit.register(_close_at_exit, weakref.ref(svc))
        entry = (g.pg, svc)
        reg.services[id(g.pg)] = entry
    return entry[1]


def _close_at_exit(ref: weakref.ref[WindowService]) -> None:
    svc = ref()
    if svc is not None:
        svc.close_at_exit()


# ---------------------------------------------------------------- helpers of the window API


def where(op: str, ctx: Context, name: object = None) -> str:
    return f"lowband.{op}" + (f" {name!r}" if name is not None else "") + f" on rank {ctx.rank}"


def lookup(op: str, name: object) -> tuple[Context, WindowService, WindowRecord]:
    """This rank's window ``name`` and its service; raises the service's recorded failure, if any."""
    ctx = current(op)
    if not isinstance(name, str):
        raise InvalidArgumentError(f"{where(op, ctx)}: name must be a str, got {type(name).__name__}")
    entry = registry(ctx).by_name.get(name)
    if entry is None:
        known = list(registry(ctx).by_name)
        raise InvalidArgumentError(
            f"{where(op, ctx)}: no window named {name!r} (windows on this rank: {known}); create it with win_create"
        )
    entry[0].check()
    return ctx, entry[0], entry[1]


def check_flag(at: str, what: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise InvalidArgumentError(f"{at}: {what} must be a bool, got {v!r}")
    return v


def check_neighbors(at: str, what: str, ranks: list[int], allowed: tuple[int, ...], kind: str) -> None:
    """Every rank of ``ranks`` is in ``allowed`` (the window topology's ``kind`` s of this rank)."""
    bad = [r for r in ranks if r not in allowed]
    if bad:
        raise InvalidArgumentError(
            f"{at}: {what} lists rank {bad[0]}, which is not an {kind} of this rank in the window's "
            f"static topology ({kind}s: {list(allowed)})"
        )


def check_statuses(at: str, what: str, peers: list[int], statuses: list[torch.Tensor], g: Group) -> None:
    """Raise :class:`CommFailedError` for the first peer that answered a request with an error status."""
    for p, s in zip(peers, statuses):
        code = int(s.item())
        if code != OK:
            text = STATUS_TEXT.get(code, f"answered status {code}")
            raise CommFailedError(f"{at}: rank {g.ranks[p]} rejected the {what}: its window {text}")
