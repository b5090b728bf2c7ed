"""DiLoCo and its streaming, compressed variants: one outer loop.

DiLoCo ("DiLoCo: Distributed Low-Communication Training of Language Models", Douillard et al., preprint
2023, arXiv 2311.08455), Algorithm 1: every rank takes ``inner_steps`` = H steps of the user's (inner)
optimizer on its own data; then the ranks average their *pseudo-gradients* ``θ - θ_r`` (the global
parameters of the period's start minus the rank's own), and the *outer* optimizer steps the global
parameters on that average (the paper's: SGD with Nesterov momentum 0.9, lr 0.7); every rank continues
from the new global parameters. Each rank keeps its inner optimizer's state across periods.

``outer=sgd:lr=1.0;momentum=0`` with ``inner_steps=1`` and a plain SGD inner optimizer is synchronous
data-parallel SGD (up to rounding: the average of ``lr * g_r`` is recovered as a parameter difference).

Streaming (Streaming DiLoCo, Douillard et al., preprint 2025, arXiv 2501.18512): ``fragments=F`` splits
the parameters into F runs of consecutive tensors (:mod:`lowband.localsgd.fragments`), each with its own
global copy and outer optimizer, synchronised at staggered inner steps of the period; the exchange of a
fragment starts at its step and is applied ``delay`` = τ inner steps later (the communication overlaps
those steps' computation), the local fragment then mixed with the new global one:
``θ_local <- alpha * θ_local + (1 - alpha) * θ_global`` (``alpha=0``: replaced, as DiLoCo does).

Compression: the pseudo-gradient of each fragment goes through a compressed reducer built from the
compression framework's specs (``compressor=``, ``reducer=`` the transport, ``memory=`` residual error
feedback by default, keyed by parameter name), so a 2 % top-k or a DCT top-k with error feedback
replaces the full-precision average (SparseLoCo's and DeMo's recipes, with ``outer=sgd:lr=..;momentum=0``
where the error feedback stands in for outer momentum). ``compressor=identity`` (the default) is the
exact average.

Decentralised (``topology=``, as NoLoCo does with one peer per round): instead of the all-rank average,
each rank averages its pseudo-gradient with its neighbours in a graph (BlueFog's topologies:
``dynamic-exp2`` changes the one peer at every exchange of a fragment) and steps its own copy of the
global parameters, which then differ between ranks; full precision only.

Automatic choices (:mod:`lowband.strategies.diloco_auto`): ``fragments=auto`` takes F and the split
from DreamDDP's cost profile (the fewest fragments whose exchanges the ``delay`` steps' compute hides);
``inner_steps=auto`` gives each machine the inner steps fitting the slowest machine's ``base_steps``
period, and weights the outer average by each machine's steps (the samples it saw).

The global parameters are taken at the first step (after the initial broadcast, so equal on every
rank); they, the outer optimizers' state, the error-feedback memory, the inner step count and the
exchanges in flight (completed and kept with the step they are due at) are in :meth:`state_dict`, so a
run resumes exactly, mid-period and mid-fragment. ``on_peer_loss=continue`` (:mod:`lowband.strategies.peer_loss`;
inner=local, full precision, delay=0): an exchange that finds a peer dead is redone among the survivors
with the same pseudo-gradients. Between outer steps the replicas differ:
``average_model`` gives their mean; ``in_sync()`` is True right after a whole-model outer step that
replaced the replicas (one fragment, no delay, ``alpha=0``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lowband.comm.collectives import broadcast
from lowband.comm.handle import Handle
from lowband.compress.reducer import CompressedReducer, flatten, unflatten_into
from lowband.compress.specs import build_reducer, describe_reducer
from lowband.decentral.neighbor import ineighbor_allreduce
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.localsgd.costmodel import CostProfile
from lowband.localsgd.fragments import FragmentChoice, check_delay, split_fragments
from lowband.localsgd.inner_budget import parse_machine_steps, sample_scales
from lowband.optim.reducer import AllreduceReducer, ReduceContext, Unit
from lowband.optim.stage import GradientStage
from lowband.optim.units import model_units
from lowband.runtime import current
from lowband.strategies import diloco_state
from lowband.strategies.base import OptimizerFactory
from lowband.strategies.diloco_auto import DiLoCoAuto
from lowband.strategies.diloco_options import DEFAULT_OUTER, DILOCO_OPTIONS, parse_outer
from lowband.strategies.peer_loss import PeerLoss
from lowband.strategies.registry import register_strategy
from lowband.strategies.replay import ForwardReplay
from lowband.topology import DynamicTopology, Topology
from lowband.topology.names import TOPOLOGIES, build_topology, topology_label

if TYPE_CHECKING:
    from lowband.plan.links import Links
    from lowband.plan.prediction import Prediction
    from lowband.plan.profile import PlanProfile


@register_strategy(
    "diloco",
    "DiLoCo: H inner steps per rank, then an outer optimizer step on the averaged pseudo-gradient "
    "(streamed in fragments, compressed with error feedback)",
    DILOCO_OPTIONS,
)
class DiLoCoStrategy(DiLoCoAuto, PeerLoss):
    """See the module docstring."""

    name = "diloco"
    local_steps = True  # inner=local only: inner=ddp has a gradient stage (agreed every step)
    no_grad_scaler_reason = "its outer step counts inner steps, and a step the scaler skips would shift them"
    no_skip_reason = "its outer step counts inner steps, and a skipped one would shift every rank's period"

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        inner_steps: int | str = 50,
        outer: str = DEFAULT_OUTER,
        fragments: int | str = 1,
        delay: int = 0,
        alpha: float = 0.0,
        topology: object = "none",
        inner: str = "local",
        compressor: str = "identity",
        reducer: str = "auto",
        memory: str = "residual",
        seed: int = 0,
        base_steps: int = 50,
        machine_steps: str | None = None,
        profile: str | Path | CostProfile | None = None,
        on_peer_loss: str = "raise",
        min_ranks: int | None = None,
        peer_settle: float = 1.0,
        heartbeat: float | None = None,
    ) -> None:
        where = self.where = f"strategy 'diloco' on rank {group.rank}"
        named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [q for _, q in named]
        self.auto_steps, self.auto_fragments = inner_steps == "auto", fragments == "auto"
        #: H: every rank's inner steps per period (with inner_steps=auto: the slowest machine's)
        self.inner_steps = base_steps if self.auto_steps else int(inner_steps)
        self.delay, self.alpha = delay, float(alpha)
        self.auto_log, self._step_seconds, self._step_began = [], [], None
        self.fragment_choice: FragmentChoice | None = None
        self.fragments: list[list[int]] = []  # none: fragments=auto has not chosen yet
        self.offsets: list[int] = []
        self.sent: list[int] = []
        self.h = self.inner_steps  # this rank's inner steps in the current period
        self.profile: CostProfile | None = None
        try:
            if fragments != "auto":
                self._set_fragments(split_fragments([q.numel() for q in self.params], int(fragments)))
                check_delay(delay, int(fragments), self.inner_steps)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{where}: {exc}") from None
        self.outer_spec = outer
        self.outer_cls, self.outer_options = parse_outer(outer)
        self.reducer: CompressedReducer = build_reducer(compressor, reducer, memory, seed=seed, where=where)
        self.topology_name = topology_label(topology)
        self.topology: Topology | DynamicTopology | None = None
        if not (isinstance(topology, str) and topology == "none") and compressor != "identity":
            raise InvalidArgumentError(
                f"{where}: topology={self.topology_name!r} averages pseudo-gradients with neighbours in full "
                f"precision; compressor={compressor!r} goes with the all-rank average (topology=none)"
            )
        ctx = current(where)
        self.inner = inner
        self.local_size = ctx.local_size if inner == "ddp" else 1
        #: this rank's machine: its index among the outer loop's participants
        self.machine_index = group.rank // self.local_size
        self.participants = participants = group.size // self.local_size
        self.machine_steps: list[int] | None = None
        if machine_steps is not None:
            try:
                self.machine_steps = parse_machine_steps(machine_steps, participants, self.inner_steps)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"{where}: {exc}") from None
        self.period_start = 0  # the inner step the current period began after
        self.h = self._own_steps()
        self._set_offsets()
        #: the group of the outer exchange (None: this rank receives the result from its machine's first)
        self.outer_group: Group | None = group
        self.machine: Group | None = None
        if inner == "ddp":
            if ctx.machine_size == 1 or ctx.local_group is None or group.ranks != ctx.world.ranks:
                raise InvalidArgumentError(
                    f"{where}: inner=ddp needs several machines of several ranks (--ranks-per-machine, "
                    f"local_size) and the world group; here {ctx.machine_size} machine(s) of {ctx.local_size} rank(s)"
                )
            self.machine = ctx.local_group
            self.outer_group = ctx.machine_group if ctx.rank % ctx.local_size == 0 else None
        if not (isinstance(topology, str) and topology == "none"):
            peers = ctx.machine_size if inner == "ddp" else group.size
            self.topology = build_topology(
                where, topology, tuple(TOPOLOGIES), peers, 1 if inner == "ddp" else ctx.local_size
            )
        super().__init__(model, make_optimizer(model.parameters()), group)
        self.init_peer_loss(on_peer_loss, min_ranks, peer_settle, heartbeat)
        if on_peer_loss == "continue":  # no cross-rank argument check: its store waits outlive a dead peer
            self.outer_group = group.unchecked()
        if self.machine is not None:  # the machine's ranks average every inner step, from backward hooks
            self.stage = GradientStage(
                model_units(model, 25.0, 1.0), AllreduceReducer(), group=self.machine, where=where
            )
        self.inner_done = 0
        self.outer_steps = 0
        self.global_params: list[nn.Parameter] | None = None  # θ, taken at the first step
        self.outers: list[torch.optim.Optimizer] = []  # one per fragment
        self.units: list[Unit] = []
        #: per fragment in flight: (the inner step it is applied at, the handle of the averaged pseudo-gradient)
        self.pending: dict[int, tuple[int, Handle[list[torch.Tensor]] | None]] = {}
        self._replay: ForwardReplay | None = None
        if fragments == "auto":
            self._setup_auto_fragments(model, profile)

    plan_grid = ("inner_steps=5", "inner_steps=20")

    @classmethod
    def predict(cls, profile: PlanProfile, links: Links, options: Mapping[str, Any]) -> Prediction | None:
        from lowband.plan import models

        return models.diloco(profile, links, options)

    def hparams(self) -> dict[str, Any]:
        d = describe_reducer(self.reducer)
        return {
            "H": "auto" if self.auto_steps else self.inner_steps,
            "outer": self.outer_spec,
            "fragments": "auto" if self.auto_fragments else len(self.fragments),
            "delay": self.delay,
            "alpha": self.alpha,
            "topology": self.topology_name,
            "inner": self.inner,
            "compressor": d["compressor"],
            "reducer": d["transport"],
            "memory": d["memory"],
        }

    # -- the step ---------------------------------------------------------------------------------
    def _take_global(self, values: list[torch.Tensor] | None = None) -> None:
        src = values if values is not None else [q.detach() for q in self.params]
        self.global_params = [nn.Parameter(v.clone()) for v in src]
        self.outers = [
            self.outer_cls([self.global_params[i] for i in frag], **self.outer_options)
            for frag in self.fragments
        ]
        self.units = [
            Unit(
                f"diloco:fragment{k}",
                tuple(self.names[i] for i in frag),
                tuple(self.global_params[i] for i in frag),
            )
            for k, frag in enumerate(self.fragments)
        ]

    def begin_step(self) -> None:
        super().begin_step()
        self._mark_step()

    def apply_step(self) -> None:
        if not self.fragments:
            raise InvalidArgumentError(
                f"{self.where}: fragments=auto has not chosen yet; the first training forward through s.module "
                "profiles the model on its batch (or call train_step, or give profile=)"
            )
        if self.global_params is None:
            self._take_global()
        if self.machine is not None:
            self.stage.wait()  # the machine's average in .grad
        super().apply_step()
        self._clock_step()
        self.inner_done += 1
        for k in sorted(self.pending):  # (the exchanges are collective points: PeerLoss.collective)
            if self.pending[k][0] == self.inner_done:
                self.collective(functools.partial(self._apply, k))
        phase = self.inner_done - self.period_start
        for k, off in enumerate(self.offsets):
            if phase == off and self.peer_loss == "continue":  # (delay=0)
                self._exchange_surviving(k)
            elif phase == off:
                self.collective(functools.partial(self._exchange, k))
        if phase == self.h:
            self._end_period()

    def _exchange(self, k: int) -> None:
        """Fragment ``k``'s exchange started (and, with ``delay=0``, applied)."""
        self._send(k)
        if self.delay == 0:
            self._apply(k)

    @torch.no_grad()
    def _send(self, k: int) -> None:
        """Start averaging fragment ``k``'s pseudo-gradient (compressed, if so configured)."""
        assert self.global_params is not None
        frag = self.fragments[k]
        deltas = [self.global_params[i].detach() - self.params[i].detach() for i in frag]
        if self.machine_steps is not None:  # weighted by the samples of each machine's period
            scale = sample_scales(self.machine_steps)[self.machine_index]
            deltas = [d.mul_(scale) for d in deltas]
        handle: Handle[list[torch.Tensor]] | None = None
        if self.outer_group is None:
            pass  # inner=ddp, not the machine's first rank: the result comes by broadcast when applied
        elif self.topology is None:
            handle = self.reducer.reduce(self.units[k], deltas, ReduceContext(self.outer_group, self.sent[k]))
        else:  # each rank with its neighbours; a dynamic graph advances once per exchange of the fragment
            topo = self.topology
            graph = topo.at(self.sent[k]) if isinstance(topo, DynamicTopology) else topo
            flat = flatten(deltas)
            mixed = ineighbor_allreduce(
                flat, topology=graph, name=f"diloco:fragment{k}", group=self.outer_group
            )
            handle = mixed.map(functools.partial(unflatten_into, grads=deltas))
        self.pending[k] = (self.inner_done + self.delay, handle)
        self.sent[k] += 1

    def _exchange_surviving(self, k: int) -> None:
        """Fragment ``k``'s exchange and outer step under ``on_peer_loss=continue`` (delay=0): a failed
        exchange changed nothing (the pseudo-gradient is taken again from the same parameters), so it is
        redone among the members :meth:`PeerLoss.survive` agrees on."""
        sent = self.sent[k]

        def average() -> None:
            try:
                self._send(k)
                self._apply(k)
            except BaseException:
                self.pending.pop(k, None)
                self.sent[k] = sent
                raise

        self.survive(sum(self.sent), average)

    def regroup(self, group: Group) -> None:
        self.outer_group = group.unchecked()

    @torch.no_grad()
    def _apply(self, k: int) -> None:
        """Fragment ``k``'s outer step on its averaged pseudo-gradient, and the local copy mixed in."""
        assert self.global_params is not None
        _, handle = self.pending.pop(k)
        frag = self.fragments[k]
        avg = self.wait_beating(handle) if handle is not None else None
        if self.machine is not None:  # the machine's first rank hands the outer average to the others
            if avg is None:
                avg = [torch.empty_like(self.params[i]) for i in frag]
            flat = flatten(avg)
            broadcast(flat, 0, inplace=True, name=f"diloco:fragment{k}", group=self.machine)
            avg = unflatten_into(flat, avg)
        assert avg is not None
        for i, a in zip(frag, avg, strict=True):
            self.global_params[i].grad = a
        self.outers[k].step()
        self.outers[k].zero_grad(set_to_none=True)
        for i in frag:
            g, q = self.global_params[i], self.params[i]
            if self.alpha == 0.0:
                q.copy_(g)
            else:
                q.mul_(self.alpha).add_(g, alpha=1.0 - self.alpha)
        if k == len(self.fragments) - 1:
            self.outer_steps += 1

    def synchronize(self) -> None:
        """Finish the exchanges in flight (their results stay due at their step)."""
        super().synchronize()
        for _, h in self.pending.values():
            if h is not None:
                self.wait_beating(h)
        if self.machine is not None:
            self.stage.wait()

    def finish_gradients(self) -> None:
        if self.machine is not None:
            self.stage.wait()

    def close(self) -> None:
        if self._replay is not None:
            self._replay.remove()
        if self.machine is not None:
            self.stage.remove_hooks()
        super().close()

    def in_sync(self) -> bool:
        whole = len(self.fragments) == 1 and self.delay == 0 and self.alpha == 0.0 and self.topology is None
        return whole and self.inner_done > 0 and self.inner_done == self.period_start

    def report(self) -> dict[str, Any]:
        return {
            **super().report(),
            "outer_steps": self.outer_steps,
            "fragments_chosen": len(self.fragments),
            "machine_steps": self.machine_steps,
            "auto": list(self.auto_log),
        }

    # -- state (lowband.strategies.diloco_state) -------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return diloco_state.extra_state(self)

    def load_extra_state(self, state: dict[str, Any]) -> None:
        diloco_state.load_extra_state(self, state)
