"""Asynchronous decentralized SGD with one-sided windows (BlueFog's ``DistributedWinPutOptimizer``).

Every parameter is registered as a window (:func:`lowband.decentral.window.win_create`, collective, at
construction) over a static topology. The order is BlueFog's: after the J-th training forward since the
last communication (``J = num_steps_per_communication``) each parameter is put into its out-neighbors'
windows (nonblocking: the put is applied by the destination's window service, whatever its training
loop is doing); :meth:`~WinPutOptimizer.step` then waits for those puts, replaces each parameter by
``self_weight * x + sum_j src_weights[j] * (x_j last received)`` (:func:`~lowband.decentral.window.win_update`
under this rank's window mutex; default: the topology's pull weights) and runs the inner torch optimizer
with the local gradient (computed at the pre-combination parameters): ``x <- W x - lr * g(x)``. A step
before the J-th forward is a local step. No rank ever waits for a neighbor to reach some step: a slow
or sleeping neighbor just contributes its last value. :meth:`~WinPutOptimizer.close` frees the windows
(collective).

Under ``on_peer_loss="continue"`` (:mod:`lowband.decentral.winput_strategy`, :attr:`~WinPutOptimizer.survival`
set) a put that fails, or a window call that meets the service's record of a lost neighbor, never raises:
the strategy is told (it notices the loss), and :meth:`~WinPutOptimizer.abandon` gives up the windows on
this rank alone (:func:`~lowband.decentral.window.win_abandon`: no collective, and every peer's next
operation toward this rank fails, so it notices too). From then on nothing is put and nothing combined
(local steps) until :meth:`~WinPutOptimizer.regroup` registers the windows again over the members.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lowband.decentral.combine import Guarded, Pending
from lowband.decentral.knobs import (
    Knob,
    check_bool,
    check_dst_knob,
    check_period,
    check_self_weight,
    check_src,
)
from lowband.decentral.optim_base import WrapperBase
from lowband.decentral.window import (
    win_abandon,
    win_create,
    win_free,
    win_load_state_dict,
    win_put_nonblocking,
    win_state_dict,
    win_update,
)
from lowband.errors import CommFailedError, CommTimeoutError, InvalidArgumentError
from lowband.group import Group
from lowband.optim.layerwise import OptimizerFactory
from lowband.optim.pending import Survival, Waitable
from lowband.topology import Topology

_COUNTER_KEY = "lowband.decentral.winput"
_LOST = (CommFailedError, CommTimeoutError)


def _no_result(_results: list[Any]) -> list[Any]:
    return []


class WinPutOptimizer(WrapperBase):
    """Win-put decentralized optimizer wrapping the torch optimizer ``make_optimizer`` builds.

    ``topology``: the windows' static topology (default: the group's,
    :func:`lowband.decentral.state.load_topology`). Knobs settable before every step:
    ``self_weight`` + ``src_weights`` (the combination; both or neither), ``dst_weights`` (the scale of
    the copy sent to each out-neighbor, default 1), ``num_steps_per_communication``, ``require_mutex``
    (apply puts under the destinations' mutexes; updates always hold this rank's own mutex).
    """

    num_steps_per_communication = Knob(check_period)
    self_weight = Knob(check_self_weight)
    src_weights = Knob(check_src)
    dst_weights = Knob(check_dst_knob)
    require_mutex = Knob(check_bool)

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        *,
        topology: Topology | None = None,
        num_steps_per_communication: int = 1,
        require_mutex: bool = False,
        group: Group | None = None,
        broadcast_init: bool = True,
    ) -> None:
        where, layers = self.model_layers("WinPutOptimizer", model, group)
        self.inner = self.build_inner(where, make_optimizer, layers)
        super().__init__(model, layers, group, broadcast_init=broadcast_init)
        self.num_steps_per_communication = num_steps_per_communication
        self.require_mutex = require_mutex
        self.self_weight = self.src_weights = self.dst_weights = None
        # window names: unique per optimizer on this rank, the same on every rank (construction order)
        k = self.ctx.state.get(_COUNTER_KEY, 0)
        self.ctx.state[_COUNTER_KEY] = k + 1
        self.windows = [(f"winput{k}.{name}.{j}", p) for name, ps in layers for j, p in enumerate(ps)]
        for wname, p in self.windows:
            win_create(p.detach(), wname, topology=topology, group=self.group)
        #: this rank's puts in flight (under ``survival``: each :class:`Guarded`, whose wait gives None
        #: once it failed and was survived)
        self._puts: list[Waitable[Any]] = []
        self._combining = False  # the J-th forward since the last communication passed, not yet combined
        self._open = True
        #: under ``on_peer_loss="continue"``: how a failed put or window call is survived (None: it raises)
        self.survival: Survival | None = None
        #: a lost peer noticed (:meth:`abandon`): no windows, nothing put or combined until :meth:`regroup`
        self.alone = False
        self.count_forwards()
        self._hooks.append(self.model.register_forward_hook(self._after_forward))

    def _after_forward(self, module: nn.Module, _args: Any, _out: Any) -> None:
        """The J-th training forward: put every parameter into the out-neighbors' windows."""
        if not module.training or not torch.is_grad_enabled() or self._combining or not self._open:
            return
        if self.forwards < self.num_steps_per_communication:
            return
        self._combining = True
        if self.alone:
            return  # a lost peer noticed: this communication is dropped (a local step)
        mutex = self.require_mutex
        survival = self.survival
        if survival is None:
            for wname, p in self.windows:
                self._puts.append(
                    win_put_nonblocking(p.detach(), wname, dst_weights=self.dst_weights, require_mutex=mutex)
                )
            return
        for i, (wname, p) in enumerate(self.windows):
            launched = time.monotonic()
            try:
                h = win_put_nonblocking(p.detach(), wname, dst_weights=self.dst_weights, require_mutex=mutex)
            except _LOST as exc:  # the service lost a neighbor: told at this rank's next window call
                survival.lost(exc, i, launched)
                return
            self._puts.append(Guarded(Pending([h], _no_result), i, survival))

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """:meth:`synchronize` (after the J-th forward: wait for this rank's puts and combine what has
        arrived, without waiting for any neighbor), then the local step."""
        if closure is not None:
            raise InvalidArgumentError(f"{self.where}: step(closure) is not supported")
        if not self._open:
            raise InvalidArgumentError(f"{self.where}: step() after close()")
        self.synchronize()
        self.inner.step()
        self.steps += 1
        return None

    def wait_puts(self) -> None:
        """Wait until this rank's puts in flight have been applied at their destinations."""
        if self.survival is None:
            puts, self._puts = self._puts, []
            for h in puts:
                h.wait()
            return
        while self._puts:
            if self._puts.pop(0).wait() is None:
                return  # failed and survived: the loss was noticed (abandon forgot the other puts)

    def synchronize(self) -> None:
        """After the J-th forward: wait for this rank's puts, then replace every parameter by the
        combination of itself and what has arrived in its window (under this rank's window mutex), as
        BlueFog's ``synchronize`` does. Otherwise nothing."""
        if not self._combining:
            return
        self.wait_puts()
        if not self.alone:
            self._combine()
        self.forwards = 0
        self._combining = False

    def _combine(self) -> None:
        """Every window's :func:`win_update`; under :attr:`survival`, a window call meeting a lost peer is
        noticed and the windows not combined yet keep their values (each window is one parameter)."""
        sw, src = self.self_weight, self.src_weights
        for i, (wname, _) in enumerate(self.windows):
            began = time.monotonic()
            try:
                win_update(wname, self_weight=sw, src_weights=src, require_mutex=True)
            except _LOST as exc:
                if self.survival is None:
                    raise
                self.survival.lost(exc, i, began)
                return

    # -- a lost peer (on_peer_loss="continue", lowband.decentral.winput_strategy) ----------------------
    def abandon(self) -> None:
        """A lost peer was noticed: give up the windows on this rank alone (:func:`win_abandon`: no
        collective; every put in flight ends), forget the puts, and put and combine nothing until
        :meth:`regroup` (the current communication, if any, is dropped: a local step)."""
        self.alone = True
        self._puts = []
        win_abandon([wname for wname, _ in self.windows], timeout=self.ctx.config.timeout)

    def regroup(self, group: Group, topology: Topology) -> None:
        """Put and combine over ``group`` (the members after a membership change) with ``topology`` (over
        its ranks): the windows are registered again (collective over ``group``), each buffer a copy of
        this rank's parameter as it is now, as at construction: until a neighbor's first put arrives, its
        share of a combination is this rank's own value."""
        win_abandon([wname for wname, _ in self.windows], timeout=self.ctx.config.timeout)
        self._puts = []
        self.group = group
        for wname, p in self.windows:
            win_create(p.detach(), wname, topology=topology, group=group)
        self.alone = False

    def counters(self) -> dict[str, Any]:
        return {**super().counters(), "forwards": self.forwards}

    def load_counters(self, counters: dict[str, Any]) -> None:
        super().load_counters(counters)
        self.forwards = int(counters.get("forwards", 0))

    def state_dict(self) -> dict[str, Any]:
        """Inner state, counters, and every window's buffers (the neighbors' last values) and versions."""
        self._check_windows("state_dict")
        out = super().state_dict()
        out["windows"] = [win_state_dict(wname) for wname, _ in self.windows]
        return out

    def _check_windows(self, what: str) -> None:
        if self.alone:
            raise InvalidArgumentError(
                f"{self.where}: {what} between a lost peer's notice and the members' meeting: the windows "
                "are registered again there (after the step in which the members meet)"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_windows("load_state_dict")
        super().load_state_dict(state_dict)
        windows = state_dict.get("windows")
        if not isinstance(windows, list) or len(windows) != len(self.windows):
            raise InvalidArgumentError(
                f"{self.where}: load_state_dict: expected {len(self.windows)} window states, got "
                f"{len(windows) if isinstance(windows, list) else type(windows).__name__}"
            )
        for (wname, _), st in zip(self.windows, windows):
            win_load_state_dict(wname, st)

    def close(self) -> None:
        """Finish this rank's puts and free the windows (collective: every rank of the group calls it)."""
        if self._open:
            self.wait_puts()
            self._combining = False
            self.remove_hooks()
            if self.alone:  # (after a lost peer, before a meeting: given up on this rank alone already)
                win_abandon([wname for wname, _ in self.windows], timeout=self.ctx.config.timeout)
            else:
                for wname, _ in self.windows:
                    win_free(wname)
            self._open = False
