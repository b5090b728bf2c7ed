"""The non-finite policy of every registered strategy (lowband.optim.nonfinite): a NaN or an Inf in one
rank's (or every rank's) gradient raises NonFiniteError on every rank naming the rank and the step
(on_nonfinite="raise", the default), or skips the step on every rank leaving models, optimizers and
residuals untouched (on_nonfinite="skip"); never a hang, a timeout, a poisoned residual or a NaN model.

Strategies built on torch DDP need real processes (DDP refuses thread ranks); the others run as threads.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import lowband
from lowband.errors import InvalidArgumentError, NonFiniteError
from lowband.strategies import make_strategy, strategy_names
from lowband.testing import run_processes, run_threads
from tests import embedding_model as em

BAD_STEP, STEPS = 2, 4
PROCESS_ONLY = {"ddp", "powersgd", "ddp-sparse"}
#: strategies that keep a gradient-stage reducer with state: residuals compared across a skipped step
STAGE = ["stage", "compressed", "gtopk", "gs-sgd", "topk-allgather", "sketched-sgd"]
VALUES = {"nan": math.nan, "inf": math.inf}
#: strategies whose step sees only DDP's averaged gradients (sparse buckets: no per-rank check)
AVERAGED = {"ddp-sparse"}
#: local-step strategies: the ranks agree asynchronously (raised at a later step, or by synchronize()),
#: and under skip only the rank that held the value drops its local step (dreamddp and its variants,
#: stepping layers in backward: the units that held it, zeroed before their layers were stepped)
DEFERRED = {"localsgd", "diloco", "dreamddp", "plsgd-enp", "flsgd-overlap"}
#: auto takes its choice's policy: among the compressed ones, whichever is fastest here
OPTIONS: dict[str, dict[str, Any]] = {"auto": {"only": "compressed"}}


def _train(name: str, policy: str, kind: str, bad: tuple[int, ...]) -> dict[str, Any]:
    """Train ``STEPS`` steps; at ``BAD_STEP`` the ranks in ``bad`` get a non-finite gradient in one
    dense parameter. Returns what happened on this rank."""
    m = em.model(seed=5)
    try:
        s = make_strategy(name, m, em.sgd, on_nonfinite=policy, **OPTIONS.get(name, {}))
    except InvalidArgumentError as exc:
        return {"refused": str(exc)}
    rank = lowband.rank()
    out: dict[str, Any] = {"losses": []}
    bias = m.mlp[2].bias
    assert isinstance(bias, torch.Tensor)
    try:
        for step in range(STEPS):
            b = em.batch(rank, step)
            value = VALUES[kind] if step == BAD_STEP and rank in bad else 0.0

            def loss_fn(mod: torch.nn.Module, b: Any = b, value: float = value) -> torch.Tensor:
                extra = value * bias.sum()  # on every rank: the same autograd graph
                return em.loss(mod, b) + extra

            if step == BAD_STEP:
                out["before"] = em.flat(m).tolist()
            out["losses"].append(s.train_step(loss_fn))
            if step == BAD_STEP:
                out["after"] = em.flat(m).tolist()
        s.synchronize()
    except NonFiniteError as exc:
        out["error"] = str(exc)
        out["step"] = s.steps
        return out
    finally:
        s.close()
    out["flat"] = em.flat(m).tolist()  # lists: processes return them through a queue
    out["skipped"] = s.nonfinite.skipped if s.nonfinite is not None else -1
    out["in_sync"] = s.in_sync()
    return out


def _all(names: list[str], policy: str, kind: str, bad: tuple[int, ...]) -> dict[str, Any]:
    return {n: _train(n, policy, kind, bad) for n in names}


def _check(results: list[dict[str, Any]], policy: str, bad: tuple[int, ...]) -> list[str]:
    failures = []
    for name in results[0]:
        per = [r[name] for r in results]
        if any("refused" in p for p in per):
            if not all("refused" in p for p in per) or policy != "skip":
                failures.append(f"{name}: refused {[p.get('refused') for p in per]}")
            continue
        if policy == "raise":
            for r, p in enumerate(per):
                if "error" not in p:
                    failures.append(f"{name}: rank {r} did not raise")
                    continue
                named = all(f"rank {b} " in p["error"] for b in bad)
                if name in AVERAGED:  # the source is not known: said so
                    named = "on every rank alike: torch DDP averaged it" in p["error"]
                late = name in DEFERRED and BAD_STEP < p["step"] <= STEPS
                if (
                    not named
                    or f"at step {BAD_STEP}" not in p["error"]
                    or not (p["step"] == BAD_STEP or late)
                ):
                    failures.append(
                        f"{name}: rank {r}'s error does not name {bad}, step {BAD_STEP}: {p['error']}"
                    )
            continue
        for r, p in enumerate(per):
            if "error" in p:
                failures.append(f"{name}: rank {r} raised under skip: {p['error']}")
            elif p["skipped"] != (r in bad if name in DEFERRED else 1) or not all(
                math.isfinite(v) for v in p["flat"]
            ):
                failures.append(
                    f"{name}: rank {r}: skipped {p['skipped']} steps, finite {all(math.isfinite(v) for v in p['flat'])}"
                )
    return failures


CASES = [(policy, kind) for policy in ("raise", "skip") for kind in ("nan", "inf")]


@pytest.mark.parametrize(("policy", "kind"), CASES)
def test_every_strategy_on_threads(policy: str, kind: str) -> None:
    names = [n for n in strategy_names() if n not in PROCESS_ONLY]
    failures: list[str] = []
    for bad in ((1,), (0, 1)):
        results = run_threads(_all, 2, names, policy, kind, bad, timeout=120)
        failures += [f"bad ranks {bad}: {f}" for f in _check(results, policy, bad)]
    assert not failures, "\n".join(failures)


def _ddp_all() -> list[tuple[str, str, tuple[int, ...], dict[str, Any]]]:
    names = sorted(PROCESS_ONLY)
    return [
        (policy, kind, bad, _all(names, policy, kind, bad))
        for policy, kind in CASES
        for bad in ((1,), (0, 1))
    ]


def test_ddp_strategies_in_processes() -> None:
    results = run_processes(_ddp_all, 2, timeout=240, backend="gloo", device="cpu")
    failures: list[str] = []
    for i, (policy, kind, bad, _) in enumerate(results[0]):
        per_rank = [r[i][3] for r in results]
        failures += [f"{policy}/{kind}/{bad}: {f}" for f in _check(per_rank, policy, bad)]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", STAGE)
def test_skip_leaves_models_and_residuals_untouched(name: str) -> None:
    def fn() -> dict[str, Any]:
        m = em.model(seed=5)
        s = make_strategy(name, m, em.sgd, on_nonfinite="skip")
        rank = lowband.rank()
        states = []
        flats = []
        bias = m.mlp[2].bias
        assert isinstance(bias, torch.Tensor)
        for step in range(STEPS):
            b = em.batch(rank, step)
            value = math.nan if step == BAD_STEP and rank == 1 else 0.0

            def loss_fn(mod: torch.nn.Module, b: Any = b, v: float = value) -> torch.Tensor:
                return em.loss(mod, b) + v * bias.sum()

            s.train_step(loss_fn)
            s.synchronize()
            flats.append(em.flat(m))
            states.append(repr(s.extra_state()["stage"]["reducer"]))
        s.close()
        return {"flats": flats, "states": states, "skipped": s.nonfinite.skipped if s.nonfinite else -1}

    for r in run_threads(fn, 2, timeout=60):
        assert r["skipped"] == 1
        assert torch.equal(r["flats"][BAD_STEP], r["flats"][BAD_STEP - 1]), "the skipped step moved the model"
        assert r["states"][BAD_STEP] == r["states"][BAD_STEP - 1], (
            "the skipped step changed the reducer state"
        )
        assert not torch.equal(r["flats"][BAD_STEP + 1], r["flats"][BAD_STEP]), (
            "training stopped after the skip"
        )
        assert torch.isfinite(r["flats"][-1]).all()


def _powersgd_after_compression(policy: str) -> dict[str, Any]:
    """PowerSGD compressing from step 2 (its error memory in use); rank 1's gradient NaN at step 4."""
    m = em.model(seed=5)
    s = make_strategy("powersgd", m, em.sgd, start_iter=2, on_nonfinite=policy)
    bias = m.mlp[2].bias
    out: dict[str, Any] = {}
    try:
        for step in range(6):
            value = math.nan if step == 4 and lowband.rank() == 1 else 0.0
            b = em.batch(lowband.rank(), step)
            if step == 4:
                out["memory_before"] = {k: v.tolist() for k, v in s.state.error_dict.items()}
                out["params_before"] = em.flat(m).tolist()
            s.train_step(lambda mod, b=b, value=value: em.loss(mod, b) + value * bias.sum())
            if step == 4:
                out["memory_after"] = {k: v.tolist() for k, v in s.state.error_dict.items()}
                out["params_after"] = em.flat(m).tolist()
    except NonFiniteError as exc:
        out["error"] = str(exc)
    finally:
        s.close()
    out["memory_end"] = {k: v.tolist() for k, v in s.state.error_dict.items()}
    return out


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_powersgd_memory_never_sees_a_nan(policy: str) -> None:
    """The comm hook checks each bucket before torch's PowerSGD hook: no NaN reaches its error memory;
    under skip the memory and the parameters are those before the step."""
    res = run_processes(_powersgd_after_compression, 2, policy, timeout=120, backend="gloo", device="cpu")
    for r, out in enumerate(res):
        assert out["memory_before"], "PowerSGD compressed before the bad step"
        memory = [v for vs in out["memory_end"].values() for v in vs]
        assert all(math.isfinite(v) for v in memory), f"rank {r}: a non-finite value in the error memory"
        if policy == "raise":
            assert "rank 1 " in out["error"] and "at step 4" in out["error"], out["error"]
        else:
            assert "error" not in out
            assert out["memory_after"] == out["memory_before"] and out["params_after"] == out["params_before"]


