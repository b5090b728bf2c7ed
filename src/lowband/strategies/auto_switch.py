"""The parts of ``auto`` (:mod:`lowband.strategies.auto`) that plan, build and replace its choice.

- :func:`choose`: every rank predicts the candidates on the profile and links (so the compressors are
  timed beside the other ranks' work, as they run in training where ranks share cores) and rank 0's
  decision is every rank's (one exchange of its text): each rank's timings differ, the choice may not. A candidate only replaces the current choice when predicted ``min_gain``
  faster than it on the same links (switching costs a consensus and a rebuild).
- :class:`FirstForward`: the module a loop calls before the choice (the first training forward chooses).
- :func:`switch`: between steps, every rank alike. The current strategy finishes what is in flight;
  its consensus model (:meth:`~lowband.strategies.Strategy.average_state_dict`: the replicas averaged
  when they differ, as after local steps) is loaded into the model, the optimizer's state is averaged
  over the ranks and carried into the new strategy's optimizer when that holds the same parameters in
  the same groups (else it starts fresh, and the report says so); state that belongs to the old
  strategy's method (error-feedback residuals, outer momenta, schedules) ends with it and is listed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lowband.comm import collectives as comm
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.plan.links import Links
from lowband.plan.planner import default_specs, make_plan, recommend
from lowband.plan.profile import PlanProfile, profile_module
from lowband.strategies.base import OptimizerFactory, Strategy
from lowband.strategies.replay import output_loss

if TYPE_CHECKING:
    from lowband.strategies.auto import AutoStrategy

#: candidates' figures kept in each decision (the report's table)
SHOWN = 6


def candidate_specs(only: str | None) -> list[str]:
    """The plan's default specs (every registered strategy over its plan grid) but ``auto``, restricted
    to the strategies ``only`` names (``a|b|c``)."""
    names = None if only is None else {n.strip() for n in only.split("|")}
    out = []
    for spec in default_specs():
        name = spec.partition(":")[0]
        if name != "auto" and (names is None or name in names):
            out.append(spec)
    return out


def resolve_profile(
    profile: str | Path | PlanProfile | None,
    probe: Callable[[nn.Module], torch.Tensor] | None,
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    group: Group,
    where: str,
) -> PlanProfile:
    """The plan profile: given, read from a ``plan.json`` (its ``profile``), or measured with ``probe``
    on every rank (collective: the slowest rank's layer times)."""
    if isinstance(profile, PlanProfile):
        return profile
    if profile is not None:
        try:
            data = json.loads(Path(profile).read_text())
        except (OSError, ValueError) as e:
            raise InvalidArgumentError(f"{where}: cannot read the profile {str(profile)!r}: {e}") from None
        return PlanProfile.from_json(data.get("profile", data) if isinstance(data, dict) else data, where)
    assert probe is not None
    return profile_module(
        model, probe, make_optimizer, name="auto", batch_size=0, group=group, interference=group.size > 1
    )


def profile_text(profile: PlanProfile) -> str:
    """``profile`` as JSON, without its operations (they are this machine's, measured when asked)."""
    return json.dumps({k: v for k, v in profile.to_json().items() if k != "operations"})


def save_profile(profile: PlanProfile, path: Path) -> None:
    """``{"profile": ...}`` (what ``plan.json`` holds) written through a temporary file renamed into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"profile": json.loads(profile_text(profile))}, indent=1))
    os.replace(tmp, path)


def measure(group: Group) -> Links:
    """The group's links, measured (collective; identical on every rank)."""
    from lowband.plan.measure import measure_links

    return measure_links(group)


def links_json(links: Links) -> dict[str, Any]:
    return {
        "label": links.label,
        "bandwidth_bytes_s": links.bandwidth if math.isfinite(links.bandwidth) else None,
        "latency_s": links.latency,
    }


def _decide(auto: AutoStrategy, links: Links, current: str | None, reason: str) -> dict[str, Any]:
    """Rank 0's decision (module doc), as a JSON-able dict."""
    if auto.plan_profile is None:
        raise InvalidArgumentError(f"{auto._where}: no profile to plan from")
    entries = make_plan(auto.candidates, auto.plan_profile, links)
    best = recommend(entries, auto.accept)
    if best is None:
        raise InvalidArgumentError(
            f"{auto._where}: no candidate strategy has a cost model whose convergence flags the options "
            f"accept ({len(entries)} candidates; relax max_local_steps/max_compression/max_staleness or only=)"
        )
    pred = {e.spec: e.prediction for e in entries if e.prediction is not None}
    spec = best
    cur = pred.get(current) if current is not None else None
    if (
        cur is not None
        and current is not None
        and pred[best].iteration_s > (1 - auto.min_gain) * cur.iteration_s
    ):
        spec = current  # not enough faster to pay for a switch
    p = pred[spec]
    accepted = [e for e in entries if e.prediction is not None and auto.accept.accepts(e.prediction)]
    runner = next((e for e in accepted if e.spec != spec), None)
    why = (
        f"{spec}: predicted {p.iteration_s * 1e3:.1f} ms per step on {links.label or 'the links'} "
        f"({p.compute_s * 1e3:.1f} compute + {p.compress_s * 1e3:.1f} compression + "
        f"{p.comm_s * 1e3:.1f} communication not overlapped)"
    )
    if spec != best:
        why += f"; kept: {best} is predicted {pred[best].iteration_s * 1e3:.1f} ms, less than {auto.min_gain:.0%} faster"
    elif runner is not None and runner.prediction is not None:
        why += f"; next: {runner.spec} at {runner.prediction.iteration_s * 1e3:.1f} ms"
    refused = sum(1 for e in entries if e.prediction is not None) - len(accepted)
    if refused:
        why += f"; {refused} faster or slower candidates refused by the convergence limits"
    return {
        "reason": reason,
        "spec": spec,
        "recommended": best,
        "predicted_ms": p.iteration_s * 1e3,
        "local_steps": p.local_steps,
        "current_ms": None if cur is None else cur.iteration_s * 1e3,
        "why": why,
        "links": links_json(links),
        "top": [
            {"spec": e.spec, **e.prediction.to_json()} for e in accepted[:SHOWN] if e.prediction is not None
        ],
    }


def choose(auto: AutoStrategy, links: Links, current: str | None, reason: str) -> dict[str, Any]:
    """Collective: rank 0's decision (:func:`_decide`) on every rank; its error raised on every rank."""
    from lowband.runtime import current as runtime_current
    from lowband.strategies.digest import exchange_text

    g = auto.group
    # every rank predicts (the operations it times run beside the others', as in training, where ranks
    # share cores), rank 0's decision is every rank's
    try:
        text = json.dumps({"decision": _decide(auto, links, current, reason)})
    except InvalidArgumentError as e:
        text = json.dumps({"error": str(e)})
    if g.size > 1:
        timeout = runtime_current(auto._where).config.timeout
        text = exchange_text(g, text, f"{auto._where}: the plan's choice", timeout)[0]
    got = json.loads(text)
    if "error" in got:
        raise InvalidArgumentError(got["error"] if g.rank == 0 else f"{got['error']} (rank 0's plan)")
    out: dict[str, Any] = got["decision"]
    return out


def build(auto: AutoStrategy, spec: str) -> Strategy:
    """``spec`` built on the auto strategy's model, optimizer factory and group (collective); after the
    first step, with the strategy's :attr:`~lowband.strategies.Strategy.mid_run_options` under the
    spec's own."""
    from lowband.strategies.registry import STRATEGIES, make_strategy, parse_strategy_spec

    name, options = parse_strategy_spec(spec)
    if auto.steps > 0:
        options = {**getattr(STRATEGIES.get(name), "mid_run_options", {}), **options}
    inner = make_strategy(
        name, auto.local_module, auto._make, auto.group,
        broadcast_init=False, on_nonfinite=auto._nonfinite, accumulate=auto._accumulate, **options,
    )  # fmt: skip
    return inner


def base_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under wrappers that keep it as ``optim`` (torch's PostLocalSGDOptimizer)."""
    while isinstance(getattr(opt, "optim", None), torch.optim.Optimizer):
        opt = opt.optim  # type: ignore[attr-defined]
    return opt


def refresh_config(auto: AutoStrategy, inner: Strategy) -> None:
    """``inner``'s agreed configuration with the common options ``auto`` forwarded after building it."""
    from lowband.strategies.digest import strategy_config
    from lowband.strategies.registry import STRATEGIES, parse_strategy_spec

    if auto.spec is None:
        return
    name, options = parse_strategy_spec(auto.spec)
    common = {"on_nonfinite": auto._nonfinite, "accumulate": auto._accumulate}
    inner.agreed_config = strategy_config(
        name, STRATEGIES.get(name), {**options, **common}, auto.local_module
    )


def _averaged_optimizer_state(opt: torch.optim.Optimizer, group: Group) -> dict[str, Any]:
    """``opt``'s state dict with every floating-point tensor averaged over the ranks (collective; one
    allreduce per dtype, in the state's order, which is the same on every rank)."""
    sd = opt.state_dict()
    tensors = [t for s in sd["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    floats = [t for t in tensors if t.is_floating_point() and t.dim() > 0]
    for dtype in sorted({t.dtype for t in floats}, key=str):
        ts = [t for t in floats if t.dtype == dtype]
        flat = comm.allreduce(torch.cat([t.reshape(-1) for t in ts]), group=group)
        pos = 0
        for t in ts:
            t.copy_(flat[pos : pos + t.numel()].view_as(t))
            pos += t.numel()
    return sd


def _same_layout(a: dict[str, Any], b: torch.optim.Optimizer) -> bool:
    groups = b.state_dict().get("param_groups")
    if not isinstance(groups, list):
        return False
    return len(a["param_groups"]) == len(groups) and all(
        len(x["params"]) == len(y["params"]) for x, y in zip(a["param_groups"], groups)
    )


def switch(auto: AutoStrategy, spec: str) -> dict[str, Any]:
    """Replace the running strategy by ``spec`` with the consensus model and optimizer state (module doc;
    collective, every rank at the same step). Returns what was carried over and what ended."""
    old = auto.chosen()
    old.synchronize()
    model_sd = old.average_state_dict()
    old_opt = base_optimizer(old.optimizer)
    opt_type = type(old_opt)
    opt_sd = old_opt.state_dict()
    standard = isinstance(opt_sd.get("state"), dict) and isinstance(opt_sd.get("param_groups"), list)
    if standard and auto.group.size > 1:
        opt_sd = _averaged_optimizer_state(old_opt, auto.group)
    ended = sorted(k for k, v in old.extra_state().items() if v not in (None, {}, []))
    old.close()
    auto.local_module.load_state_dict(model_sd)
    new = auto._install(spec)
    new_opt = base_optimizer(new.optimizer)
    carried = (
        standard and type(new_opt) is opt_type and _same_layout(opt_sd, new_opt) and bool(opt_sd["state"])
    )
    if carried:
        new_opt.load_state_dict(opt_sd)
    return {"model": "consensus", "optimizer_state": "averaged" if carried else "fresh", "ended": ended}


class FirstForward(nn.Module):
    """What ``auto``'s :attr:`~AutoStrategy.module` is until the choice: the model (as ``module``, as
    DDP's wrapper holds it). Its first training forward (gradients on, the model in training mode)
    profiles the model on a replay of itself (:func:`lowband.strategies.replay.output_loss`), chooses
    and builds the strategy, then runs through the chosen strategy's module; every forward after that,
    and any forward through a reference kept to this module, goes to the chosen strategy's module."""

    def __init__(self, auto: AutoStrategy) -> None:
        super().__init__()
        self.module = auto.local_module
        self._auto = [auto]  # a list: not registered as a submodule, no reference cycle through modules

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        auto = self._auto[0]
        if auto.inner is None:
            if not (torch.is_grad_enabled() and self.module.training):
                return self.module(*args, **kwargs)  # evaluation before training: the plain model
            where = auto._where

            def replay(m: nn.Module) -> torch.Tensor:
                return output_loss(m(*args, **kwargs), where)

            auto._choose_first(None, replay)
        return auto.chosen().module(*args, **kwargs)
