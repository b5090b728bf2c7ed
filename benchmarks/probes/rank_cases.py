"""What a rank does for each kind of case; each returns a JSON-able report of this rank (an error is
reported by the caller, :mod:`.rank`). Runs inside a rank of ``lowband run`` (``lowband.init`` done)."""

from __future__ import annotations

import copy
import io
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lowband
from benchmarks.probes.common import (
    Case,
    TiedLM,
    finite,
    flat,
    state_finite,
    tensors,
    tied_loss,
    tied_opt,
    tied_oracle,
)
from lowband.checkpoint import Checkpointer
from lowband.strategies import make_strategy
from lowband.strategies.base import Strategy
from tests import embedding_model as em

VALUES = {"nan": math.nan, "inf": math.inf}


def _strategy(case: Case, model: nn.Module, opt: Any = em.sgd, **extra: Any) -> Strategy:
    return make_strategy(case["strategy"], model, opt, **{**case.get("options", {}), **extra})


def nonfinite(case: Case, out: dict[str, Any]) -> None:
    """``steps`` steps of the two-table model; at ``bad_step`` the ranks in ``bad`` get a non-finite
    gradient in one bias (families 1 and 5). What the caller needs: the model around the bad step, at
    the end, the skip count, the state's non-finite tensors; an error is raised to the caller."""
    m = em.model(seed=5)
    rank, steps, bad_step = lowband.rank(), case.get("steps", 4), case.get("bad_step", 2)
    s = _strategy(case, m, on_nonfinite=case["policy"])
    bias = m.mlp[2].bias
    assert isinstance(bias, torch.Tensor)
    try:
        for step in range(steps):
            b = em.batch(rank, step)
            v = VALUES[case["value"]] if step == bad_step and rank in case["bad"] else 0.0

            def loss_fn(mod: nn.Module, b: Any = b, v: float = v) -> torch.Tensor:
                loss: torch.Tensor = em.loss(mod, b) + v * bias.sum()  # every rank: one graph
                return loss

            if step == bad_step:
                out["before"] = flat(m)
            s.train_step(loss_fn)
            if step == bad_step:
                out["after"] = flat(m)
        s.synchronize()
        out["state_bad"] = state_finite(s.state_dict())
        out["skipped"] = s.nonfinite.skipped if s.nonfinite is not None else -1
        _note_replicas(out, s)
    except BaseException:
        _note_model(out, m)
        raise
    finally:
        s.close()
    _note_model(out, m)


def _note_model(out: dict[str, Any], m: nn.Module) -> None:
    out["final"] = flat(m)
    out["finite"] = finite(out["final"])


def _note_replicas(out: dict[str, Any], s: Strategy) -> None:
    """The parameters every rank holds a copy of (sharded ones differ by design): what in_sync is about."""
    out["in_sync"] = s.in_sync()
    out["replicated"] = [
        v for _, p in s.replicated_parameters() for v in p.detach().reshape(-1).double().tolist()
    ]


def tied(case: Case, out: dict[str, Any]) -> None:
    """Family 2: the tied model trained 3 steps, then a checkpoint round trip into a new one."""
    r, steps = lowband.rank(), 3
    m = TiedLM()
    s = _strategy(case, m, tied_opt)
    try:
        for k in range(steps):
            s.train_step(lambda mod, k=k: tied_loss(mod, r, k))  # type: ignore[misc]
        s.synchronize()
        buf = io.BytesIO()
        torch.save(s.state_dict(), buf)
    finally:
        s.close()
    m2 = TiedLM()
    s2 = _strategy(case, m2, tied_opt)
    try:
        s2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    finally:
        s2.close()
    out.update(final=flat(m), loaded_equal=flat(m2) == flat(m))
    for key, mod in (("tie", m), ("tie_loaded", m2)):
        e, d = mod.emb.weight, mod.dec.weight
        out[key] = [e is d, float((e.detach() - d.detach()).abs().max())]
    if case.get("exact"):
        out["oracle_err"] = max(abs(a - b) for a, b in zip(out["final"], tied_oracle(lowband.size(), steps)))


def mismatch(case: Case, out: dict[str, Any]) -> None:
    """Family 3: this rank's options (``per_rank``) differ from another's; two steps if it builds."""
    r = lowband.rank()
    opts = case["per_rank"][r]
    m = em.model(seed=5)
    s = make_strategy(case["strategy"], m, em.sgd, **opts)
    try:
        for k in range(2):
            s.train_step(em.loss_fn(r, k))
        s.synchronize()
    finally:
        s.close()
    out.update(final=flat(m), in_sync=s.in_sync())


def _train(s: Strategy, start: int, stop: int) -> None:
    r = lowband.rank()
    for k in range(start, stop):
        s.train_step(em.loss_fn(r, k))
    s.synchronize()


def ckpt_save(case: Case, out: dict[str, Any]) -> None:
    """Family 4, first launch: 3 steps, then this rank's state_dict to a file and a Checkpointer set."""
    folder = Path(case["folder"])
    m = em.model(seed=5)
    s = _strategy(case, m)
    try:
        _train(s, 0, 3)
        torch.save(s.state_dict(), folder / f"rank{lowband.rank()}.pt")
        Checkpointer(folder / "sets", every=3, sigterm=False).maybe_save(s, 3)
    finally:
        s.close()
    out["final"] = flat(m)


def _saved(folder: Path, n: int) -> list[dict[str, Any]]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(n)]


