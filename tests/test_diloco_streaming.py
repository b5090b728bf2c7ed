"""DiLoCo's streaming and compressed variants against single-process oracles that rebuild every rank's
seeded inputs (float64, 1-4 ranks): fragments synchronised at staggered steps, applied tau steps late
and mixed by alpha (Streaming DiLoCo's update rule); compressed pseudo-gradients with error feedback
(the oracle compresses each rank's pseudo-gradient itself); conservation of the error feedback; exact
resume with exchanges in flight; the fragment split's properties; bad options refused."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_loop_api import _flat, _loss, _model

import lowband
from lowband.compress.base import CompressContext, make_compressor
from lowband.errors import InvalidArgumentError
from lowband.localsgd.fragments import split_fragments, sync_offsets
from lowband.strategies import make_strategy
from lowband.testing import RankFailures, run_threads

STEPS = 11
OUTER = "sgd:lr=0.7;momentum=0.9;nesterov=true"


def _train(opts: dict[str, object], steps: int = STEPS) -> list[float]:
    r = lowband.rank()
    m = _model()
    s = make_strategy("diloco", m, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), outer=OUTER, **opts)
    for k in range(steps):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    return _flat(m)


def _oracle(
    n: int, H: int, F: int, tau: int, alpha: float, compressor: str | None = None
) -> list[list[float]]:
    """Streaming DiLoCo simulated rank by rank: fragment p's pseudo-gradient (global minus local,
    averaged over ranks; with ``compressor``, each rank's compensated by its residual and compressed)
    is sent after inner step t when t mod H is its offset, and applied after inner step t + tau: an
    outer Nesterov step of the fragment's global copy, then local = alpha * local + (1 - alpha) * global."""
    glob = _model()
    gp = list(glob.parameters())
    reps = [copy.deepcopy(glob) for _ in range(n)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in reps]
    frags = split_fragments([q.numel() for q in gp], F)
    offs = sync_offsets(F, H)
    outers = [torch.optim.SGD([gp[i] for i in f], lr=0.7, momentum=0.9, nesterov=True) for f in frags]
    comp = make_compressor(compressor) if compressor else None
    resid: list[dict[int, torch.Tensor]] = [{} for _ in range(n)]
    pending: dict[int, tuple[int, list[torch.Tensor]]] = {}
    sent = [0] * F

    def average(p: int) -> list[torch.Tensor]:
        frag = frags[p]
        decoded = []
        for r in range(n):
            d = torch.cat([(gp[i] - list(reps[r].parameters())[i]).reshape(-1) for i in frag])
            if comp is None:
                decoded.append(d)
                continue
            e = resid[r].get(p)
            x = d if e is None else d + e
            cctx = CompressContext(f"diloco:fragment{p}", sent[p], r, 0)
            out = comp.decompress(comp.compress(x, cctx), cctx)
            resid[r][p] = x - out
            decoded.append(out)
        avg = sum(decoded) / n
        sent[p] += 1
        parts, pos = [], 0
        for i in frag:
            parts.append(avg[pos : pos + gp[i].numel()].view_as(gp[i]).clone())
            pos += gp[i].numel()
        return parts

    def apply(p: int) -> None:
        _, avg = pending.pop(p)
        for i, a in zip(frags[p], avg, strict=True):
            gp[i].grad = a
        outers[p].step()
        outers[p].zero_grad(set_to_none=True)
        for m in reps:
            mp = list(m.parameters())
            for i in frags[p]:
                mp[i].mul_(alpha).add_(gp[i], alpha=1 - alpha)

    for k in range(STEPS):
        for r in range(n):
            inner[r].zero_grad()
            _loss(reps[r], r, k).backward()
            inner[r].step()
        t = k + 1
        with torch.no_grad():
            for p in sorted(pending):
                if pending[p][0] == t:
                    apply(p)
            for p, off in enumerate(offs):
                if t % H == off:
                    pending[p] = (t + tau, average(p))
                    if tau == 0:
                        apply(p)
    return [_flat(m) for m in reps]


def _close(a: list[float], b: list[float], tol: float) -> None:
    assert len(a) == len(b)
    worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b, strict=True))
    assert worst < tol, worst


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize(("H", "F", "tau", "alpha"), [(4, 2, 1, 0.5), (6, 3, 1, 0.0), (4, 4, 0, 0.25)])
def test_streaming_fragments_follow_the_update_rule(n: int, H: int, F: int, tau: int, alpha: float) -> None:
    opts = {"inner_steps": H, "fragments": F, "delay": tau, "alpha": alpha}
    got = run_threads(_train, n, opts, timeout=120)
    want = _oracle(n, H, F, tau, alpha)
    for r in range(n):
        _close(got[r], want[r], 1e-10)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("H", "F", "tau", "spec"),
    [
        (3, 1, 0, "topk:ratio=0.3"),
        (4, 2, 1, "topk:ratio=0.3"),
        (4, 2, 1, "chunktopk:chunk=8;ratio=0.25;bits=2"),  # SparseLoCo's recipe
        (3, 1, 0, "dct-topk:chunk=8;topk=2"),  # DeMo's transform
    ],
)
def test_compressed_pseudo_gradients_with_error_feedback(n: int, H: int, F: int, tau: int, spec: str) -> None:
    opts = {"inner_steps": H, "fragments": F, "delay": tau, "compressor": spec}
    got = run_threads(_train, n, opts, timeout=120)
    want = _oracle(n, H, F, tau, 0.0, spec)
    for r in range(n):
        _close(got[r], want[r], 1e-10)


