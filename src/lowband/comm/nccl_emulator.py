"""An NCCL-semantics emulator for CPU CI: a Python ``ProcessGroup`` over gloo that enforces NCCL's contract.

gloo forgives what NCCL (torch 2.13's ``ProcessGroupNCCL``) does not. :class:`NcclEmulator` wraps a gloo
process group, forwards every op to it, and raises :class:`NcclContractError` (naming the rule and the
op) where the same program would hang, abort or read unfinished data on NCCL. The rules, each a function
below citing the torch source it encodes:

- :func:`rule_timed_wait` -- a timed ``wait`` that expires aborts the group; every later op raises.
- :func:`rule_future_at_enqueue` -- ``get_future()`` is complete when it returns.
- :func:`rule_pair_stream` -- unbatched send/recv of a pair share one stream: both ranks' k-th unbatched
  op on the pair being sends (or receives) is a deadlock.
- :func:`rule_tags_ignored` -- messages of a direction match by order; a receive whose tag (or size)
  differs from the send it meets by order raises.
- :func:`rule_one_thread` -- a collective issued while another thread's collective is in flight raises.

The cross-rank rules meet through the rendezvous store (one ``compare_set`` per point-to-point op: the
rank posting second sees its peer's op and raises); a violation found on one rank is written to the
store and the gloo group aborted, so the peers' ops fail too and report the same rule.

Every op issued on the group is logged (:attr:`NcclEmulator.log`), so a test can assert that only data
goes there (headers, sizes, masks and signatures belong on the control group). Switched on by
``run_threads(..., emulate_nccl=True)`` or, in processes, by ``LOWBAND_EMULATE_NCCL=1`` with
:func:`register_backend` (``init_process_group("nccl_emu")`` makes it torch's default group).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]

from lowband.errors import LowbandError

BACKEND = "nccl_emu"
ENV = "LOWBAND_EMULATE_NCCL"
#: the key of :attr:`lowband.runtime.Context.state` telling group makers to emulate NCCL
STATE_KEY = "lowband.comm.nccl_emulator"
_NO_TIMEOUT = datetime.timedelta(0)
_c10d: Any = dist.distributed_c10d
_ABORTED = "aborted"


class NcclContractError(LowbandError):
    """A use of a process group that NCCL (torch 2.13) would not survive, caught on gloo."""


@dataclass(frozen=True)
class OpRecord:
    """One op issued on an emulated group, as a test reads it."""

    op: str
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int
    thread: str
    peer: int | None = None
    tag: int | None = None
    batched: bool = False


def enabled_from_env() -> bool:
    """Whether ``LOWBAND_EMULATE_NCCL=1`` is set in this process's environment."""
    return os.environ.get(ENV, "") == "1"


def rule_timed_wait(emu: NcclEmulator, op: str, timeout: datetime.timedelta) -> NcclContractError:
    """A timed ``wait`` that expires aborts the communicator.

    torch 2.13 ProcessGroupNCCL.cpp ``WorkNCCL::wait(timeout)`` -> ``WorkNCCL::synchronizeInternal``:
    with a timeout it polls ``isCompleted`` and, past the deadline, ``checkTimeout`` marks the work failed
    and the group is aborted (``ProcessGroupNCCL::abort``); gloo's ``wait(timeout)`` only raises and the
    op goes on. Polling an NCCL work with short timed waits therefore kills the group: poll
    ``is_completed()`` against your own deadline instead.
    """
    ms = timeout.total_seconds() * 1e3
    return emu.violate(
        f"timed wait: {op} did not finish within wait(timeout={ms:g} ms); on NCCL an expired timed wait "
        "aborts the communicator (WorkNCCL::wait), so the group is now unusable; poll is_completed() "
        "against your own deadline instead"
    )


def rule_future_at_enqueue(work: EmulatedWork) -> torch.futures.Future[Any]:
    """``get_future()`` returns a future that is already complete.

    torch 2.13 ProcessGroupNCCL.cpp ``ProcessGroupNCCL::collective`` / ``pointToPoint`` mark
    ``work->future_`` completed with the outputs right after the kernel is *enqueued*
    (``WorkNCCL::getFuture`` returns it); the data is ordered for consumers only through CUDA stream
    synchronisation (``Future::wait``/``then`` make the current stream wait on the work's events).

    Emulated deterministically: the future is complete when ``get_future`` returns, so ``done()`` is
    True at once and ``then`` callbacks run inline on the issuing thread, never later on a communication
    thread (code that uses a future's completion as "the transfer finished, the peer has my data" or
    that expects its callback on another thread breaks here as it does on NCCL). A CPU has no streams to
    order the consumer with, so the emulator finishes the transfer before completing the future: reads
    through the future see the data, as CUDA-synchronised reads do.
    """
    work.wait()
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(work.outputs)
    return fut