def _differs(states: list[dict[str, Any]]) -> list[str]:
    """The tensor paths whose values differ between the saved ranks (per-rank state)."""
    per = [dict(tensors(s)) for s in states]
    out = []
    for path, t in per[0].items():
        others = [p.get(path) for p in per[1:]]
        if any(o is None or o.shape != t.shape or not torch.equal(o, t) for o in others):
            out.append(path)
    return out


def ckpt_direct(case: Case, out: dict[str, Any]) -> None:
    """Family 4: rank r of this run loads rank r's state_dict of the ``saved_ranks``-rank run as it is."""
    folder, r = Path(case["folder"]), lowband.rank()
    states = _saved(folder, case["saved_ranks"])
    out["differs"] = _differs(states)[:5]
    m = em.model(seed=5)
    s = _strategy(case, m)
    try:
        s.load_state_dict(copy.deepcopy(states[r]))
        out["restored"] = all(
            torch.equal(v, states[r]["model"][k])
            for k, v in m.state_dict().items()
            if k in states[r]["model"]
        )
        _train(s, 3, 5)
        _note_replicas(out, s)
    finally:
        s.close()
    _note_model(out, m)


def ckpt_resume(case: Case, out: dict[str, Any]) -> None:
    """Family 4: lowband.checkpoint.Checkpointer resumes the 3-rank set at this run's size. Where it
    resumes: values equal on every saved rank are restored on every rank, per-rank values keep their
    sum over the ranks (error feedback re-split), and training goes on finite."""
    folder, r, n = Path(case["folder"]), lowband.rank(), lowband.size()
    m = em.model(seed=5)
    s = _strategy(case, m)
    try:
        out["start"] = Checkpointer(folder / "sets", every=100, sigterm=False).resume(s)
        mine = folder / f"resumed-{n}-rank{r}.pt"
        torch.save(s.state_dict(), mine)
        _wait([folder / f"resumed-{n}-rank{q}.pt" for q in range(n)], 120)
        saved, loaded = (
            _saved(folder, case["saved_ranks"]),
            [torch.load(folder / f"resumed-{n}-rank{q}.pt", weights_only=True) for q in range(n)],
        )
        out["violations"] = _conserved(saved, loaded)[:5]
        _train(s, out["start"], out["start"] + 2)
        _note_replicas(out, s)
    finally:
        s.close()
    _note_model(out, m)


def _conserved(saved: list[dict[str, Any]], loaded: list[dict[str, Any]]) -> list[str]:
    before = [dict(tensors(s)) for s in saved]
    after = [dict(tensors(s)) for s in loaded]
    bad = []
    for path, t in before[0].items():
        if not t.is_floating_point() or any(path not in a or a[path].shape != t.shape for a in after):
            continue  # re-cut (sharded) or not kept: the training after it is what is checked
        if all(torch.equal(b[path], t) for b in before[1:]):
            if not all(torch.equal(a[path], t) for a in after):
                bad.append(f"{path}: equal on every saved rank, not restored")
        elif not torch.allclose(
            torch.stack([b[path] for b in before]).sum(0),
            torch.stack([a[path] for a in after]).sum(0),
            atol=1e-9,
        ):
            bad.append(f"{path}: per-rank values whose sum over the ranks changed")
    return bad


def ckpt_option(case: Case, out: dict[str, Any]) -> None:
    """Family 4: a state saved under ``saved_options`` loaded by a strategy built with ``options``."""
    r = lowband.rank()
    s = make_strategy(case["strategy"], em.model(seed=5), em.sgd, **case["saved_options"])
    try:
        _train(s, 0, 3)
        buf = io.BytesIO()
        torch.save(s.state_dict(), buf)
    finally:
        s.close()
    m = em.model(seed=5)
    s = _strategy(case, m)
    try:
        s.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        _train(s, 3, 5)
    finally:
        s.close()
    out["rank"] = r
    _note_model(out, m)


def _wait(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"probe: waited {timeout:g} s for {[str(p) for p in paths]}")
        time.sleep(0.02)


def signalled(case: Case, folder: Path) -> dict[str, Any]:
    """Family 6: train; after 3 steps the victim sends itself ``sig`` (SIGKILL or SIGSTOP); a survivor
    that raises writes the time (``raised{rank}``) and raises on (the launcher names the cause)."""
    r = lowband.rank()
    m = em.model(seed=5)
    s = _strategy(case, m)
    try:
        for k in range(100_000):
            s.train_step(em.loss_fn(r, k % 8))
            if k == 2 and r == case["victim"]:
                time.sleep(0.2)
                os.kill(os.getpid(), getattr(signal, case["signal"]))
            time.sleep(0.005)
    except lowband.LowbandError as exc:
        tmp = folder / f".raised{r}"  # renamed whole: a rank stopped mid-write leaves no torn file
        tmp.write_text(f"{time.time()!r}\n{type(exc).__name__}: {exc}"[:2000])
        tmp.replace(folder / f"raised{r}")
        raise
    return {}


KINDS: dict[str, Callable[[Case, dict[str, Any]], None]] = {
    "nonfinite": nonfinite,
    "tied": tied,
    "mismatch": mismatch,
    "ckpt-save": ckpt_save,
    "ckpt-direct": ckpt_direct,
    "ckpt-resume": ckpt_resume,
    "ckpt-option": ckpt_option,
}
