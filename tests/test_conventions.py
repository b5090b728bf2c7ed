"""PyTorch conventions of the strategies and the decentralized optimizers: every replica starts from rank
0's model (as DDP), an optimizer instance works where a factory does, per-layer stepping in backward
refuses clipping and a second backward with a clear error (clipping works elsewhere), the plain loop is
``train_step`` spelled out, and both ATC APIs take the same topology arguments.

Thread ranks; every rank's data is seeded from a private generator, so the single-process references
rebuild it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowband
from lowband.decentral.optimizers import AdaptThenCombineOptimizer, AdaptWithCombineOptimizer
from lowband.errors import InvalidArgumentError
from lowband.strategies import make_strategy
from lowband.testing import run_threads
from lowband.topology import exponential_two
from lowband.topology.dynamic import dynamic_one_peer_exponential_two

LR = 0.1
#: strategies that run on thread ranks (torch DDP and its averagers need real processes)
THREAD_STRATEGIES = ("stage", "atc", "awc", "gradient-allreduce", "winput", "dreamddp:period=2")


def _model(seed: int) -> nn.Module:
    """The same architecture on every rank, weights from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return m


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(
        3, 2, generator=g, dtype=torch.float64
    )


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((m(b[0]) - b[1]) ** 2).mean()


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)  # type: ignore[arg-type]


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in m.state_dict().values()])


def _spec(spec: str) -> tuple[str, dict[str, object]]:
    name, _, rest = spec.partition(":")
    opts: dict[str, object] = {}
    for kv in filter(None, rest.split(",")):
        k, v = kv.split("=")
        opts[k] = int(v)
    return name, opts


# -- initial state --------------------------------------------------------------------------------
def _initial(spec: str, broadcast_init: bool) -> torch.Tensor:
    name, opts = _spec(spec)
    m = _model(seed=10 + lowband.rank())
    s = make_strategy(name, m, _sgd, broadcast_init=broadcast_init, **opts)
    out = _flat(m)
    s.close()
    return out


@pytest.mark.parametrize("spec", THREAD_STRATEGIES)
@pytest.mark.parametrize("n", [2, 3])
def test_strategies_start_from_rank0_model(spec: str, n: int) -> None:
    on = run_threads(_initial, n, spec, True)
    off = run_threads(_initial, n, spec, False)
    for r in range(n):
        assert torch.equal(on[r], _flat(_model(10)))  # rank 0's initial model
        assert torch.equal(off[r], _flat(_model(10 + r)))  # each rank's own


def _optimizer_initial(kind: str, broadcast_init: bool) -> torch.Tensor:
    m = _model(seed=20 + lowband.rank())
    cls = AdaptThenCombineOptimizer if kind == "atc" else AdaptWithCombineOptimizer
    opt = cls(m, _sgd, topology=exponential_two(lowband.size()), broadcast_init=broadcast_init)
    out = _flat(m)
    opt.remove_hooks()
    return out


@pytest.mark.parametrize("kind", ["atc", "awc"])
def test_decentral_optimizers_start_from_rank0_model(kind: str) -> None:
    n = 3
    on = run_threads(_optimizer_initial, n, kind, True)
    off = run_threads(_optimizer_initial, n, kind, False)
    for r in range(n):
        assert torch.equal(on[r], _flat(_model(20)))
        assert torch.equal(off[r], _flat(_model(20 + r)))


# -- optimizer instances --------------------------------------------------------------------------
def _grouped(m: nn.Module) -> torch.optim.Optimizer:
    """Two param groups with their own learning rates, momentum as a default."""
    children = list(m.children())
    first, last = children[0], children[-1]
    return torch.optim.SGD(
        [{"params": first.parameters(), "lr": 0.05}, {"params": last.parameters(), "lr": 0.2}], momentum=0.5
    )


def _train_with(spec: str, instance: bool) -> tuple[torch.Tensor, list[float]]:
    name, opts = _spec(spec)
    m = _model(seed=7)
    if instance:
        s = make_strategy(name, m, _grouped(m), **opts)
    else:
        first = {id(p) for p in next(iter(m.children())).parameters()}

        def factory(params: object) -> torch.optim.Optimizer:
            ps = list(params)  # type: ignore[call-overload]
            groups = [
                {"params": [p for p in ps if id(p) in first], "lr": 0.05},
                {"params": [p for p in ps if id(p) not in first], "lr": 0.2},
            ]
            return torch.optim.SGD([g for g in groups if g["params"]], lr=0.01, momentum=0.5)

        s = make_strategy(name, m, factory, **opts)
    for k in range(3):
        b = _batch(lowband.rank(), k)
        s.train_step(lambda mod, b=b: _loss(mod, b))
    s.synchronize()
    lrs = sorted({float(g["lr"]) for g in s.optimizer.param_groups})
    out = _flat(m)
    s.close()
    return out, lrs