def rule_pair_stream(emu: NcclEmulator, op: str, peer: int, send: bool) -> None:
    """Unbatched send and recv of one pair share one stream, in issue order.

    torch 2.13 ProcessGroupNCCL.cpp ``ProcessGroupNCCL::pointToPoint``: the communicator and stream of a
    point-to-point op are keyed by ``getKeySendRecv(rank, peer)`` ("low:high"), the same for both
    directions, so a rank's unbatched sends and receives to one peer run one after another (and
    ``WorkNCCL::wait`` does not block the host: issuing a receive after a waited send still queues it
    behind that send). If both ranks' k-th unbatched op on the pair is a send (or a receive), each waits
    for the other's matching op queued behind it: a deadlock. gloo runs both directions at once.
    ``batch_isend_irecv`` (or ``_start_coalescing``/``_end_coalescing``) groups them and is exempt.
    """
    me = emu.rank()
    lo, hi = min(me, peer), max(me, peer)
    k = emu.count(f"pair/{lo}-{hi}")
    kind = "send" if send else "recv"
    theirs = emu.meet(f"pair/{lo}-{hi}/{k}", f"{me}:{kind}")
    if theirs is not None and theirs.split(":")[1] == kind:
        raise emu.violate(
            f"pair stream: {op} is the unbatched op #{k} between ranks {lo} and {hi} and both ranks' "
            f"op #{k} is a {kind}; NCCL runs a pair's unbatched sends and receives on one stream in issue "
            "order (ProcessGroupNCCL::pointToPoint), so this deadlocks: post both directions in one "
            "batch_isend_irecv"
        )


def rule_tags_ignored(emu: NcclEmulator, op: str, src: int, dst: int, tag: int, t: torch.Tensor) -> None:
    """NCCL ignores tags: the m-th send from ``src`` to ``dst`` meets the m-th receive there.

    torch 2.13 ProcessGroupNCCL.cpp ``ProcessGroupNCCL::send(tensors, dstRank, int /* unused */)`` and
    ``recv`` drop the tag; messages of a direction match by order. A receive that only its tag could
    match to the right send (or whose size or dtype differs from the send it meets by order) gets
    another message's bytes on NCCL; gloo matches by tag and hides it.
    """
    m = emu.count(f"dir/{src}>{dst}")
    mine = f"{emu.rank()}:{tag}:{t.numel()}:{t.dtype}"
    theirs = emu.meet(f"dir/{src}>{dst}/{m}", mine)
    if theirs is not None and theirs.split(":", 1)[1] != mine.split(":", 1)[1]:
        _, ttag, tn, tdt = theirs.split(":")
        raise emu.violate(
            f"tags ignored: {op} is message #{m} from rank {src} to rank {dst} (tag {tag}, {t.numel()} x "
            f"{t.dtype}); the peer's message #{m} has tag {ttag}, {tn} x {tdt}; NCCL ignores tags "
            "(ProcessGroupNCCL::send/recv) and matches a direction's messages by order"
        )


def rule_one_thread(emu: NcclEmulator, op: str) -> None:
    """Collectives on one group come from one thread at a time.

    torch 2.13 ProcessGroupNCCL.hpp (class comment): "All functions of the class are expected to be
    called in the same order across all processes in the process group"; ``ProcessGroupNCCL::collective``
    enqueues on the group's one stream in call order (``seqCollective_``). Two threads issuing on one
    group race for that order, which then differs between ranks: a deadlock or mismatched data.
    """
    me = threading.get_ident()
    with emu.lock:
        emu.inflight = [w for w in emu.inflight if not (w.waited or w.inner.is_completed())]
        other = next((w for w in emu.inflight if w.thread != me), None)
    if other is not None:
        raise emu.violate(
            f"one thread: {op} issued on thread {threading.current_thread().name!r} while {other.op} "
            f"issued on thread {other.thread_name!r} is in flight; NCCL orders a group's collectives by "
            "call order (ProcessGroupNCCL::collective), so two issuing threads race"
        )


