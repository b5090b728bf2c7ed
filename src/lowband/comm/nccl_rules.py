"""The rules of the NCCL-semantics emulator (:mod:`lowband.comm.nccl_emulator`), each citing the torch
2.13 source it encodes, and the works that enforce them (:class:`EmulatedWork`, the coalesced
:class:`_Batch`)."""

from __future__ import annotations

import datetime
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lowband.errors import LowbandError

if TYPE_CHECKING:
    from lowband.comm.nccl_emulator import NcclEmulator

_NO_TIMEOUT = datetime.timedelta(0)


class NcclContractError(LowbandError):
    """A use of a process group that NCCL (torch 2.13) would not survive, caught on gloo."""


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


#: the dtypes ProcessGroupNCCL moves (torch 2.13 ProcessGroupNCCL.cpp ``ncclDataType``: bool travels as
#: uint8; the float8 types are left out, lowband sends none)
NCCL_DTYPES: frozenset[torch.dtype] = frozenset({
    torch.int8, torch.uint8, torch.bool, torch.int32, torch.int64, torch.uint32, torch.uint64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
})  # fmt: skip


def rule_dtypes(emu: NcclEmulator, op: str, tensors: list[torch.Tensor]) -> None:
    """Only the dtypes NCCL has move.

    torch 2.13 ProcessGroupNCCL.cpp ``getNcclDataType``: a dtype missing from the ``ncclDataType`` map
    (int16, uint16, the complex types) raises "Unsupported data type for NCCL process group", where gloo
    moves it. A library that relies on gloo for int16 breaks on NCCL: widen it or send its bytes.
    """
    bad = next((t for t in tensors if t.dtype not in NCCL_DTYPES), None)
    if bad is not None:
        raise emu.violate(
            f"dtype: {op} of a {bad.dtype} tensor; NCCL has no such type (ProcessGroupNCCL getNcclDataType: "
            "'Unsupported data type for NCCL process group'): widen it or send it as bytes"
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

    def __init__(
        self, emu: NcclEmulator, inner: Any, op: str, outputs: list[torch.Tensor], p2p: bool = False
    ) -> None:
        super().__init__()
        self.emu, self.inner, self.op, self.outputs = emu, inner, op, outputs
        self.thread, self.thread_name = threading.get_ident(), threading.current_thread().name
        self.waited = False
        self.failure: RuntimeError | None = None
        # gloo's send/recv complete only inside wait(), and a timed wait that expires closes the pair
        # ("Application timeout caused pair closure", seen 2026-11-27): a waiter thread of the emulator
        # waits for them without a timeout (gloo's own bounds it), and polls read its outcome
        self._p2p: threading.Event | None = None
        if p2p:
            self._p2p = threading.Event()
            threading.Thread(target=self._wait_p2p, name="lowband-emu-p2p", daemon=True).start()

    def _wait_p2p(self) -> None:
        assert self._p2p is not None
        try:
            self.inner.wait()
        except RuntimeError as exc:
            self.failure = exc
        self._p2p.set()

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        emu = self.emu
        emu.check_usable(self.op)
        timed = timeout != _NO_TIMEOUT
        start = time.monotonic()
        limit = timeout.total_seconds() if timed else emu.timeout
        # Polled (host-side, CPU emulation only) so that a violation a peer found, which aborts the group
        # through the store, ends this wait at once instead of at gloo's timeout. gloo's point-to-point
        # works complete only inside wait(): their waiter thread's outcome is polled instead.
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
            if not done and self._p2p is not None:  # the waiter thread holds gloo's wait
                if not self._p2p.wait(emu.timeout):
                    raise RuntimeError(f"{self.op}: timed out after {emu.timeout:g} s")
                if self.failure is not None:
                    raise self.failure
            elif not done:  # a gloo send/recv must not be waited twice
                self.inner.wait()
        except RuntimeError:
            emu.check_usable(self.op)  # a peer's violation aborted the group: report that rule
            raise
        self.waited = True
        return True

    def _done(self, left: float) -> bool:
        """Whether the gloo work finished, waiting at most ~50 ms (some gloo works, such as send, recv and
        reduce_scatter, complete only inside wait(); send and recv are waited by their waiter thread)."""
        if self._p2p is not None:
            if not self._p2p.wait(min(0.05, max(left, 0.0))):
                return False
            if self.failure is not None:
                raise self.failure
            return True
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
        events); gloo's point-to-point works complete only inside ``wait``, so their waiter thread's
        outcome is read here (other gloo works: a short timed wait, which gloo allows for collectives).
        A failure reads as completed; ``wait`` raises it."""
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
