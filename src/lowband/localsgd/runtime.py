"""The mechanics of partial synchronisation: average a layer's parameters in place, overlapped with the
rest of backward, and make sure every later reader waits for it.

:class:`LayerAverager` is the state a strategy keeps apart from its hooks (as torch's ``PowerSGDState``):

- The units averaged are whole layers, or chunks of large layers (:meth:`LayerAverager.set_units`,
  :mod:`lowband.localsgd.units`); a chunk is a view of a slice of the layer's parameters.
- ``begin(step, units)`` before a backward names the units to average in it. The strategy's
  :class:`~lowband.optim.LayerwiseOptimizer` calls :meth:`on_layer` right after stepping a layer; the
  layer's nonblocking, in-place ``igrouped_allreduce`` (average) starts there, while the backward of
  earlier layers goes on. Its parameters are read by no one until the next forward, and every module that
  holds one of them waits for the handle in a forward pre-hook (tied weights included); the layer's inner
  optimizer waits in a step pre-hook too.
- Launches follow one canonical order on every rank, descending unit index (units are in forward
  order, so this is the reverse of the forward order), whatever order the autograd engine makes layers
  ready in: a unit ready early waits until the units before it in that order are launched. Collectives therefore match across ranks; when the engine's
  order is the canonical one (the usual case) each layer is launched the moment it is ready.
  :meth:`flush` after the backward launches whatever is left, so every rank launches the same ops.
- Memory: the parameters themselves are the buffers; a layer's small tensors travel in one fusion
  buffer (the runtime's ``fusion_threshold``), so at most a per-layer buffer is added.
- With ``timing`` on, each averaging's completion time is recorded (a ``Handle.then`` callback) and
  :meth:`take_comm_samples` returns ``(bytes, service seconds)`` per averaging, service time being the
  time from ``max(launch, previous completion)`` to completion (averagings queue on one link). The
  averaged values are then written back on torch's callback thread, which is safe: nothing reads the
  layer before waiting for it.
- Surviving a lost peer (``on_peer_loss=continue``, :attr:`LayerAverager.survival`): before each
  averaging the unit's values are copied aside (a transient copy per unit in flight: at most the units of
  one step); its wait polls (beating, and watching whether another member noticed a loss), and a failed
  one notices the loss, waits until the op has ended (the group is broken by then, so it ends at once) and
  puts the unit back as it was before the averaging (an in-place allreduce that failed half way leaves
  partial sums). Nothing raises into the forward or the step that waited.
- Precision: the averaged "copies" are the parameters themselves, averaged in place in their own dtype
  and on their own device; under bf16/fp16 autocast the parameters stay float32, so averaging is float32
  (no lower-precision copy exists). fp16 loss scaling is refused by these strategies: they step each
  layer during backward, before the whole gradient is known to be finite.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lowband.comm.fusion import igrouped_allreduce
from lowband.comm.handle import Handle
from lowband.errors import CommFailedError, CommTimeoutError
from lowband.group import Group
from lowband.localsgd.units import UnitSpec, unit_tensors
from lowband.optim.pending import PendingWork, Survival, forward_pre_hooks


def _nbytes(ps: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in ps)


class _Guarded:
    """A unit's averaging in flight under :class:`Survival`: waiting it never raises a lost peer."""

    def __init__(
        self, handle: Handle[Any], unit: int, tensors: list[torch.Tensor], saved: list[torch.Tensor],
        survival: Survival,
    ) -> None:  # fmt: skip
        self.handle, self.unit, self.tensors, self.saved = handle, unit, tensors, saved
        self.survival = survival
        self.launched = time.monotonic()

    def wait(self) -> None:
        try:
            self.survival.wait(self.handle)
        except (CommFailedError, CommTimeoutError) as exc:
            self.survival.lost(exc, self.unit, self.launched)
            self.handle.drain(self.survival.drain_s)
            with torch.no_grad():
                for t, old in zip(self.tensors, self.saved, strict=True):
                    t.copy_(old)


