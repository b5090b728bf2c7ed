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

The wire format and the checks of a request are :mod:`lowband.decentral.window_protocol`; every
message goes through :class:`lowband.comm.batch.Channel` (bounded, traced: a rank's requests under the
window op's name, the data its service receives or answers under ``window_service``).
"""

from __future__ import annotations

import atexit
import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lowband.comm.batch import Channel, P2POp, recv_op, send_op
from lowband.comm.handle import Handle
from lowband.decentral import window_protocol as wp
from lowband.decentral.window_protocol import ACCUMULATE, GET, LOCK, OK, PUT, Request
from lowband.errors import CommFailedError, CommTimeoutError, InvalidArgumentError, LowbandError
from lowband.group import Group
from lowband.runtime import Context, current, open_member_group
from lowband.topology import Topology

if TYPE_CHECKING:  # mutex.py imports this module
    from lowband.decentral.mutex import WindowMutex

STATE_KEY = "lowband.decentral.window"


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


def open_channel(ctx: Context, g: Group) -> Channel:
    """The channel of a new gloo process group over ``g``'s ranks for window traffic
    (:func:`lowband.runtime.open_member_group`). Only ``g``'s members call it, all of them, in the same
    order."""
    ranks = tuple(g.ranks)
    counts: dict[tuple[int, ...], int] = ctx.state.setdefault(STATE_KEY + ".channels", {})
    gen = counts.get(ranks, 0)
    counts[ranks] = gen + 1
    key = f"lowband/window/{'.'.join(map(str, ranks))}/{gen}"
    chan = open_member_group(ctx, g, key, f"{g.name}/windows")
    return Channel(chan, ctx.rank, ctx.config.timeout, ctx.tracer)


class WindowService:
    """One rank's window service for one lowband group (see the module docstring)."""

    def __init__(self, ctx: Context, group: Group, channel: Channel) -> None:
        # (no reference to ``ctx``: the context holds this service in ``ctx.state``)
        self.rank = ctx.rank
        self.timeout = ctx.config.timeout
        self.group = group
        self.channel = channel
        self.windows: dict[int, WindowRecord] = {}
        self.next_wid = 0
        self.error: LowbandError | None = None
        self.pending: list[Handle[Any]] = []
        self.receivers: dict[int, threading.Thread] = {}
        self.stopping = False
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._tags = itertools.count()

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
        if not self.receivers:
            return
        self.stopping = True
        with self._send_lock:
            self.channel.batch("win_free", self._stop_ops(sorted(self.receivers)), trace=False)
        for p, t in self.receivers.items():
            t.join(self.timeout)
            if t.is_alive():
                raise CommTimeoutError(
                    f"{where}: the receiver for rank {p} did not stop within {self.timeout:g} s"
                )
        self.receivers.clear()

    @staticmethod
    def _stop_ops(peers: list[int]) -> list[P2POp]:
        return [send_op(wp.stop_header(), p, wp.TAG_HEADER, control=True) for p in peers]

    def close_at_exit(self, budget: float = 2.0) -> None:
        """Best effort at interpreter exit when windows were not freed: tell every peer to stop its
        receiver for this rank and give this rank's receivers ``budget`` seconds to be told the same
        (a thread still blocked in gloo at exit aborts the process)."""
        if not self.receivers:
            return
        self.stopping = True
        for p in sorted(self.receivers):
            try:
                with self._send_lock:
                    self.channel.batch("win_free", self._stop_ops([p]), timeout=budget, trace=False)
            except LowbandError:
                pass  # that peer is gone already
        for t in self.receivers.values():
            t.join(budget)

    # -- requests (the requesting side) ---------------------------------------------------------

    def next_tag(self) -> int:
        return wp.TAG_REPLY + 2 * (next(self._tags) % wp.TAG_SPAN)

    def post(
        self, op: str, ops: list[P2POp], finish: Callable[[], bool], name: str | None = None
    ) -> Handle[bool]:
        """Post the messages of requests (built by :func:`window_protocol.request_ops`) as one traced
        op; a request's header and payload leave back to back."""
        with self._send_lock:
            return self.channel.ibatch(op, ops, finish, name=name)

    # -- the serving side (receiver threads) ----------------------------------------------------

    def _loop(self, src: int) -> None:
        where = f"lowband window service on rank {self.rank}"
        while True:
            hdr = torch.empty(wp.HEADER, dtype=torch.int64, device="cpu")
            try:
                self.channel.batch(
                    "window_service",
                    [recv_op(hdr, src, wp.TAG_HEADER, control=True)],
                    timeout=wp.IDLE_SECONDS,
                    trace=False,
                )
            except LowbandError as exc:
                if not self.stopping:
                    self.fail(CommFailedError(f"{where}: lost rank {src} (it may have died): {exc}"))
                return
            vals = [int(v) for v in hdr.tolist()]
            if vals[0] == wp.STOP:
                return
            try:
                self._serve(src, vals)
            except LowbandError as exc:
                self.fail(exc)
                return
            except Exception as exc:
                self.fail(CommFailedError(f"{where}: serving a request from rank {src} failed: {exc!r}"))
                return

    def _serve(self, src: int, vals: list[int]) -> None:
        where = (
            f"lowband window service on rank {self.rank} ({wp.KIND_NAMES.get(vals[0], '?')} from rank {src})"
        )
        req = wp.decode(where, vals)
        with self._lock:
            rec = self.windows.get(req.wid)
            sizes = [r.data.numel() * r.data.element_size() for r in self.windows.values()]
        # at most the window's size (the largest window's, for an unknown one) is ever allocated
        limit = max(sizes, default=0) if rec is None else rec.data.numel() * rec.data.element_size()
        status = wp.vet(rec, src, req)
        payload: torch.Tensor | None = None
        if req.kind in (PUT, ACCUMULATE) and req.numel:
            if status == OK or req.nbytes <= limit:
                # within the window's size: received (and dropped if refused) so the pair stays in order
                payload = torch.empty(req.numel, dtype=req.dtype, device="cpu")  # host staging
                self.channel_recv(payload, src, wp.TAG_PAYLOAD, where)
            else:
                held = (
                    "no such window"
                    if rec is None
                    else f"a window of {rec.data.numel()} {rec.data.dtype} elements"
                )
                exc = CommFailedError(
                    f"{where}: rank {src} declared a payload of {req.numel} {req.dtype} elements "
                    f"({req.nbytes} bytes) for window id {req.wid}, but this rank has {held}; refused "
                    f"without receiving it, and this rank serves rank {src} no longer"
                )
                self.fail(exc)  # recorded before the answer: the requester may ask this rank next
                self._reply(src, req.tag, status)
                raise exc
        if rec is None or status != OK:
            self._reply(src, req.tag, status)  # a refused GET gets no data (its requester stops waiting)
            return
        self._dispatch(rec, src, req, payload)

    def _dispatch(self, rec: WindowRecord, src: int, req: Request, payload: torch.Tensor | None) -> None:
        tag = req.tag
        if req.kind in (PUT, ACCUMULATE):
            pl = torch.empty(0, dtype=req.dtype, device="cpu") if payload is None else payload
            add = req.kind == ACCUMULATE
            rec.mutex.submit(
                src,
                lambda: self._guard(src, lambda: self._apply(rec, src, pl, add, tag)),
                mutexed=req.mutexed,
            )
        elif req.kind == GET:
            rec.mutex.submit(
                src, lambda: self._guard(src, lambda: self._answer_get(rec, src, tag)), mutexed=req.mutexed
            )
        elif req.kind == LOCK:
            rec.mutex.request(src, lambda: self._guard(src, lambda: self._reply(src, tag, OK)))
        else:
            self._reply(src, tag, OK if rec.mutex.unlock(src) else wp.NOT_HOLDER)

    def channel_recv(self, t: torch.Tensor, src: int, tag: int, where: str) -> None:
        self.channel.batch("window_service", [recv_op(t, src, tag)], name=where)

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
            val = payload.view(buf.shape).to(buf.device)  # staged on the host (a GPU window)
            buf.add_(val) if add else buf.copy_(val)
            rec.versions[src] += 1
        self._reply(src, tag, OK)

    def _answer_get(self, rec: WindowRecord, src: int, tag: int) -> None:
        with rec.lock:
            snap = rec.data.clone(memory_format=torch.contiguous_format).view(-1).to("cpu")
        self._reply(src, tag, OK, snap)

    def _reply(self, dst: int, tag: int, status: int, data: torch.Tensor | None = None) -> None:
        ops = [send_op(torch.tensor([status], dtype=torch.int64, device="cpu"), dst, tag, control=True)]
        if data is not None and data.numel():
            ops.append(send_op(data, dst, tag + 1))
        self.channel.batch("window_service", ops, name=f"reply to rank {dst}", trace=len(ops) > 1)


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
        # a group of one has nobody to ask: its channel is the group itself, never posted on
        channel = open_channel(ctx, g) if g.size > 1 else Channel(g, ctx.rank, ctx.config.timeout, ctx.tracer)
        svc = WindowService(ctx, g, channel)
        if g.size > 1 and not ctx.threaded:
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