def _gossip_oracle(n: int, H: int, F: int, topology: str) -> list[list[float]]:
    """The decentralised outer step: every rank keeps its own global copy; fragment p's pseudo-gradients
    are mixed by the graph's weights (pull: rank i takes sum_j W[i, j] x_j; a dynamic graph's c-th
    exchange of the fragment uses its step-c graph), then each rank steps its own copy (Nesterov)."""
    from lowband.topology import DynamicTopology
    from lowband.topology.names import build_topology

    topo = build_topology("oracle", topology, (topology,), n, 1)
    base = _model()
    reps = [copy.deepcopy(base) for _ in range(n)]
    globs = [copy.deepcopy(base) for _ in range(n)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in reps]
    frags = split_fragments([q.numel() for q in base.parameters()], F)
    offs = sync_offsets(F, H)
    outers = [
        [
            torch.optim.SGD([list(g.parameters())[i] for i in f], lr=0.7, momentum=0.9, nesterov=True)
            for f in frags
        ]
        for g in globs
    ]
    sent = [0] * F
    for k in range(STEPS):
        for r in range(n):
            inner[r].zero_grad()
            _loss(reps[r], r, k).backward()
            inner[r].step()
        with torch.no_grad():
            for p, off in enumerate(offs):
                if (k + 1) % H != off:
                    continue
                graph = topo.at(sent[p]) if isinstance(topo, DynamicTopology) else topo
                w = torch.tensor(graph.weights, dtype=torch.float64)
                sent[p] += 1
                deltas = [
                    [list(globs[r].parameters())[i] - list(reps[r].parameters())[i] for i in frags[p]]
                    for r in range(n)
                ]
                for r in range(n):
                    gp = list(globs[r].parameters())
                    for j, i in enumerate(frags[p]):
                        gp[i].grad = sum(w[r, s] * deltas[s][j] for s in range(n))
                    outers[r][p].step()
                    outers[r][p].zero_grad(set_to_none=True)
                    for i in frags[p]:
                        list(reps[r].parameters())[i].copy_(gp[i])
    return [_flat(m) for m in reps]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize(("topology", "F"), [("dynamic-exp2", 1), ("ring", 2)])
def test_decentralised_outer_step_mixes_with_neighbours(n: int, topology: str, F: int) -> None:
    got = run_threads(_train, n, {"inner_steps": 3, "fragments": F, "topology": topology}, timeout=120)
    want = _gossip_oracle(n, 3, F, topology)
    for r in range(n):
        _close(got[r], want[r], 1e-10)