class LayerAverager:
    """In-place, overlapped averaging of synchronisation units on ``group`` (pass an unchecked group:
    the strategy validates the layout once).

    ``layers`` are the model's layers as the :class:`~lowband.optim.LayerwiseOptimizer` indexes them.
    The units averaged are whole layers in that order until :meth:`set_units` names others (layers in
    forward order, large ones cut into chunks, :mod:`lowband.localsgd.units`); schedules index units."""

    def __init__(self, layers: Sequence[tuple[str, Sequence[nn.Parameter]]], group: Group) -> None:
        self.layers = [(name, list(ps)) for name, ps in layers]
        self.group = group
        self._layer_index = {name: i for i, (name, _) in enumerate(self.layers)}
        self.timing = False
        #: under on_peer_loss=continue: how failed averagings are survived (None: they raise)
        self.survival: Survival | None = None
        self._pending: PendingWork[Any] = PendingWork()
        self._order: list[int] = []
        self._cursor = 0
        self._step = 0
        self._log: list[list[float]] = []  # [launch time, bytes, completion time (nan until known)]
        self._hooks: list[Any] = []
        self.specs: list[UnitSpec] = []
        self.launch_counts: list[int] = []
        #: the step at which each unit was last averaged (-1: never)
        self.last_sync: list[int] = []
        #: the most local steps any unit went through between two averagings (the first from step 0)
        self.max_gap: list[int] = []
        self.set_units([UnitSpec(n, n, 0, sum(p.numel() for p in ps), _nbytes(ps)) for n, ps in self.layers])

    # -- setup ------------------------------------------------------------------------------------
    def set_units(self, specs: Sequence[UnitSpec]) -> None:
        """Average these units from now on (unit ``u`` is ``specs[u]``; no averaging may be in flight).
        Per-unit counters are kept for units whose spec is unchanged, reset for new ones."""
        if self._pending:
            raise RuntimeError("LayerAverager.set_units: averagings are in flight; wait_all() first")
        old = dict(zip(self.specs, zip(self.launch_counts, self.last_sync, self.max_gap)))
        self.specs = list(specs)
        self.n = len(self.specs)
        self.units: list[list[torch.Tensor]] = []
        self.units_of: list[list[int]] = [[] for _ in self.layers]
        for u, spec in enumerate(self.specs):
            i = self._layer_index[spec.layer]
            self.units.append(unit_tensors(self.layers[i][1], spec.start, spec.stop))
            self.units_of[i].append(u)
        prev = [old.get(spec, (0, -1, 0)) for spec in self.specs]
        self.launch_counts = [c for c, _, _ in prev]
        self.last_sync = [s for _, s, _ in prev]
        self.max_gap = [g for _, _, g in prev]
        self._ready = [False] * self.n

    def attach(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Forward pre-hooks on every module holding a layer's parameter, and a step pre-hook on each
        layer's inner optimizer (``optimizers[i]`` steps layer ``i``), that wait for pending averagings."""
        self._hooks.extend(forward_pre_hooks(model, self.layers, self._before_forward))
        for i, opt in enumerate(optimizers):
            self._hooks.append(opt.register_step_pre_hook(self._step_waiter(i)))

    def _before_forward(self, layers: list[int]) -> None:
        if self._pending:
            for i in layers:
                self.wait_layer(i)

    def _step_waiter(self, i: int) -> Callable[..., None]:
        def hook(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            if self._pending:
                self.wait_layer(i)

        return hook

    def detach(self) -> None:
        """Remove the hooks (pending averagings are waited for first)."""
        self.wait_all()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- one backward -----------------------------------------------------------------------------
    def begin(self, step: int, units: Sequence[int]) -> None:
        """Average ``units`` (indices into :meth:`set_units`' list) in the coming backward of ``step``."""
        self._step = step
        self._order = sorted(set(units), reverse=True)
        self._ready = [False] * self.n
        self._cursor = 0

    def on_layer(self, i: int) -> None:
        """Layer ``i`` was just updated: launch its units (and any unit waiting on them) if scheduled."""
        for u in self.units_of[i]:
            self._ready[u] = True
        order = self._order
        while self._cursor < len(order) and self._ready[order[self._cursor]]:
            self._launch(order[self._cursor])
            self._cursor += 1

    def flush(self) -> None:
        """Launch the scheduled units not launched yet (after the backward)."""
        while self._cursor < len(self._order):
            self._launch(self._order[self._cursor])
            self._cursor += 1

    def _launch(self, u: int) -> None:
        self.wait_unit(u)  # never two averagings of one unit in flight
        survival = self.survival
        saved = [t.detach().clone() for t in self.units[u]] if survival is not None else []
        h: Handle[Any] = igrouped_allreduce(
            self.units[u], inplace=True, name=f"partial-sync:{self.specs[u].name}", group=self.group
        )
        self.launch_counts[u] += 1
        self.max_gap[u] = max(self.max_gap[u], self._step - self.last_sync[u])
        self.last_sync[u] = self._step
        if self.timing and self.group.size > 1:
            entry = [time.perf_counter(), float(self.specs[u].nbytes), math.nan]

            def record(_result: object, entry: list[float] = entry) -> None:
                entry[2] = time.perf_counter()

            self._log.append(entry)
            h = h.then(record)
        if survival is None:
            self._pending.add(u, h)
        else:
            self._pending.add(u, _Guarded(h, u, self.units[u], saved, survival))

    # -- waiting ----------------------------------------------------------------------------------
    def pending(self) -> int:
        """Number of averagings launched and not waited for."""
        return len(self._pending)

    def wait_unit(self, u: int) -> None:
        """Wait (bounded by the runtime's timeout) for unit ``u``'s pending averaging, if any."""
        self._pending.wait(u)

    def wait_layer(self, i: int) -> None:
        """Wait for the pending averagings of every unit of layer ``i``."""
        self._pending.wait_keys(self.units_of[i])

    def wait_all(self) -> None:
        """Wait for every pending averaging, in launch order."""
        self._pending.wait_all()

    # -- measurements -----------------------------------------------------------------------------
    def take_comm_samples(self) -> list[tuple[int, float]]:
        """``(bytes, service seconds)`` of the averagings timed since the last call (call after
        :meth:`wait_all`; averagings whose completion was not recorded yet are skipped)."""
        out: list[tuple[int, float]] = []
        prev_done = -math.inf
        for launch, nb, done in self._log:
            if math.isnan(done):
                continue
            out.append((int(nb), max(0.0, done - max(launch, prev_done))))
            prev_done = max(prev_done, done)
        self._log = []
        return out