def _guard_on_cpu() -> list[Any]:
    from lowband.optim.nonfinite import NonFiniteGuard

    guard = NonFiniteGuard("raise", lowband.world(), where="here", step=lambda: 0)
    big, empty = torch.tensor([3e38, 3e38]), torch.empty(0)  # float32: their sum overflows, they are finite
    guard.check_([big, empty], "finite")
    bad = torch.tensor([1.0, math.nan, 2.0], dtype=torch.float64)
    guard.check_([bad, torch.ones(2)], "bad")
    flags = [float(f) for f in guard._flags]
    return [flags, big.tolist(), bad.tolist()]


def test_cpu_check_reads_once_and_writes_only_a_bad_unit() -> None:
    """Large finite values whose sum overflows are not flagged (a non-finite sum is confirmed element by
    element), an empty gradient is fine, and only a flagged unit is zeroed."""
    flags, big, bad = run_threads(_guard_on_cpu, 1)[0]
    assert flags == [0.0, 1.0] and big == torch.tensor([3e38, 3e38]).tolist() and bad == [0.0, 0.0, 0.0]


def _embrace_row_nan(schedule: str, kind: str) -> dict[str, Any]:
    """embrace with rank 1's gradient rows of the input table non-finite at BAD_STEP (the dense layers'
    gradients stay finite: the value enters through a hook on the lookup's output)."""
    m = em.model(seed=5)
    s = make_strategy("embrace", m, em.adam, schedule=schedule)
    rank = lowband.rank()
    out: dict[str, Any] = {}
    try:
        for step in range(STEPS):
            ids, cand = em.batch(rank, step)
            v = VALUES[kind] if step == BAD_STEP and rank == 1 else 0.0

            def loss_fn(
                mod: torch.nn.Module, ids: torch.Tensor = ids, cand: torch.Tensor = cand, v: float = v
            ) -> torch.Tensor:
                e = mod.emb(ids)
                if v:
                    e.register_hook(lambda g: g + v)
                h = mod.mlp(e.flatten(1))
                logits = (mod.out_emb(cand) @ h.unsqueeze(-1)).squeeze(-1)
                return torch.nn.functional.cross_entropy(
                    logits, torch.zeros(logits.shape[0], dtype=torch.int64)
                )

            s.train_step(loss_fn)
        s.synchronize()
    except NonFiniteError as exc:
        out["error"], out["step"] = str(exc), s.steps
    finally:
        s.close()
    out["finite"] = bool(torch.isfinite(em.flat(m)).all())
    return out