@pytest.mark.parametrize("spec", ["stage", "atc", "dreamddp:period=1"])  # H=1: no timing-chosen schedule
def test_optimizer_instance_is_rebuilt_with_its_groups(spec: str) -> None:
    got = run_threads(_train_with, 2, spec, True)
    want = run_threads(_train_with, 2, spec, False)
    for (a, lrs), (b, _) in zip(got, want):
        assert torch.equal(a, b)
        assert lrs == [0.05, 0.2]


def _foreign_instance() -> str:
    m, other = _model(1), _model(2)
    try:
        make_strategy("atc", m, torch.optim.SGD(other.parameters(), lr=0.1))
    except InvalidArgumentError as exc:
        return str(exc)
    return "accepted"


def _not_an_optimizer() -> str:
    try:
        make_strategy("stage", _model(1), "sgd")  # type: ignore[arg-type]
    except InvalidArgumentError as exc:
        return str(exc)
    return "accepted"


def test_optimizer_instance_over_other_parameters_is_refused() -> None:
    for msg in run_threads(_foreign_instance, 2):
        assert "not the model's" in msg and "make_strategy('atc')" in msg
    assert "optimizer must be a torch.optim.Optimizer or a factory" in run_threads(_not_an_optimizer, 1)[0]


def test_decentral_optimizer_takes_an_instance() -> None:
    def body() -> list[float]:
        m = _model(3)
        opt = AdaptWithCombineOptimizer(m, _grouped(m))
        return sorted(float(g["lr"]) for g in opt.param_groups)

    assert run_threads(body, 2) == [[0.05, 0.2]] * 2


# -- clipping and accumulation --------------------------------------------------------------------
def _clipped(spec: str, max_norm: float) -> tuple[float, torch.Tensor]:
    name, opts = _spec(spec)
    m = _model(seed=4)
    s = make_strategy(name, m, _sgd, **opts)
    s.zero_grad()
    s.backward(_loss(s.module, _batch(lowband.rank(), 0)))
    norm = s.clip_grad_norm_(max_norm)
    s.step()
    s.synchronize()
    out = _flat(m)
    s.close()
    return norm, out


@pytest.mark.parametrize("spec", ["stage", "gradient-allreduce"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_clip_grad_norm_clips_the_averaged_gradient(spec: str, n: int) -> None:
    # reference: the average of every rank's gradient, clipped to 0.5, one SGD step
    ref = _model(4)
    grads = []
    for r in range(n):
        ref.zero_grad()
        _loss(ref, _batch(r, 0)).backward()  # type: ignore[no-untyped-call]
        grads.append([p.grad.clone() for p in ref.parameters() if p.grad is not None])
    avg = [sum(gs) / n for gs in zip(*grads)]
    total = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in avg])))
    scale = min(1.0, 0.5 / (total + 1e-6))
    with torch.no_grad():
        for p, g in zip(ref.parameters(), avg):
            p -= LR * g * scale
    for norm, params in run_threads(_clipped, n, spec, 0.5):
        assert norm == pytest.approx(total, rel=1e-12)
        torch.testing.assert_close(params, _flat(ref), rtol=1e-12, atol=1e-12)


def _refused(spec: str, what: str) -> str:
    name, opts = _spec(spec)
    s = make_strategy(name, _model(seed=4), _sgd, **opts)
    b = _batch(lowband.rank(), 0)
    if spec.startswith("dreamddp"):
        s.train_step(lambda mod: _loss(mod, b))  # profiles and schedules
    try:
        s.zero_grad()
        s.backward(_loss(s.module, b))
        if what == "clip":
            s.clip_grad_norm_(1.0)
        else:
            s.backward(_loss(s.module, b))
    except InvalidArgumentError as exc:
        return str(exc)
    finally:
        s.synchronize()
    return "accepted"


@pytest.mark.parametrize("spec", ["atc", "dreamddp:period=2", "hierarchical-atc"])
def test_stepping_in_backward_refuses_clipping_and_a_second_backward(spec: str) -> None:
    name = _spec(spec)[0]
    assert make_strategy_class(name).steps_in_backward
    for msg in run_threads(_refused, 2, spec, "clip"):
        assert "cannot clip gradients between backward and step" in msg and repr(name) in msg
    for msg in run_threads(_refused, 2, spec, "accumulate"):
        assert "a second backward before step()" in msg


def make_strategy_class(name: str) -> type:
    from lowband.strategies.registry import STRATEGIES

    cls = STRATEGIES.get(name)
    assert isinstance(cls, type)
    return cls


def _accumulated(period: int) -> torch.Tensor:
    """ATC with period J: J backward passes then one step (the documented accumulation)."""
    m = _model(seed=4)
    s = make_strategy("atc", m, _sgd, period=period)
    s.zero_grad()
    for k in range(period):
        s.backward(_loss(s.module, _batch(lowband.rank(), k)))
    s.step()
    s.synchronize()
    return _flat(m)