def _hier_oracle(machines: int, per: int, H: int) -> list[list[float]]:
    """inner=ddp: the ranks of a machine train one replica on the mean of their gradients (plain SGD
    with momentum on the averaged gradient); every H steps the machines' pseudo-gradients are averaged
    and the outer Nesterov step taken (Algorithm 1 over machines)."""
    glob = _model()
    reps = [copy.deepcopy(glob) for _ in range(machines)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in reps]
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for k in range(STEPS):
        for mi, m in enumerate(reps):
            grads = []
            for lr in range(per):
                m.zero_grad()
                _loss(m, mi * per + lr, k).backward()
                grads.append([q.grad.clone() for q in m.parameters()])
            for i, q in enumerate(m.parameters()):
                q.grad = sum(g[i] for g in grads) / per
            inner[mi].step()
        if (k + 1) % H == 0:
            with torch.no_grad():
                for i, g in enumerate(glob.parameters()):
                    g.grad = sum(g - list(m.parameters())[i] for m in reps) / machines
                outer.step()
                for m in reps:
                    for q, g in zip(m.parameters(), glob.parameters(), strict=True):
                        q.copy_(g)
    return [_flat(reps[r // per]) for r in range(machines * per)]


@pytest.mark.parametrize(("machines", "per"), [(2, 2), (2, 3)])
@pytest.mark.parametrize("compressor", ["identity", "topk:ratio=0.3"])
def test_inner_ddp_runs_the_outer_loop_between_machines(machines: int, per: int, compressor: str) -> None:
    opts = {"inner_steps": 3, "inner": "ddp", "compressor": compressor}
    got = run_threads(_train, machines * per, opts, timeout=120, local_size=per)
    for r in range(1, machines * per):  # the ranks of a machine hold one replica
        if r % per:
            assert got[r] == got[r - 1]
    if compressor == "identity":
        want = _hier_oracle(machines, per, 3)
        for r in range(machines * per):
            _close(got[r], want[r], 1e-10)


def _conserve() -> float:
    """Per rank: the pseudo-gradients handed to the reducer sum to what it sent (its local decodes) plus
    the residual left in its error-feedback memory."""
    r = lowband.rank()
    m = _model()
    s = make_strategy(
        "diloco", m, lambda p: torch.optim.SGD(p, lr=0.05), inner_steps=2, compressor="topk:ratio=0.2"
    )
    red = s.reducer
    given_sum: list[torch.Tensor] = []
    sent_sum: list[torch.Tensor] = []
    reduce, update = red.reduce, red.memory.update

    def spy_reduce(unit, grads, ctx):  # type: ignore[no-untyped-def]
        given_sum.append(torch.cat([g.reshape(-1) for g in grads]).clone())
        return reduce(unit, grads, ctx)

    def spy_update(segments, compensated, decoded):  # type: ignore[no-untyped-def]
        sent_sum.append(decoded.clone())
        update(segments, compensated, decoded)

    red.reduce, red.memory.update = spy_reduce, spy_update  # type: ignore[method-assign]
    for k in range(9):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    resid = torch.cat([red.memory.tensors[n].reshape(-1) for n in s.names])
    return float((sum(given_sum) - sum(sent_sum) - resid).abs().max())


def test_error_feedback_conserves_the_pseudo_gradients() -> None:
    assert max(run_threads(_conserve, 3, timeout=120)) < 1e-12


def _resume(opts: dict[str, object]) -> tuple[list[float], list[float]]:
    """Save after 5 steps (an exchange in flight), load into a fresh strategy, train 6 more; the
    uninterrupted run continues the same 6 steps."""
    r = lowband.rank()

    def build() -> tuple[torch.nn.Module, object]:
        m = _model()
        opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
        return m, make_strategy("diloco", m, opt, outer=OUTER, **opts)

    m1, s1 = build()
    for k in range(5):
        s1.train_step(lambda mod, k=k: _loss(mod, r, k))  # type: ignore[attr-defined]
    sd = copy.deepcopy(s1.state_dict())  # type: ignore[attr-defined]
    m2, s2 = build()
    s2.load_state_dict(sd)  # type: ignore[attr-defined]
    for s in (s1, s2):
        for k in range(5, 11):
            s.train_step(lambda mod, k=k: _loss(mod, r, k))  # type: ignore[attr-defined]
    return _flat(m1), _flat(m2)


@pytest.mark.parametrize(("n", "local"), [(2, None), (3, None), (4, 2)])
def test_resume_mid_fragment_with_an_exchange_in_flight_is_exact(n: int, local: int | None) -> None:
    opts: dict[str, object] = {
        "inner_steps": 4, "fragments": 2, "delay": 1, "alpha": 0.5, "compressor": "topk:ratio=0.3"
    }  # fmt: skip
    if local:
        opts["inner"] = "ddp"
    for a, b in run_threads(_resume, n, opts, timeout=120, local_size=local):
        assert a == b


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30), st.data())
def test_fragments_cover_every_tensor_in_order(sizes: list[int], data: st.DataObject) -> None:
    f = data.draw(st.integers(1, len(sizes)))
    frags = split_fragments(sizes, f)
    assert len(frags) == f and all(frags)
    assert [i for fr in frags for i in fr] == list(range(len(sizes)))
    # no fragment exceeds an equal share by more than its largest tensor
    share = sum(sizes) / f
    assert all(sum(sizes[i] for i in fr) <= share + max(sizes) for fr in frags)


def test_offsets_stagger_and_one_fragment_is_diloco() -> None:
    assert sync_offsets(1, 5) == [0]
    assert sync_offsets(4, 8) == [2, 4, 6, 0]
    assert len(set(sync_offsets(3, 7))) == 3


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"fragments": 6}, "between 1 and the number of parameter tensors"),
        ({"inner_steps": 4, "fragments": 2, "delay": 2}, "delay < inner_steps / fragments"),
        ({"inner_steps": 2, "fragments": 3}, "fragments <= inner_steps"),
        ({"compressor": "nosuch"}, "nosuch"),
        ({"alpha": 1.5}, "alpha"),
        ({"topology": "ring", "compressor": "topk:ratio=0.1"}, "full precision"),
        ({"topology": "nosuch"}, "nosuch"),
        ({"inner": "ddp"}, "inner=ddp needs several machines"),
    ],
)
def test_bad_options_are_refused(opts: dict[str, object], message: str) -> None:
    def fn() -> None:
        make_strategy("diloco", _model(), lambda p: torch.optim.SGD(p, lr=0.1), **opts)

    with pytest.raises(RankFailures, match=message):
        run_threads(fn, 1, timeout=60)
    with pytest.raises(InvalidArgumentError):
        split_fragments([1, 2], 3)
