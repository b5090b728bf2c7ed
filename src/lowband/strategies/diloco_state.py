"""What the ``diloco`` strategy saves beyond model and optimizer (:meth:`DiLoCoStrategy.extra_state`)
and how it is restored: the global parameters, the outer optimizers, the error-feedback memory, the inner
step count and the exchanges in flight (completed, kept with the step they are due at)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowband.comm.handle import completed
from lowband.errors import InvalidArgumentError

if TYPE_CHECKING:
    from lowband.strategies.diloco import DiLoCoStrategy


def extra_state(s: DiLoCoStrategy) -> dict[str, Any]:
    pending = {
        k: (due, None if h is None else [t.detach().clone() for t in h.wait()])
        for k, (due, h) in s.pending.items()
    }
    return {
        "inner_done": s.inner_done,
        "outer_steps": s.outer_steps,
        "sent": list(s.sent),
        "global": None if s.global_params is None else [g.detach().clone() for g in s.global_params],
        "outers": [o.state_dict() for o in s.outers],
        "reducer": s.reducer.state_dict(),
        "pending": pending,
        "fragments": [list(f) for f in s.fragments],
        "period_start": s.period_start,
        "h": s.h,
        "machine_steps": s.machine_steps,
        "step_seconds": list(s._step_seconds),
        "auto_log": list(s.auto_log),
    }


def load_extra_state(s: DiLoCoStrategy, state: dict[str, Any]) -> None:
    where = f"strategy 'diloco' on rank {s.group.world_rank}"
    s._load_auto_state(where, state)
    s.inner_done = int(state.get("inner_done", 0))
    s.outer_steps = int(state.get("outer_steps", 0))
    s.sent = [int(x) for x in state.get("sent", [s.outer_steps] * len(s.fragments))]
    h = s.h
    s.period_start = int(state.get("period_start", s.inner_done - s.inner_done % h))
    if "reducer" in state:
        s.reducer.load_state_dict(state["reducer"])
    glob = state.get("global")
    s.pending = {}
    if glob is None:
        s.global_params, s.outers = None, []
        return
    shapes = [tuple(q.shape) for q in s.params]
    if [tuple(g.shape) for g in glob] != shapes:
        raise InvalidArgumentError(
            f"{where}: the checkpoint's global parameters have shapes {[tuple(g.shape) for g in glob]}, "
            f"this model's {shapes}"
        )
    s._take_global([g.to(q.device, q.dtype) for g, q in zip(glob, s.params, strict=True)])
    outers = state.get("outers")
    if outers is None and state.get("outer") is not None:
        outers = [state["outer"]]  # a checkpoint of the whole-model outer loop (one fragment)
    if outers is not None:
        if len(outers) != len(s.outers):
            raise InvalidArgumentError(
                f"{where}: the checkpoint has {len(outers)} fragments' outer optimizers, this run "
                f"{len(s.outers)} fragments"
            )
        for o, sd in zip(s.outers, outers, strict=True):
            o.load_state_dict(sd)
    for k, (due, values) in dict(state.get("pending", {})).items():
        if values is None:
            s.pending[int(k)] = (int(due), None)
            continue
        dev = [s.params[i] for i in s.fragments[int(k)]]
        got = [v.to(q.device, q.dtype) for v, q in zip(values, dev, strict=True)]
        restored = completed(got, op="diloco", name=f"fragment{k}", rank=s.group.rank)
        s.pending[int(k)] = (int(due), restored)
