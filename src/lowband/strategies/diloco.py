"""DiLoCo ("DiLoCo: Distributed Low-Communication Training of Language Models", Douillard et al.,
preprint 2023, arXiv 2311.08455), Algorithm 1: every rank takes ``inner_steps`` = H steps of the user's (inner)
optimizer on its own data; then the ranks average their *pseudo-gradients* ``θ - θ_r`` (the global
parameters of the period's start minus the rank's own) in one allreduce, and the *outer* optimizer
steps the global parameters on that average (the paper's: SGD with Nesterov momentum 0.9, lr 0.7);
every rank continues from the new global parameters. Each rank keeps its inner optimizer's state across
periods, as the paper does.

``outer=sgd:lr=1.0;momentum=0`` with ``inner_steps=1`` and a plain SGD inner optimizer is synchronous
data-parallel SGD (up to rounding: the average of ``lr * g_r`` is recovered as a parameter difference).

The global parameters ``θ`` are taken at the first step (after the initial broadcast, so equal on every
rank); they, the outer optimizer's state (its momentum) and the inner step count are in
:meth:`state_dict`, so a run resumes exactly, mid-period too. Between outer steps the replicas differ:
``average_model`` gives their mean, ``in_sync()`` is True right after an outer step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowband.comm.reduce import allreduce
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.options import Opt, Options
from lowband.registry import parse_spec
from lowband.strategies.base import OptimizerFactory, Strategy
from lowband.strategies.registry import register_strategy

#: the outer optimizers a spec can name
OUTER: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
DEFAULT_OUTER = "sgd:lr=0.7;momentum=0.9;nesterov=true"


def parse_outer(spec: object) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """``name:key=value;...`` -> (optimizer class, options), checked by building it on one tensor."""
    name, opts = parse_spec(str(spec), "outer optimizer", semicolons=True)
    cls = OUTER.get(name)
    if cls is None:
        raise InvalidArgumentError(f"outer optimizer {name!r} is not one of {sorted(OUTER)}")
    try:
        cls([nn.Parameter(torch.zeros(1))], **opts)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"outer optimizer spec {spec!r}: {exc}") from exc
    return cls, opts


@register_strategy(
    "diloco",
    "DiLoCo: H inner steps per rank, then an outer optimizer step on the averaged pseudo-gradient",
    Options(
        {
            "inner_steps": Opt(
                int, min=1, unit="steps", doc="H: inner optimizer steps between two outer steps"
            ),
            "outer": Opt(
                str,
                parse=parse_outer,
                doc=f"the outer optimizer on the averaged pseudo-gradient, name:key=value;... with name one of "
                f"{sorted(OUTER)} (default {DEFAULT_OUTER}, the paper's)",
            ),
        }
    ),
)
class DiLoCoStrategy(Strategy):
    """See the module docstring."""

    name = "diloco"
    no_grad_scaler_reason = "its outer step counts inner steps, and a step the scaler skips would shift them"
    no_skip_reason = "its outer step counts inner steps, and a skipped one would shift every rank's period"

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        inner_steps: int = 50,
        outer: str = DEFAULT_OUTER,
    ) -> None:
        self.inner_steps = inner_steps
        self.outer_spec = outer
        self.outer_cls, self.outer_options = parse_outer(outer)
        super().__init__(model, make_optimizer(model.parameters()), group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inner_done = 0
        self.outer_steps = 0
        self.global_params: list[nn.Parameter] | None = None  # θ, taken at the first step
        self.outer: torch.optim.Optimizer | None = None

    def hparams(self) -> dict[str, Any]:
        return {"H": self.inner_steps, "outer": self.outer_spec}

    # -- the step ---------------------------------------------------------------------------------
    def _take_global(self, values: list[torch.Tensor] | None = None) -> None:
        src = values if values is not None else [p.detach() for p in self.params]
        self.global_params = [nn.Parameter(v.clone()) for v in src]
        self.outer = self.outer_cls(self.global_params, **self.outer_options)

    def apply_step(self) -> None:
        if self.global_params is None:
            self._take_global()
        super().apply_step()
        self.inner_done += 1
        if self.inner_done % self.inner_steps == 0:
            self._outer_step()

    @torch.no_grad()
    def _outer_step(self) -> None:
        assert self.global_params is not None and self.outer is not None
        deltas = [g.detach() - p.detach() for g, p in zip(self.global_params, self.params, strict=True)]
        flat = torch.cat([d.reshape(-1) for d in deltas])
        avg = allreduce(flat, "average", name="diloco:pseudo-gradient", group=self.group)
        off = 0
        for g, d in zip(self.global_params, deltas, strict=True):
            g.grad = avg[off : off + d.numel()].view_as(d).clone()
            off += d.numel()
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for g, p in zip(self.global_params, self.params, strict=True):
            p.copy_(g)
        self.outer_steps += 1

    def in_sync(self) -> bool:
        return self.inner_done > 0 and self.inner_done % self.inner_steps == 0

    def report(self) -> dict[str, Any]:
        return {**super().report(), "outer_steps": self.outer_steps}

    # -- state ------------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {
            "inner_done": self.inner_done,
            "outer_steps": self.outer_steps,
            "global": None
            if self.global_params is None
            else [g.detach().clone() for g in self.global_params],
            "outer": None if self.outer is None else self.outer.state_dict(),
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.inner_done = int(state.get("inner_done", 0))
        self.outer_steps = int(state.get("outer_steps", 0))
        glob = state.get("global")
        if glob is None:
            self.global_params, self.outer = None, None
            return
        shapes = [tuple(p.shape) for p in self.params]
        if [tuple(g.shape) for g in glob] != shapes:
            raise InvalidArgumentError(
                f"strategy 'diloco' on rank {self.group.world_rank}: the checkpoint's global parameters "
                f"have shapes {[tuple(g.shape) for g in glob]}, this model's {shapes}"
            )
        self._take_global([g.to(p.device, p.dtype) for g, p in zip(glob, self.params, strict=True)])
        assert self.outer is not None
        if state.get("outer") is not None:
            self.outer.load_state_dict(state["outer"])