def test_atc_accumulates_its_period_of_backward_passes() -> None:
    # one rank: J passes accumulate into one step on the summed gradient
    ref = _model(4)
    for k in range(2):
        _loss(ref, _batch(0, k)).backward()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for p in ref.parameters():
            assert p.grad is not None
            p -= LR * p.grad
    torch.testing.assert_close(run_threads(_accumulated, 1, 2)[0], _flat(ref), rtol=1e-12, atol=1e-12)


# -- the plain loop, train_step's result ----------------------------------------------------------
def _both_loops(spec: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[float]]:
    name, opts = _spec(spec)
    r = lowband.rank()
    ma, mb = _model(seed=9), _model(seed=9)
    a = make_strategy(name, ma, _sgd, **opts)
    b = make_strategy(name, mb, _sgd, **opts)
    losses = []
    for k in range(4):
        batch = _batch(r, k)
        loss_a = a.train_step(lambda mod, bt=batch: _loss(mod, bt))
        assert type(loss_a) is float
        b.zero_grad()
        loss = _loss(b.module, batch)
        b.backward(loss)
        b.step()
        losses.append(loss_a - float(loss.detach()))
    a.synchronize()
    b.synchronize()
    avg = _flat(b.average_model(_model(seed=0)))
    out = _flat(ma), _flat(mb), avg, losses
    a.close()
    b.close()
    return out


@pytest.mark.parametrize("spec", ["stage", "atc", "awc"])
def test_plain_loop_is_train_step(spec: str) -> None:
    out = run_threads(_both_loops, 2, spec)
    for a, b, avg, losses in out:
        assert torch.equal(a, b)
        assert losses == [0.0] * 4
        assert torch.equal(avg, out[0][2])  # the exported model is the same on every rank
    torch.testing.assert_close(out[0][2], (out[0][1] + out[1][1]) / 2, rtol=1e-12, atol=1e-12)


# -- topology arguments ---------------------------------------------------------------------------
def _atc_with(api: str, topology: str) -> torch.Tensor:
    n = lowband.size()
    arg: object = {"name": "exp2", "object": exponential_two(n), "dynamic": dynamic_one_peer_exponential_two(n),
                   "dynamic-name": "dynamic-exp2"}[topology]  # fmt: skip
    m = _model(seed=30 + lowband.rank())
    if api == "strategy":
        s = make_strategy("atc", m, _sgd, topology=arg, broadcast_init=False)
        for k in range(3):
            batch = _batch(lowband.rank(), k)
            s.train_step(lambda mod, b=batch: _loss(mod, b))
        s.synchronize()
        return _flat(m)
    opt = AdaptThenCombineOptimizer(m, _sgd, topology=arg, broadcast_init=False)  # type: ignore[arg-type]
    for k in range(3):
        opt.zero_grad()
        _loss(m, _batch(lowband.rank(), k)).backward()  # type: ignore[no-untyped-call]
        opt.step()
    opt.synchronize()
    return _flat(m)


def _same(runs: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


def test_atc_apis_take_the_same_topology_arguments() -> None:
    n = 4
    # the strategy and the optimizer, given a name or the object it names, run alike
    static = [
        run_threads(_atc_with, n, api, t) for api in ("strategy", "optimizer") for t in ("name", "object")
    ]
    dynamic = [
        run_threads(_atc_with, n, api, t)
        for api in ("strategy", "optimizer")
        for t in ("dynamic", "dynamic-name")
    ]
    assert _same(static) and _same(dynamic)
    assert not _same([static[0], dynamic[0]])


def _bad_topology(api: str) -> str:
    try:
        if api == "strategy":
            make_strategy("atc", _model(1), _sgd, topology="star")
        else:
            AdaptThenCombineOptimizer(_model(1), _sgd, topology="star")  # type: ignore[arg-type]
    except InvalidArgumentError as exc:
        return str(exc)
    return "accepted"


def test_atc_apis_refuse_a_bad_topology_alike() -> None:
    for api in ("strategy", "optimizer"):
        msg = run_threads(_bad_topology, 2, api)[0]
        assert (
            "topology must be one of 'dynamic-exp2', 'exp2', 'full', 'inner-outer-exp2', 'ring' or a " in msg
        )
        assert "Topology or a DynamicTopology, got 'star'" in msg


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.RMSprop])
def test_optimizer_instance_of_any_torch_class_is_rebuilt(cls: type[torch.optim.Optimizer]) -> None:
    """torch's AdamW records ``decoupled_weight_decay`` in its defaults but refuses it as an argument:
    the rebuilt optimizer takes only what the constructor takes, and steps as the instance would."""
    from lowband.optim.factory import instance_factory

    a, b = _model(1), _model(1)
    given = cls(a.parameters(), lr=0.01, weight_decay=0.1)
    rebuilt = instance_factory(cls(b.parameters(), lr=0.01, weight_decay=0.1))(list(b.parameters()))
    assert type(rebuilt) is cls
    for opt, m in ((given, a), (rebuilt, b)):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