class EmulatedWork(dist.Work):
    """A gloo work behind NCCL's ``Work`` contract (timed waits abort, futures complete at enqueue)."""

    def __init__(self, emu: NcclEmulator, inner: Any, op: str, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.emu, self.inner, self.op, self.outputs = emu, inner, op, outputs
        self.thread, self.thread_name = threading.get_ident(), threading.current_thread().name
        self.waited = False
        self.failure: RuntimeError | None = None

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        emu = self.emu
        emu.check_usable(self.op)
        timed = timeout != _NO_TIMEOUT
        start = time.monotonic()
        limit = timeout.total_seconds() if timed else emu.timeout
        # Polled (host-side, CPU emulation only) so that a violation a peer found, which aborts the group
        # through the store, ends this wait at once instead of at gloo's timeout. gloo's point-to-point
        # works complete only inside wait(), so those are polled with short gloo waits (which gloo allows).
        if self.failure is not None:
            emu.check_usable(self.op)
            raise self.failure
        done = self.waited
        while not done and not (done := self._done(limit - (time.monotonic() - start))):
            if time.monotonic() - start >= limit:
                if timed:
                    raise rule_timed_wait(emu, self.op, timeout)
                break  # gloo's own wait reports its timeout
            emu.check_usable(self.op)
        try:
            if not done:  # a gloo send/recv must not be waited twice
                self.inner.wait()
        except RuntimeError:
            emu.check_usable(self.op)  # a peer's violation aborted the group: report that rule
            raise
        self.waited = True
        return True

    def _done(self, left: float) -> bool:
        """Whether the gloo work finished, waiting at most ~50 ms (some gloo works, such as send, recv and
        reduce_scatter, complete only inside wait(); a gloo timed wait that expires leaves them going)."""
        if self.inner.is_completed():
            if not self.inner.is_success():
                self.inner.wait()  # a failed work: raise its error (never swallow it)
            return True
        try:
            self.inner.wait(datetime.timedelta(seconds=min(0.05, max(left, 0.001))))
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
            return False
        return True

    def is_completed(self) -> bool:
        """NCCL reports a work complete without a wait (``WorkNCCL::isCompleted`` queries its CUDA
        events); gloo's point-to-point works complete only inside ``wait``, so a short gloo wait (which
        gloo allows) observes them here. A failure reads as completed; ``wait`` raises it."""
        if self.waited or self.inner.is_completed():
            return True
        try:
            self.waited = self._done(0.0)
        except RuntimeError as exc:
            self.failure = exc
            return True
        return self.waited

    def get_future(self) -> torch.futures.Future[Any]:
        return rule_future_at_enqueue(self)


class _Batch(dist.Work):
    """The work ``_end_coalescing`` returns: every op of the batch."""

    def __init__(self, works: list[EmulatedWork]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        return all(w.wait(timeout) for w in self.works)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _in_torch_batch() -> bool:
    """Whether the caller is inside ``torch.distributed.batch_isend_irecv``: for a Python process group
    torch 2.13 (distributed_c10d.py ``batch_isend_irecv``: ``type(group) is ProcessGroup``) skips the
    coalescing calls and posts each op alone, so the batch is recognised by its frame."""
    f: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return False
        if (
            f.f_code.co_name == "batch_isend_irecv"
            and f.f_globals.get("__name__") == dist.distributed_c10d.__name__
        ):
            return True
        f = f.f_back
    return False


def _describe(op: str, tensors: list[torch.Tensor], **kw: Any) -> OpRecord:
    return OpRecord(
        op,
        tuple(str(t.dtype) for t in tensors),
        tuple(tuple(t.shape) for t in tensors),
        sum(t.numel() * t.element_size() for t in tensors),
        threading.current_thread().name,
        **kw,
    )


class NcclEmulator(dist.ProcessGroup):
    """A gloo process group behind NCCL's contract (torch 2.13). ``store`` is where the ranks of this
    group meet for the cross-rank rules (a prefix of its own, alike on every member)."""

    def __init__(
        self, inner: Any, store: Any, rank: int, size: int, name: str = "group", timeout: float = 60.0
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's stub lacks this overload
        self.inner, self.store, self.label, self.timeout = inner, store, name, timeout
        self.lock = threading.Lock()
        #: every op issued on this group, in issue order
        self.log: list[OpRecord] = []
        self.inflight: list[EmulatedWork] = []
        self.aborted: str | None = None
        self._counts: dict[str, int] = {}
        self._coalescing = threading.local()

    # -- rule plumbing -------------------------------------------------------------------------------
    def count(self, key: str) -> int:
        """This rank's next sequence number of ``key`` (a pair or a direction)."""
        with self.lock:
            k = self._counts.get(key, 0)
            self._counts[key] = k + 1
        return k

    def meet(self, key: str, mine: str) -> str | None:
        """Leave ``mine`` under ``key``; returns the peer's value if it was there first, else None."""
        got = bytes(self.store.compare_set(key, "", mine)).decode()
        return None if got == mine else got

    def violate(self, msg: str) -> NcclContractError:
        """Mark the group unusable (here and, through the store, on its peers) and return the error."""
        with self.lock:
            first = self.aborted is None
            if first:
                self.aborted = msg
        if first:
            self.store.set(_ABORTED, f"rank {self.rank()}: {msg}")
            try:
                self.inner.abort()  # peers' pending gloo ops fail at once instead of at the timeout
            except (RuntimeError, AttributeError):
                pass
        return NcclContractError(f"NCCL emulator, group {self.label!r}, rank {self.rank()}: {msg}")

    def check_usable(self, op: str) -> None:
        msg = self.aborted
        if msg is None and self.store.check([_ABORTED]):
            msg = self.aborted = bytes(self.store.get(_ABORTED)).decode()
        if msg is not None:
            raise NcclContractError(
                f"NCCL emulator, group {self.label!r}, rank {self.rank()}: {op} on a group that is aborted "
                f"(NCCL: every op after ProcessGroupNCCL::abort fails); the first violation: {msg}"
            )

    def _issue(
        self, op: str, tensors: list[torch.Tensor], outputs: list[torch.Tensor], call: Any, **kw: Any
    ) -> EmulatedWork:
        self.check_usable(op)
        collective = "peer" not in kw
        if collective:
            rule_one_thread(self, op)
        rec = _describe(op, tensors, **kw)
        with self.lock:
            self.log.append(rec)
        work = EmulatedWork(self, call(), op, outputs)
        if collective:
            with self.lock:
                self.inflight.append(work)
        batch = getattr(self._coalescing, "works", None)
        if batch is not None:
            batch.append(work)
        return work

    # -- collectives ---------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> EmulatedWork:  # type: ignore[override]
        o = opts if opts is not None else _c10d.AllreduceOptions()
        return self._issue("allreduce", tensors, tensors, lambda: self.inner.allreduce(tensors, o))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        o = opts if opts is not None else _c10d.AllreduceCoalescedOptions()
        return self._issue(
            "allreduce_coalesced", tensors, tensors, lambda: self.inner.allreduce_coalesced(tensors, o)
        )

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> EmulatedWork:  # type: ignore[override]
        o = opts if opts is not None else _c10d.BroadcastOptions()
        return self._issue("broadcast", tensors, tensors, lambda: self.inner.broadcast(tensors, o))

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> EmulatedWork:
        o = opts if opts is not None else _c10d.AllgatherOptions()
        flat = [t for ts in outputs for t in ts]
        return self._issue("allgather", inputs, flat, lambda: self.inner.allgather(outputs, inputs, o))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> EmulatedWork:
        o = opts if opts is not None else _c10d.AllgatherOptions()
        return self._issue(
            "allgather_base", [input], [output], lambda: self.inner._allgather_base(output, input, o)
        )

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> EmulatedWork:
        o = opts if opts is not None else _c10d.ReduceScatterOptions()
        flat = [t for ts in inputs for t in ts]
        return self._issue(
            "reduce_scatter", flat, outputs, lambda: self.inner.reduce_scatter(outputs, inputs, o)
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> EmulatedWork:
        o = opts if opts is not None else _c10d.ReduceScatterOptions()
        return self._issue(
            "reduce_scatter_base",
            [input],
            [output],
            lambda: self.inner._reduce_scatter_base(output, input, o),
        )

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        opts: Any = None,
    ) -> EmulatedWork:
        o = opts if opts is not None else _c10d.AllToAllOptions()
        return self._issue(
            "alltoall_base",
            [input],
            [output],
            lambda: self.inner.alltoall_base(output, input, out_splits, in_splits, o),
        )

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> EmulatedWork:
        o = opts if opts is not None else _c10d.AllToAllOptions()
        return self._issue("alltoall", inputs, outputs, lambda: self.inner.alltoall(outputs, inputs, o))

    def barrier(self, opts: Any = None) -> EmulatedWork:
        o = opts if opts is not None else _c10d.BarrierOptions()
        return self._issue("barrier", [], [], lambda: self.inner.barrier(o))

    # -- point-to-point ------------------------------------------------------------------------------
    def _batched(self) -> bool:
        return getattr(self._coalescing, "works", None) is not None or _in_torch_batch()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> EmulatedWork:
        batched = self._batched()
        if not batched:
            rule_pair_stream(self, "send", dst, send=True)
        rule_tags_ignored(self, f"send to rank {dst}", self.rank(), dst, tag, tensors[0])
        return self._issue(
            "send",
            tensors,
            [],
            lambda: self.inner.send(tensors, dst, tag),
            peer=dst,
            tag=tag,
            batched=batched,
        )

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> EmulatedWork:
        batched = self._batched()
        if not batched:
            rule_pair_stream(self, "recv", src, send=False)
        rule_tags_ignored(self, f"recv from rank {src}", src, self.rank(), tag, tensors[0])
        return self._issue(
            "recv",
            tensors,
            tensors,
            lambda: self.inner.recv(tensors, src, tag),
            peer=src,
            tag=tag,
            batched=batched,
        )

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> EmulatedWork:
        """NCCL has none (ProcessGroupNCCL::recvAnysource throws)."""
        raise NcclContractError(
            f"NCCL emulator, group {self.label!r}, rank {self.rank()}: recv from any source: NCCL has no "
            "such receive (ProcessGroupNCCL::recvAnysource throws); name the source"
        )

    def _start_coalescing(self, device: Any) -> None:
        """ProcessGroupNCCL::startCoalescing: the ops until _end_coalescing are one group (one batch)."""
        self._coalescing.works = []

    def _end_coalescing(self, device: Any) -> _Batch:
        works: list[EmulatedWork] = getattr(self._coalescing, "works", None) or []
        self._coalescing.works = None
        return _Batch(works)

    # -- lifetime ------------------------------------------------------------------------------------
    def abort(self) -> None:
        self.inner.abort()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def ops(self) -> list[OpRecord]:
        """A copy of the op log."""
        with self.lock:
            return list(self.log)


def op_log(pg: Any) -> list[OpRecord]:
    """The ops issued so far on an emulated process group (a lowband Group's ``pg``, or torch's)."""
    if not isinstance(pg, NcclEmulator):
        raise LowbandError(f"lowband.comm.nccl_emulator.op_log: {type(pg).__name__} is not an NcclEmulator")
    return pg.ops()


def emulate(
    inner: Any, store: Any, rank: int, size: int, name: str = "group", timeout: float = 60.0
) -> NcclEmulator:
    """Wrap a gloo process group of ``size`` ranks (this one ``rank``); ``store`` is the members' shared
    rendezvous store, prefixed alike on every member and apart from every other group; ``timeout``
    (seconds) bounds an untimed wait, as the group's timeout does."""
    return NcclEmulator(inner, store, rank, size, name, timeout)


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> NcclEmulator:
    gloo = dist.ProcessGroupGloo(PrefixStore("gloo", store), rank, size, timeout)
    return NcclEmulator(gloo, PrefixStore("emu", store), rank, size, BACKEND, timeout.total_seconds())


def register_backend() -> str:
    """Register the ``nccl_emu`` torch backend (CPU tensors; idempotent) and return its name:
    ``dist.init_process_group("nccl_emu", ...)`` then makes an :class:`NcclEmulator` torch's default group
    (torch 2.13 distributed_c10d.py ``_new_process_group_helper`` uses a creator's ProcessGroup as is)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    return BACKEND


__all__ = [
    "BACKEND", "ENV", "STATE_KEY", "EmulatedWork", "NcclContractError", "NcclEmulator", "OpRecord",
    "emulate", "enabled_from_env", "op_log", "register_backend", "rule_future_at_enqueue",
    "rule_one_thread", "rule_pair_stream", "rule_tags_ignored", "rule_timed_wait",
]  # fmt: skip