@pytest.mark.parametrize("schedule", ["hybrid", "horizontal", "vertical", "2d"])
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_embrace_checks_table_rows_before_they_travel(schedule: str, kind: str) -> None:
    """A rank's non-finite gradient rows are caught before the all-to-all sends them to their owners:
    the error names that rank (the owners' shards never see the value), on every rank."""
    for r, out in enumerate(run_threads(_embrace_row_nan, 2, schedule, kind, timeout=60)):
        err = out.get("error", "")
        assert "rank 1 (unit 'emb (embedding rows)')" in err and "rank 0 " not in err, (r, err)
        assert out["step"] == BAD_STEP and out["finite"], (r, out)


def _count_agreements(name: str, policy: str) -> None:
    m = em.model(seed=5)
    s = make_strategy(name, m, em.sgd, on_nonfinite=policy)
    try:
        for step in range(6):
            b = em.batch(lowband.rank(), step)
            s.train_step(lambda mod, b=b: em.loss(mod, b))
        s.state_dict()  # settles the last step's agreement
    finally:
        s.close()


@pytest.mark.parametrize("name", sorted(DEFERRED))
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_local_steps_never_wait_for_the_agreement(
    name: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local steps: no blocking agreement per step (a round trip per inner step on a WAN); under raise one
    asynchronous allreduce per step, read later; under skip nothing is exchanged at all (diloco refuses skip)."""
    import threading

    from lowband.optim import nonfinite

    if policy == "skip" and name == "diloco":
        refused = run_threads(_train, 2, name, policy, "nan", (1,), timeout=60)  # no_skip_reason
        assert all("cannot skip a step" in r["refused"] for r in refused), refused
        return
    counts = {"blocking": 0, "async": 0}
    lock = threading.Lock()

    def counted(kind: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with lock:
                counts[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(nonfinite, "allreduce", counted("blocking", nonfinite.allreduce))
    monkeypatch.setattr(nonfinite, "iallreduce", counted("async", nonfinite.iallreduce))
    run_threads(_count_agreements, 2, name, policy, timeout=60)
    assert counts["blocking"] == 0
    assert counts["async"] == (2 * 6 if policy == "raise" else 0)
