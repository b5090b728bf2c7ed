"""Decentralized optimizers (ATC, AWC, gradient allreduce, hierarchical, win-put) and their strategies,
against a float64 single-process simulation that rebuilds every rank's model and data and applies the
same torch optimizer per rank.

ATC: x_i <- sum_j W_ij (x_j - lr g_j(x_j));  AWC: x_i <- sum_j W_ij x_j - lr g_i(x_i) (the inner
optimizer applied at the combined iterate); gradient allreduce: S-SGD with the mean gradient.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.decentral import strategies as decentral_strategies
from lowband.decentral.optimizers import (
    AdaptThenCombineOptimizer,
    AdaptWithCombineOptimizer,
    CommunicationType,
    GradientAllreduceOptimizer,
    WinPutOptimizer,
)
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.strategies import make_strategy
from lowband.testing import RankFailures, run_threads
from lowband.topology import DynamicTopology, Topology, exponential_two, ring

NR = CommunicationType.neighbor_allreduce
AR = CommunicationType.allreduce
HNR = CommunicationType.hierarchical_neighbor_allreduce
STEPS = 4
Factory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
FACTORIES: dict[str, Factory] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.02),
}
STYLES = {"atc": AdaptThenCombineOptimizer, "awc": AdaptWithCombineOptimizer}


_SEED_LOCK = threading.Lock()  # ranks are threads sharing torch's global generator


def _model(seed: int) -> nn.Module:
    with _SEED_LOCK:
        torch.manual_seed(100 + seed)
        return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(
        6, 2, generator=g, dtype=torch.float64
    )


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((m(b[0]) - b[1]) ** 2).mean()


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def _topology(name: str, n: int, local_size: int = 1) -> Topology | DynamicTopology:
    return decentral_strategies.TOPOLOGIES[name](n, local_size)


# -- the oracle --------------------------------------------------------------------------------------


def _weights(kind: CommunicationType, topo: Any, rnd: int, n: int, local_size: int) -> torch.Tensor:
    """The combination matrix of one round over ranks."""
    if kind is AR:
        return torch.full((n, n), 1.0 / n, dtype=torch.float64)
    if kind is CommunicationType.empty:
        return torch.eye(n, dtype=torch.float64)
    t = topo.at(rnd) if isinstance(topo, DynamicTopology) else topo
    w = torch.tensor(t.weights, dtype=torch.float64)
    if kind is NR:
        return w
    # hierarchical: machine average, then the machine topology, the same value on every local rank
    machine = torch.arange(n) // local_size
    return w[machine][:, machine] / local_size


def _combine(models: list[nn.Module], w: torch.Tensor) -> None:
    with torch.no_grad():
        params = [list(m.parameters()) for m in models]
        new = [[sum(float(w[i, j]) * params[j][k] for j in range(len(models))) for k in range(len(params[i]))]
               for i in range(len(models))]  # fmt: skip
        for ps, vs in zip(params, new):
            for p, v in zip(ps, vs):
                p.copy_(v)


def _oracle(cfg: dict[str, Any], n: int, local_size: int = 1) -> list[torch.Tensor]:
    models = [_model(r) for r in range(n)]
    opts = [FACTORIES[cfg["opt"]](m.parameters()) for m in models]
    topo = _topology(cfg["topology"], n // local_size if cfg.get("kind") is HNR else n)
    rounds = 0
    for k in range(cfg.get("steps", STEPS)):
        kind = cfg.get("schedule", lambda _k: cfg.get("kind", NR))(k)
        if (k + 1) % cfg.get("period", 1):
            kind = CommunicationType.empty
        w = _weights(kind, topo, rounds, n, local_size)
        for r in range(n):
            opts[r].zero_grad()
            _loss(models[r], _batch(r, k)).backward()  # type: ignore[no-untyped-call]
            if cfg["style"] == "atc":
                opts[r].step()
        _combine(models, w)
        if cfg["style"] == "awc":
            for o in opts:
                o.step()
        rounds += kind in (NR, HNR)
    return [_flat(m) for m in models]


# -- the distributed runs -----------------------------------------------------------------------------


def _train(cfg: dict[str, Any]) -> torch.Tensor:
    r, n = lowband.rank(), lowband.size()
    m = _model(r)
    kind = cfg.get("kind", NR)
    kw: dict[str, Any] = {"communication_type": kind, "num_steps_per_communication": cfg.get("period", 1)}
    kw["broadcast_init"] = False  # the simulation starts every rank from its own model
    topo = _topology(cfg["topology"], n // lowband.local_size() if kind is HNR else n)
    if not cfg.get("explicit"):
        kw["machine_topology" if kind is HNR else "topology"] = topo
    opt = STYLES[cfg["style"]](m, FACTORIES[cfg["opt"]], **kw)
    for k in range(cfg.get("steps", STEPS)):
        if "schedule" in cfg:
            opt.communication_type = cfg["schedule"](k)
        if cfg.get("explicit"):  # BlueFog's Listing 4: this step's weights set by hand (push-pull)
            assert isinstance(topo, DynamicTopology)
            t = topo.at(k)
            opt.self_weight, opt.src_weights = t.self_weight(r), t.src_weights(r)
            opt.dst_weights = t.out_neighbors(r)
        opt.enable_topo_check = k == 0
        opt.zero_grad()
        _loss(m, _batch(r, k)).backward()
        opt.step()
    opt.synchronize()
    return _flat(m)


def _every_other(k: int) -> CommunicationType:
    return AR if k % 2 == 1 else NR


CONFIGS: list[dict[str, Any]] = [
    *({"style": s, "opt": o, "topology": "exp2"} for s in STYLES for o in FACTORIES),
    *({"style": s, "opt": "sgd", "topology": t} for s in STYLES for t in ("ring", "dynamic-exp2")),
    *({"style": s, "opt": "momentum", "topology": "exp2", "schedule": _every_other} for s in STYLES),
    *({"style": s, "opt": "sgd", "topology": "dynamic-exp2", "period": 2, "steps": 6} for s in STYLES),
    *({"style": s, "opt": "momentum", "topology": "dynamic-exp2", "explicit": True} for s in STYLES),
    {"style": "atc", "opt": "adam", "topology": "exp2", "kind": CommunicationType.empty},
]


def _run_configs(configs: list[dict[str, Any]]) -> list[torch.Tensor]:
    return [_train(c) for c in configs]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_atc_awc_match_the_simulation(n: int) -> None:
    results = run_threads(_run_configs, n, CONFIGS, timeout=120)
    for c, cfg in enumerate(CONFIGS):
        want = _oracle(cfg, n)
        for r in range(n):
            err = float((results[r][c] - want[r]).abs().max())
            assert err < 1e-10, f"{cfg} rank {r}: max error {err}"
    if n > 1:  # the combination did something: ranks started apart and are not a local run
        assert not torch.allclose(
            results[0][0], _oracle({**CONFIGS[0], "kind": CommunicationType.empty}, n)[0]
        )


@pytest.mark.parametrize(("n", "local_size"), [(2, 1), (4, 2), (6, 3), (6, 2)])
def test_hierarchical_matches_the_simulation(n: int, local_size: int) -> None:
    configs = [
        {"style": "atc", "opt": "momentum", "topology": "ring", "kind": HNR},
        {"style": "awc", "opt": "sgd", "topology": "dynamic-exp2", "kind": HNR},
    ]
    results = run_threads(_run_configs, n, configs, timeout=120, local_size=local_size)
    for c, cfg in enumerate(configs):
        want = _oracle(cfg, n, local_size)
        for r in range(n):
            assert float((results[r][c] - want[r]).abs().max()) < 1e-10, f"{cfg} rank {r}"
        for r in range(n):  # after ATC's combination every rank of a machine holds the same parameters
            assert cfg["style"] != "atc" or torch.allclose(
                results[r][c], results[r - r % local_size][c], atol=1e-12
            )


# -- gradient allreduce ----------------------------------------------------------------------------------


def _train_gradient_allreduce(passes: int) -> torch.Tensor:
    r = lowband.rank()
    m = _model(0)
    opt = GradientAllreduceOptimizer(m, FACTORIES["momentum"], num_steps_per_communication=passes)
    for k in range(STEPS):
        opt.zero_grad()
        for j in range(passes):
            _loss(m, _batch(r, k * passes + j)).backward()
        opt.step()
    return _flat(m)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("passes", [1, 2])
def test_gradient_allreduce_is_averaged_gradient_sgd(n: int, passes: int) -> None:
    results = run_threads(_train_gradient_allreduce, n, passes, timeout=60)
    m = _model(0)
    opt = FACTORIES["momentum"](m.parameters())
    for k in range(STEPS):
        opt.zero_grad()
        loss = sum(_loss(m, _batch(r, k * passes + j)) for r in range(n) for j in range(passes)) / n
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    for r in range(n):
        assert float((results[r] - _flat(m)).abs().max()) < 1e-10, f"rank {r}"


# -- overlap: where communication is launched and completed ----------------------------------------------


def _in_flight_trace() -> dict[str, list[list[int]]]:
    r = lowband.rank()
    out: dict[str, list[list[int]]] = {}
    m = _model(r)
    atc = AdaptThenCombineOptimizer(m, FACTORIES["sgd"])
    trace = []
    for k in range(2):
        atc.zero_grad()
        y = _loss(m, _batch(r, k))
        trace.append(atc.in_flight())  # the previous iteration's combinations completed by the forward
        y.backward()
        trace.append(atc.in_flight())  # launched from the backward hooks
        atc.step()
    atc.synchronize()
    trace.append(atc.in_flight())
    out["atc"] = trace
    m = _model(r)
    awc = AdaptWithCombineOptimizer(m, FACTORIES["sgd"])
    trace = []
    y = _loss(m, _batch(r, 0))
    trace.append(awc.in_flight())  # launched from the forward pre-hooks
    with torch.no_grad():
        m.eval()
        m(_batch(r, 1)[0])  # evaluation forwards do not communicate
        m.train()
    y.backward()
    awc.step()
    trace.append(awc.in_flight())
    out["awc"] = trace
    ga = GradientAllreduceOptimizer(_model(0), FACTORIES["sgd"])
    _loss(ga.model, _batch(r, 0)).backward()
    out["ga"] = [ga.in_flight()]
    try:
        ga.zero_grad()
    except InvalidArgumentError:
        out["ga"].append([-1])
    ga.step()
    out["ga"].append(ga.in_flight())
    return out


def test_communication_is_launched_from_hooks() -> None:
    for res in run_threads(_in_flight_trace, 3, timeout=60):
        every = [0, 1, 2]
        assert res["atc"] == [[], every, [], every, []]
        assert res["awc"] == [every, []]
        assert res["ga"] == [every, [-1], []]


# -- strategies ------------------------------------------------------------------------------------------


def _strategies() -> dict[str, Any]:
    r = lowband.rank()
    out: dict[str, Any] = {}
    for spec, opts in (
        ("atc", {"topology": "ring", "allreduce_every": 2}),
        ("awc", {"topology": "dynamic-exp2", "period": 2}),
        ("hierarchical-atc", {"topology": "exp2"}),
        ("gradient-allreduce", {}),
    ):
        m = _model(r)  # the simulation starts each rank from its own model, gradient-allreduce from rank 0's
        s = make_strategy(spec, m, FACTORIES["momentum"], broadcast_init=spec == "gradient-allreduce", **opts)
        in_sync = []
        for k in range(STEPS):
            batch = _batch(r, k)
            s.train_step(lambda mod, b=batch: _loss(mod, b))
            s.synchronize()
            in_sync.append(s.in_sync())
        out[spec] = {"params": _flat(m), "in_sync": in_sync, "label": s.label()}
        s.close()
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_strategies_match_the_simulation(n: int) -> None:
    res = run_threads(_strategies, n, timeout=120, local_size=n // 2 if n == 4 else None)
    ls = 2 if n == 4 else n
    atc = _oracle({"style": "atc", "opt": "momentum", "topology": "ring", "schedule": _every_other}, n)
    awc = _oracle({"style": "awc", "opt": "momentum", "topology": "dynamic-exp2", "period": 2}, n)
    hier = _oracle({"style": "atc", "opt": "momentum", "topology": "exp2", "kind": HNR}, n, ls)
    m = _model(0)
    opt = FACTORIES["momentum"](m.parameters())
    for k in range(STEPS):
        opt.zero_grad()
        (sum(_loss(m, _batch(r, k)) for r in range(n)) / n).backward()  # type: ignore[union-attr]
        opt.step()
    for r in range(n):
        got = res[r]
        for spec, want in (("atc", atc[r]), ("awc", awc[r]), ("hierarchical-atc", hier[r]),
                           ("gradient-allreduce", _flat(m))):  # fmt: skip
            assert float((got[spec]["params"] - want).abs().max()) < 1e-10, f"{spec} rank {r}"
        solo = n == 1
        assert got["atc"]["in_sync"] == [solo or k % 2 == 1 for k in range(STEPS)]
        assert got["awc"]["in_sync"] == [solo] * STEPS
        assert got["hierarchical-atc"]["in_sync"] == [n != 4] * STEPS  # one machine unless n == 4
        assert got["gradient-allreduce"]["in_sync"] == [True] * STEPS
        assert got["atc"]["label"] == "atc(topology=ring, allreduce_every=2, period=1)"


# -- checkpoints -----------------------------------------------------------------------------------------


def _round_trip(spec: str, opts: dict[str, Any], factory: str) -> float:
    r = lowband.rank()
    m = _model(r)
    s = make_strategy(spec, m, FACTORIES[factory], **opts)
    for k in range(3):
        s.train_step(lambda mod, k=k: _loss(mod, _batch(r, k)))
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    m2 = _model(r + 50)
    s2 = make_strategy(spec, m2, FACTORIES[factory], **opts)
    s2.load_state_dict(torch.load(buf, weights_only=True))
    for k in range(3, 6):
        s.train_step(lambda mod, k=k: _loss(mod, _batch(r, k)))
    s.synchronize()
    for k in range(3, 6):
        s2.train_step(lambda mod, k=k: _loss(mod, _batch(r, k)))
    s2.synchronize()
    assert s2.steps == s.steps == 6
    return float((_flat(m) - _flat(m2)).abs().max())


@pytest.mark.parametrize(
    ("spec", "opts", "factory"),
    [
        ("atc", {"topology": "dynamic-exp2"}, "adam"),
        ("awc", {"topology": "dynamic-exp2", "allreduce_every": 2}, "momentum"),
        ("gradient-allreduce", {}, "adam"),
    ],
)
def test_state_dict_round_trip_resumes_identically(spec: str, opts: dict[str, Any], factory: str) -> None:
    assert run_threads(_round_trip, 4, spec, opts, factory, timeout=60) == [0.0] * 4


# -- bad input -------------------------------------------------------------------------------------------


def _bad_options() -> list[str]:
    r = lowband.rank()
    errs = []
    for name, opts in (
        ("atc", {"topology": "nope"}),
        ("awc", {"allreduce_every": -1}),
        ("atc", {"period": 0}),
        ("atc", {"period": 2.5}),
        ("winput", {"topology": "dynamic-exp2"}),
        ("hierarchical-atc", {"topology": "inner-outer-exp2"}),
        ("atc", {"topology": "inner-outer-exp2"}),  # needs machines of more than 2 ranks
        ("gradient-allreduce", {"period": 2}),
    ):
        try:
            make_strategy(name, _model(r), FACTORIES["sgd"], **opts)
        except InvalidArgumentError as e:
            errs.append(str(e))
    opt = AdaptThenCombineOptimizer(_model(r), FACTORIES["sgd"])
    for knob, value in (
        ("communication_type", "bogus"),
        ("num_steps_per_communication", 0),
        ("self_weight", float("nan")),
        ("src_weights", {r: 0.5}),
        ("dst_weights", {7: 1.0}),
        ("topology", ring(5)),
        ("dynamic_topology", exponential_two(2)),
        ("enable_topo_check", 1),
    ):
        try:
            setattr(opt, knob, value)
        except InvalidArgumentError as e:
            errs.append(str(e))
    opt.communication_type = "allreduce"  # a name or value is accepted
    assert opt.communication_type is AR
    for make in (
        lambda: AdaptWithCombineOptimizer(_model(r), lambda ps: object()),  # type: ignore[arg-type,return-value]
        lambda: GradientAllreduceOptimizer(nn.Tanh(), FACTORIES["sgd"]),
        lambda: opt.step(lambda: 0.0),
    ):
        try:
            make()
        except InvalidArgumentError as e:
            errs.append(str(e))
    return errs


def test_bad_options_raise() -> None:
    errs = run_threads(_bad_options, 2, timeout=60)[0]
    assert len(errs) == 19, errs
    assert "topology must be one of 'dynamic-exp2', 'exp2'" in errs[0] and "got 'nope'" in errs[0]
    assert "allreduce_every must be an int >= 0" in errs[1]
    assert "period must be an int >= 1, got 0" in errs[2]
    assert "period must be an int >= 1, got 2.5" in errs[3]
    assert "topology must be one of 'ring', 'exp2', 'full' or a Topology, got 'dynamic-exp2'" in errs[4]
    assert "'inner-outer-exp2'" in errs[5]
    assert "local_size" in errs[6]
    assert "unknown option(s) ['period']" in errs[7]
    assert "communication_type must be a CommunicationType" in errs[8] and "on rank 0" in errs[8]
    assert "num_steps_per_communication must be an int >= 1" in errs[9]
    assert "self_weight" in errs[10]
    assert "this rank itself" in errs[11]
    assert "7" in errs[12]
    assert "Topology of 2 ranks" in errs[13]
    assert "DynamicTopology of 2 ranks" in errs[14]
    assert "enable_topo_check must be a bool" in errs[15]
    assert "not a torch.optim.Optimizer" in errs[16]
    assert "no trainable parameters" in errs[17]
    assert "closure" in errs[18]


def _mismatched_layout() -> None:
    m = _model(0) if lowband.rank() != 1 else nn.Sequential(nn.Linear(4, 2)).double()
    AdaptThenCombineOptimizer(m, FACTORIES["sgd"])


@pytest.mark.parametrize("n", [2, 3])
def test_layout_mismatch_raises_on_every_rank(n: int) -> None:
    with pytest.raises(RankFailures) as info:
        run_threads(_mismatched_layout, n, timeout=60)
    assert sorted(info.value.errors) == list(range(n))
    for tb in info.value.errors.values():
        assert CollectiveMismatchError.__name__ in tb and "ranks [1]" in tb


def _mismatched_topology() -> None:
    r, n = lowband.rank(), lowband.size()
    m = _model(r)
    opt = AdaptThenCombineOptimizer(m, FACTORIES["sgd"], topology=ring(n) if r == 1 else exponential_two(n))
    opt.enable_topo_check = True
    _loss(m, _batch(r, 0)).backward()  # the first layer's launch checks the topology


def test_topology_mismatch_raises_on_every_rank_when_checked() -> None:
    with pytest.raises(RankFailures) as info:
        run_threads(_mismatched_topology, 4, timeout=60)
    assert sorted(info.value.errors) == [0, 1, 2, 3]
    assert all(CollectiveMismatchError.__name__ in tb for tb in info.value.errors.values())


def _scheduled_lrs() -> list[list[float]]:
    out = []
    for cls in (AdaptThenCombineOptimizer, AdaptWithCombineOptimizer, GradientAllreduceOptimizer):
        m = _model(0)
        opt = cls(m, FACTORIES["sgd"])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for k in range(2):
            opt.zero_grad()
            _loss(m, _batch(0, k)).backward()
            opt.step()
            sched.step()
        out.append([g["lr"] for g in opt.inner.param_groups])
    return out


def test_lr_scheduler_drives_the_inner_optimizers() -> None:
    atc, awc, ga = run_threads(_scheduled_lrs, 1, timeout=60)[0]
    assert atc == [0.025] * 3 and awc == [0.025] and ga == [0.025]


# -- win-put (asynchronous) ------------------------------------------------------------------------------

TARGETS = [float(10 * r) for r in range(4)]


class _Quadratic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(3, dtype=torch.float64))

    def forward(self) -> torch.Tensor:
        return self.x


def _winput_consensus(iters: int) -> list[float]:
    r, n = lowband.rank(), lowband.size()
    m = _Quadratic()
    opt = WinPutOptimizer(m, lambda ps: torch.optim.SGD(ps, lr=0.05), topology=ring(n))
    for _ in range(iters):
        opt.zero_grad()
        (0.5 * ((m() - TARGETS[r]) ** 2).sum()).backward()
        opt.step()
    opt.synchronize()
    lowband.barrier()
    opt.close()
    return m.x.detach().tolist()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_winput_reaches_consensus_on_a_quadratic(n: int) -> None:
    res = run_threads(_winput_consensus, n, 300, timeout=120)
    mean = sum(TARGETS[:n]) / n
    for r in range(n):
        # without combining, rank r would go to its own target (10 r); decentralized SGD with a
        # constant step lands near the average, within O(lr) of it
        assert all(abs(v - mean) < 1.5 for v in res[r]), (r, res[r], mean)


def _winput_sleeper(done: list[threading.Event]) -> float:
    r, n = lowband.rank(), lowband.size()
    m = _Quadratic()
    opt = WinPutOptimizer(m, lambda ps: torch.optim.SGD(ps, lr=0.05), topology=exponential_two(n))
    if r == 0:
        # rank 0 stops calling anything until every other rank has finished all its steps: if a put
        # or an update waited for rank 0, they never would and this wait would fail
        ok = all(e.wait(60) for e in done[1:])
        assert ok, "the other ranks blocked while rank 0 slept"
    for _ in range(30):
        opt.zero_grad()
        (0.5 * ((m() - TARGETS[r]) ** 2).sum()).backward()
        opt.step()
    done[r].set()
    opt.synchronize()
    lowband.barrier()
    opt.close()
    return float(m.x.detach().abs().max())


def test_winput_never_waits_for_a_sleeping_rank() -> None:
    done = [threading.Event() for _ in range(4)]
    res = run_threads(_winput_sleeper, 4, done, timeout=120)
    assert all(torch.isfinite(torch.tensor(v)) and v < 100 for v in res)
