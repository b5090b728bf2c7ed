"""The heartbeat's side of the ``on_peer_loss`` strategies (:mod:`lowband.strategies.peer_loss`, where its
behaviour is described): beating between steps and while waiting for an op in flight, what a missing
member does under each policy, and the strategy's collective points (where a member waiting for the
others is not missing). The store part is :mod:`lowband.comm.heartbeat`, the decision
:mod:`lowband.heartbeat`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from lowband.comm.handle import Handle
from lowband.comm.heartbeat import Heartbeat, poll, register
from lowband.errors import CommFailedError
from lowband.runtime import current, rendezvous_store
from lowband.strategies.base import Strategy

T = TypeVar("T")


@dataclass(frozen=True)
class Noticed:
    """A loss noticed before its agreement: when (monotonic), how long it took to notice (the failing op's
    time, or the silence the heartbeat measured), where, the error, at which step, the silent ranks."""

    at: float
    detect: float
    what: str
    error: str
    step: int
    silent: dict[int, float] = field(default_factory=dict)


class Heartbeating(Strategy):
    """The heartbeat of a strategy's group, a base of :class:`~lowband.strategies.peer_loss.PeerLoss`
    (which sets the policy, the bound and the membership, and implements :meth:`notice`)."""

    peer_loss: str = "raise"
    #: the bound (s); 0: off
    heartbeat_s = 0.0
    #: a loss noticed and not yet agreed on
    _lost: Noticed | None = None
    #: this rank's heartbeat in the current membership (None: off)
    _heartbeat: Heartbeat | None = None
    _membership_key = ""
    _epochs = 0

    def notice(
        self, exc: BaseException, what: str, began: float, silent: dict[int, float] | None = None
    ) -> None:
        """A loss noticed (:meth:`PeerLoss.notice <lowband.strategies.peer_loss.PeerLoss.notice>`)."""
        raise NotImplementedError

    def _start_heartbeat(self) -> None:
        """A heartbeat over the current group, its keys those of the current membership epoch."""
        if self.heartbeat_s <= 0 or self.group.size < 2:
            self._heartbeat = None
            return
        where = (
            f"strategy {self.name!r} (on_peer_loss={self.peer_loss!r}, heartbeat={self.heartbeat_s:g} s) "
            f"on rank {self.group.world_rank}"
        )
        ctx = current(where)
        prefix = f"{self._membership_key}/heartbeat{self._epochs}"
        self._heartbeat = Heartbeat(
            rendezvous_store(ctx),
            prefix,
            self.group.ranks,
            self.group.world_rank,
            self.heartbeat_s,
            where=where,
        )
        register(ctx, self._heartbeat)

    def after_step(self) -> None:
        super().after_step()
        if self._heartbeat is not None:
            self._check(self._heartbeat.beat(time.monotonic()))

    def _check(self, missing: dict[int, float]) -> None:
        """Members the heartbeat finds missing: under ``continue`` a noticed loss (the group is broken, so
        the pending ops fail and the next exchange goes to the agreement); under ``raise`` an error."""
        hb = self._heartbeat
        if not missing or hb is None or (self.peer_loss == "continue" and self._lost is not None):
            return
        silent = ", ".join(f"rank {r} for {s:.2f} s" for r, s in missing.items())
        msg = (
            f"{hb.where}: no heartbeat from {silent} (more than heartbeat={hb.bound:g} s) by step "
            f"{self.steps}: stopped, hung or cut off"
        )
        if self.peer_loss != "continue":
            raise CommFailedError(
                f"{msg}; on_peer_loss='continue' would train on without it, heartbeat=0 turns this check off"
            )
        self.notice(CommFailedError(msg), "the heartbeat", time.monotonic() - max(missing.values()), missing)

    def wait_beating(self, handle: Handle[T]) -> T:
        """``handle.wait()``, beating meanwhile (a stopped peer would otherwise hold this rank for the
        whole timeout, silent to the others): the non-finite guard's agreements in flight, a streamed
        exchange."""
        hb, watch = self._heartbeat, self.peer_watch()
        if handle.done() or (hb is None and watch is None):
            return handle.wait()

        def look() -> None:
            if hb is not None:
                self._check(hb.beat(time.monotonic()))
            if watch is not None:
                watch()

        return poll(handle, current("the heartbeat").config.timeout, look)

    def peer_watch(self) -> Callable[[], None] | None:
        """What else a wait in flight checks between its looks (:class:`PeerLoss`: whether another member
        noticed a loss); None: nothing."""
        return None

    def set_nonfinite(self, policy: str) -> None:
        super().set_nonfinite(policy)
        if self.nonfinite is not None:
            self.nonfinite.waiter = self.wait_beating

    def collective(self, fn: Callable[[], T]) -> T:
        """``fn()``, a collective point of the strategy (every member runs the same ones, in the same
        order; a member blocked in one is not missing for those that have not reached it yet): a beat
        first (a member already silent for too long is found here, not by the op's timeout), and every
        member alive once it completed. Points must be counted alike on every member: one counted by a
        rank alone would make it look ahead for good (never missing to the others)."""
        hb = self._heartbeat
        if hb is None:
            return fn()
        self._check(hb.beat(time.monotonic(), force=True))
        hb.enter()
        out = fn()
        if self._heartbeat is not None:  # (the one of a new membership, after survive)
            self._heartbeat.passed(time.monotonic())
        return out

    def average_state_dict(self) -> dict[str, torch.Tensor]:
        return self.collective(super().average_state_dict)

    def replica_spread(self) -> float:
        return self.collective(super().replica_spread)

    def full_state_dict(self) -> dict[str, Any]:
        # (collective only with sharded parameters: without, ranks may call it alone, so it is no point)
        return self.collective(super().full_state_dict) if self.shards else super().full_state_dict()

    def save(self, folder: str | os.PathLike[str]) -> Path:
        save = super().save
        return self.collective(lambda: save(folder))

    def load(self, folder: str | os.PathLike[str]) -> Path:
        load = super().load
        return self.collective(lambda: load(folder))

    def close(self) -> None:
        """Mark this rank done (the others still running do not take it as lost), then release."""
        if self._heartbeat is not None:
            self._heartbeat.finish()
        super().close()


__all__ = ["Heartbeating", "Noticed"]
