"""An NCCL-semantics emulator for CPU CI: a Python ``ProcessGroup`` over gloo that enforces NCCL's contract.

gloo forgives what NCCL (torch 2.13's ``ProcessGroupNCCL``) does not. :class:`NcclEmulator` wraps a gloo
process group, forwards every op to it, and raises :class:`NcclContractError` (naming the rule and the
op) where the same program would hang, abort or read unfinished data on NCCL. The rules, each a function
in :mod:`lowband.comm.nccl_rules` citing the torch source it encodes:

- :func:`rule_timed_wait` -- a timed ``wait`` that expires aborts the group; every later op raises.
- :func:`rule_future_at_enqueue` -- ``get_future()`` is complete when it returns.
- :func:`rule_pair_stream` -- unbatched send/recv of a pair share one stream: both ranks' k-th unbatched
  op on the pair being sends (or receives) is a deadlock.
- :func:`rule_tags_ignored` -- messages of a direction match by order; a receive whose tag (or size)
  differs from the send it meets by order raises.
- :func:`rule_one_thread` -- a collective issued while another thread's collective is in flight raises.
- :func:`rule_dtypes` -- a tensor of a dtype NCCL lacks (int16) raises.

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
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]

from lowband.comm.nccl_rules import (
    EmulatedWork,
    NcclContractError,
    _Batch,
    _in_torch_batch,
    rule_dtypes,
    rule_future_at_enqueue,
    rule_one_thread,
    rule_pair_stream,
    rule_tags_ignored,
    rule_timed_wait,
)
from lowband.errors import LowbandError

BACKEND = "nccl_emu"
ENV = "LOWBAND_EMULATE_NCCL"
#: the key of :attr:`lowband.runtime.Context.state` telling group makers to emulate NCCL
STATE_KEY = "lowband.comm.nccl_emulator"
_c10d: Any = dist.distributed_c10d
_ABORTED = "aborted"


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
        rule_dtypes(self, op, [*tensors, *outputs])
        collective = "peer" not in kw
        if collective:
            rule_one_thread(self, op)
        rec = _describe(op, tensors, **kw)
        with self.lock:
            self.log.append(rec)
        work = EmulatedWork(self, call(), op, outputs, p2p=not collective)
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
    "emulate", "enabled_from_env", "op_log", "register_backend", "rule_dtypes", "rule_future_at_enqueue",
    "rule_one_thread", "rule_pair_stream", "rule_tags_ignored", "rule_timed_wait",
]  # fmt: skip
