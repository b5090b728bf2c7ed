"""The BlueFog compatibility API (``lowband.compat.bluefog.torch``): BlueFog's signatures, scripts shaped
like the paper's Listings 1, 4 and 5 run unchanged except their import, the nonblocking and in-place
forms, windows, topologies, the optimizer factories (against lowband's optimizer classes) and the
utilities, on 1-4 thread-ranks against single-process oracles (float64)."""

from __future__ import annotations

import enum
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import networkx as nx
import numpy as np
import pytest
import torch
from torch import nn

import lowband
import lowband.compat.bluefog.torch as bf
from lowband.compat.bluefog.common import topology_util
from lowband.decentral import state as dstate
from lowband.decentral.optimizers import (
    AdaptThenCombineOptimizer,
    AdaptWithCombineOptimizer,
    GradientAllreduceOptimizer,
    WinPutOptimizer,
)
from lowband.errors import InvalidArgumentError
from lowband.testing import run_threads
from lowband.topology import fully_connected, ring

WORLD_SIZES = (1, 2, 3, 4)

# ---------------------------------------------------------------- signatures, from BlueFog 0.3's source
# (bluefog/common/basics.py, bluefog/torch/mpi_ops.py, bluefog/torch/optimizers.py, bluefog/torch/utility.py):
# parameters with their defaults, "*" before the keyword-only ones (annotations left out).
_AR = "tensor, average=True, is_hierarchical_local=False, name=None"
_BC = "tensor, root_rank, name=None"
_NAR = "tensor, *, self_weight=None, src_weights=None, dst_weights=None, enable_topo_check=True, name=None"
_NAG = "tensor, *, src_ranks=None, dst_ranks=None, enable_topo_check=True, name=None"
_HNAR = "tensor, self_weight=None, src_machine_weights=None, dst_machine_weights=None, enable_topo_check=False, name=None"
_WPUT = "tensor, name, self_weight=None, dst_weights=None, require_mutex=False"
_WGET = "name, src_weights=None, require_mutex=False"
_OPT = (
    "optimizer, model, communication_type=CommunicationType.neighbor_allreduce, num_steps_per_communication=1"
)
_OPT_J = "optimizer, model, num_steps_per_communication=1"
_NO_ARGS = """shutdown size rank local_size local_rank machine_size machine_rank load_topology load_machine_topology
    is_topo_weighted in_neighbor_ranks out_neighbor_ranks in_neighbor_machine_ranks out_neighbor_machine_ranks
    barrier is_homogeneous nccl_built mpi_threads_supported unified_mpi_window_model_supported
    get_skip_negotiate_stage"""
_OPT_J_NAMES = """DistributedGradientAllreduceOptimizer DistributedAllreduceOptimizer
    DistributedNeighborAllreduceOptimizer DistributedHierarchicalNeighborAllreduceOptimizer"""
SIGNATURES: dict[str, str] = {
    **dict.fromkeys(_NO_ARGS.split(), ""),
    "init": "topology_fn=None, is_weighted=False",
    "set_topology": "topology=None, is_weighted=False",
    "set_machine_topology": "topology, is_weighted=False",
    "set_skip_negotiate_stage": "value",
    **dict.fromkeys(["allreduce", "allreduce_nonblocking", "allreduce_", "allreduce_nonblocking_"], _AR),
    **dict.fromkeys(["broadcast", "broadcast_nonblocking", "broadcast_", "broadcast_nonblocking_"], _BC),
    **dict.fromkeys(["allgather", "allgather_nonblocking"], "tensor, name=None"),
    **dict.fromkeys(["neighbor_allreduce", "neighbor_allreduce_nonblocking"], _NAR),
    **dict.fromkeys(["neighbor_allgather", "neighbor_allgather_nonblocking"], _NAG),
    **dict.fromkeys(
        ["hierarchical_neighbor_allreduce", "hierarchical_neighbor_allreduce_nonblocking"], _HNAR
    ),
    **dict.fromkeys(["poll", "synchronize", "wait", "win_wait", "win_poll"], "handle"),
    "win_create": "tensor, name, zero_init=False",
    "win_free": "name=None",
    "win_update": "name, self_weight=None, neighbor_weights=None, reset=False, clone=False, require_mutex=False",
    "win_update_then_collect": "name, require_mutex=True",
    **dict.fromkeys(
        ["win_put", "win_put_nonblocking", "win_accumulate", "win_accumulate_nonblocking"], _WPUT
    ),
    **dict.fromkeys(["win_get", "win_get_nonblocking"], _WGET),
    **dict.fromkeys(["win_lock", "get_win_version", "win_associated_p"], "name"),
    "win_mutex": "name, for_self=False, ranks=None",
    "timeline_start_activity": "tensor_name, activity_name",
    "timeline_end_activity": "tensor_name",
    "timeline_context": "tensor_name, activity_name",
    **dict.fromkeys(["DistributedAdaptThenCombineOptimizer", "DistributedAdaptWithCombineOptimizer"], _OPT),
    **dict.fromkeys(_OPT_J_NAMES.split(), _OPT_J),
    "DistributedWinPutOptimizer": f"{_OPT_J}, window_prefix=None",
    "broadcast_parameters": "params, root_rank",
    "broadcast_optimizer_state": "optimizer, root_rank",
    "allreduce_parameters": "params",
}


def describe(fn: Callable[..., Any]) -> str:
    """``fn``'s parameters as BlueFog's source spells them: ``name=default``, ``*`` before keyword-only."""
    parts: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        assert p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY), p
        if p.kind is p.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        default = p.default
        shown = (
            ""
            if default is p.empty
            else "=" + (str(default) if isinstance(default, enum.Enum) else repr(default))
        )
        parts.append(p.name + shown)
    return ", ".join(parts)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_bluefog(name: str) -> None:
    assert describe(getattr(bf, name)) == SIGNATURES[name]


def test_communication_type_matches_bluefog() -> None:
    assert {c.name: c.value for c in bf.CommunicationType} == {
        "neighbor_allreduce": "neighbor.allreduce",
        "hierarchical_neighbor_allreduce": "hierarchical.neighbor.allreduce",
        "allreduce": "allreduce",
        "empty": "empty",
    }
    assert set(bf.__all__) <= set(dir(bf))


# ---------------------------------------------------------------- helpers (the oracles' side)


def value(rank: int, shape: tuple[int, ...] = (3,), salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s seeded float64 input."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(97 * rank + salt), dtype=torch.float64)


def exp2_matrix(n: int) -> np.ndarray:
    """Uniform pull weights of the exponential-2 graph (BlueFog's default topology)."""
    w = np.zeros((n, n))
    for i in range(n):
        srcs = {(i - 2**k) % n for k in range(n.bit_length()) if 2**k < n} - {i}
        for j in srcs | {i}:
            w[i, j] = 1.0 / (len(srcs) + 1)
    return w


def seeded_model(seed: int) -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(
        5, 2, generator=g, dtype=torch.float64
    )


# ---------------------------------------------------------------- the paper's listings, verbatim shapes


def listing_1(A: torch.Tensor, b: torch.Tensor, maxite: int, gamma: float) -> torch.Tensor:
    bf.init()  # Initialize the BlueFog
    # Set topology as static exponential graph.
    G = bf.ExponentialTwoGraph(bf.size())
    bf.set_topology(G)
    x = torch.zeros(A.shape[1], 1, dtype=torch.float64)
    # DGD implementation
    for ite in range(maxite):  # noqa: B007
        grad_local = A.t().mm(A.mm(x) - b)  # compute local grad
        y = x - gamma * grad_local  # local update
        x = bf.neighbor_allreduce(y)  # partial averaging
    return x


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_listing_1_dgd_runs_unchanged(n: int) -> None:
    data = [(value(r, (6, 3), 1), value(r, (6, 1), 2)) for r in range(n)]
    res = run_threads(lambda: listing_1(*data[bf.rank()], 4, 0.05), n)
    w = exp2_matrix(n)
    x = np.zeros((n, 3, 1))
    for _ in range(4):
        y = np.stack(
            [
                x[i] - 0.05 * data[i][0].numpy().T @ (data[i][0].numpy() @ x[i] - data[i][1].numpy())
                for i in range(n)
            ]
        )
        x = np.einsum("ij,jkl->ikl", w, y)
    assert max(float(np.abs(r.numpy() - x[i]).max()) for i, r in enumerate(res)) < 1e-12


def listing_4(model: nn.Module, steps: int) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    # BlueFog wraps the standard optimizer to use the decentralized communication
    # to fuse the information with neighbors.
    opt = bf.DistributedAdaptThenCombineOptimizer(
        optimizer=opt, model=model, communication_type=bf.CommunicationType.neighbor_allreduce
    )
    for batch_idx in range(steps):
        data, target = batch(bf.rank(), batch_idx)
        # Generate dynamic topology weights: pull from rank - 1 - (batch_idx % 2)
        src = (bf.rank() - 1 - batch_idx % 2) % bf.size()
        self_weights, src_weights = (0.5, {src: 0.5}) if src != bf.rank() else (1.0, {})
        opt.self_weight = self_weights
        opt.src_weights = src_weights
        opt.enable_topo_check = True
        # Periodic global allreduce
        opt.communication_type = (
            bf.CommunicationType.allreduce if batch_idx % 3 == 0 else bf.CommunicationType.neighbor_allreduce
        )
        # Forward and backward computation.
        output = model(data)
        loss = nn.functional.mse_loss(output, target)
        loss.backward()
        opt.step()
    opt.synchronize()
    return model


def lowband_listing_4(model: nn.Module, steps: int) -> nn.Module:
    """Listing 4 written with lowband's own optimizer class (the reference for the compat factory)."""
    opt = AdaptThenCombineOptimizer(
        model,
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5),
        broadcast_init=False,  # as BlueFog
    )
    for k in range(steps):
        data, target = batch(lowband.rank(), k)
        src = (lowband.rank() - 1 - k % 2) % lowband.size()
        opt.self_weight, opt.src_weights = (0.5, {src: 0.5}) if src != lowband.rank() else (1.0, {})
        opt.enable_topo_check = True
        opt.communication_type = "allreduce" if k % 3 == 0 else "neighbor_allreduce"
        nn.functional.mse_loss(model(data), target).backward()
        opt.step()
    opt.synchronize()
    return model


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_listing_4_optimizer_runs_unchanged_and_matches_lowband(n: int) -> None:
    def fn() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        a = listing_4(seeded_model(bf.rank()), 5)
        b = lowband_listing_4(seeded_model(lowband.rank()), 5)
        return [p.detach() for p in a.parameters()], [p.detach() for p in b.parameters()]

    for got, ref in run_threads(fn, n, check=False):
        assert all(torch.equal(x, y) for x, y in zip(got, ref))
    start = [p.detach() for p in seeded_model(0).parameters()]
    assert not all(torch.equal(x, y) for x, y in zip(run_threads(fn, 1)[0][0], start))


def listing_5(x: torch.Tensor, lr: float) -> tuple[torch.Tensor, Any]:
    r, n = bf.rank(), bf.size()
    self_weight, src_weights, dst_weights = 0.5, {(r - 1) % n: 0.5}, {(r + 1) % n: 1.0}
    if n == 1:
        self_weight, src_weights, dst_weights = 1.0, {}, {}
    handle = bf.neighbor_allreduce_nonblocking(
        x, self_weight=self_weight, src_weights=src_weights, dst_weights=dst_weights
    )
    grad = 2 * x  # Communication in parallel
    # Wait() returns the tensor until the communication is done
    x = bf.wait(handle) - lr * grad
    return x, handle


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_listing_5_nonblocking_runs_unchanged(n: int) -> None:
    res = run_threads(lambda: listing_5(value(bf.rank()), 0.1), n)
    for r, (x, handle) in enumerate(res):
        assert isinstance(handle, int)
        mixed = value(r) if n == 1 else 0.5 * value(r) + 0.5 * value((r - 1) % n)
        assert torch.allclose(x, mixed - 0.2 * value(r), rtol=0, atol=1e-15)


# ---------------------------------------------------------------- collectives: nonblocking and in-place forms


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_collectives_nonblocking_and_in_place(n: int) -> None:
    def fn() -> dict[str, Any]:
        bf.init()
        r = bf.rank()
        t = value(r)
        out: dict[str, Any] = {"avg": bf.allreduce(t), "sum": bf.allreduce(t, average=False), "t": t.clone()}
        h = bf.allreduce_nonblocking(t, name="grad")
        out["handle_type"] = type(h)
        out["polled"] = isinstance(bf.poll(h), bool)
        out["nb"] = bf.synchronize(h)
        with pytest.raises(InvalidArgumentError, match="handle"):
            bf.synchronize(h)  # a handle is waited on once
        u = value(r)
        out["inplace_same"] = bf.allreduce_(u) is u
        out["inplace"] = u
        v = value(r)
        bf.wait(bf.allreduce_nonblocking_(v, average=False))
        out["inplace_nb"] = v
        root = n - 1
        out["bcast"] = bf.broadcast(t, root)
        w = value(r)
        out["bcast_same"] = bf.broadcast_(w, root) is w
        out["bcast_inplace"] = w
        z = value(r)
        bf.synchronize(bf.broadcast_nonblocking_(z, root))
        out["bcast_nb"] = bf.synchronize(bf.broadcast_nonblocking(t, root))
        out["bcast_nb_inplace"] = z
        out["gather"] = bf.allgather(value(r, (r + 1, 2)))
        out["gather_nb"] = bf.wait(bf.allgather_nonblocking(torch.full((1,), float(r))))
        out["lowband_handle"] = bf.synchronize(lowband.iallreduce(t))  # lowband handles are accepted too
        bf.barrier()
        return out

    res = run_threads(fn, n)
    xs = torch.stack([value(r) for r in range(n)])
    for r, o in enumerate(res):
        assert o["handle_type"] is int and o["polled"]
        assert torch.allclose(o["avg"], xs.mean(0), atol=1e-15) and torch.allclose(
            o["sum"], xs.sum(0), atol=1e-14
        )
        assert torch.equal(o["t"], value(r))  # the out-of-place forms leave the input alone
        assert torch.allclose(o["nb"], xs.mean(0), atol=1e-15)
        assert o["inplace_same"] and torch.allclose(o["inplace"], xs.mean(0), atol=1e-15)
        assert torch.allclose(o["inplace_nb"], xs.sum(0), atol=1e-14)
        for k in ("bcast", "bcast_inplace", "bcast_nb", "bcast_nb_inplace"):
            assert torch.equal(o[k], value(n - 1))
        assert o["bcast_same"]
        assert torch.equal(o["gather"], torch.cat([value(q, (q + 1, 2)) for q in range(n)]))
        assert torch.equal(o["gather_nb"], torch.arange(n, dtype=torch.float32))
        assert torch.allclose(o["lowband_handle"], xs.mean(0), atol=1e-15)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_neighbor_ops_static_and_dynamic(n: int) -> None:
    def fn() -> dict[str, Any]:
        bf.init(topology_fn=topology_util.RingGraph)
        r = bf.rank()
        out = {
            "in": bf.in_neighbor_ranks(),
            "out": bf.out_neighbor_ranks(),
            "static": bf.neighbor_allreduce(value(r)),
        }
        out["gather"] = bf.neighbor_allgather(value(r, (1, 2)))
        out["gather_nb"] = bf.synchronize(
            bf.neighbor_allgather_nonblocking(value(r, (1, 2)), enable_topo_check=False)
        )
        dst = [(r + 1) % n] if n > 1 else []
        src = [(r - 1) % n] if n > 1 else []
        out["dyn_gather"] = bf.neighbor_allgather(value(r, (1, 2)), src_ranks=src, dst_ranks=dst)
        # push-style: keep a third, send a third to each of the next two ranks (dst as a list: scale 1)
        outs = sorted({(r + 1) % n, (r + 2) % n} - {r})
        out["push"] = bf.neighbor_allreduce(
            value(r) / 3, self_weight=1 / (len(outs) + 1) * 3, dst_weights=outs, enable_topo_check=False
        )
        return out

    res = run_threads(fn, n)
    for r, o in enumerate(res):
        ins = sorted({(r - 1) % n, (r + 1) % n} - {r})
        assert o["in"] == ins and o["out"] == ins
        mean = torch.stack([value(q) for q in [r, *ins]]).mean(0)
        assert torch.allclose(o["static"], mean, atol=1e-15)
        expect = torch.cat([value(q, (1, 2)) for q in ins]) if ins else torch.empty(0, 2, dtype=torch.float64)
        assert torch.equal(o["gather"], expect) and torch.equal(o["gather_nb"], expect)
        prev = [(r - 1) % n] if n > 1 else []
        assert torch.equal(o["dyn_gather"], torch.cat([value(q, (1, 2)) for q in prev]) if prev else expect)
        senders = [q for q in range(n) if q != r and r in {(q + 1) % n, (q + 2) % n}]
        own = 1 / (len(sorted({(r + 1) % n, (r + 2) % n} - {r})) + 1)
        push = own * value(r) + sum((value(q) / 3 for q in senders), torch.zeros(3, dtype=torch.float64))
        assert torch.allclose(o["push"], push, atol=1e-15)


def test_hierarchical_ops_and_machine_topology() -> None:
    def fn() -> dict[str, Any]:
        bf.init()
        r = bf.rank()
        out: dict[str, Any] = {
            "layout": (bf.machine_size(), bf.machine_rank(), bf.local_size(), bf.local_rank())
        }
        out["local_avg"] = bf.allreduce(value(r), is_hierarchical_local=True)
        out["machines"] = (bf.in_neighbor_machine_ranks(), bf.out_neighbor_machine_ranks())
        assert bf.set_machine_topology(topology_util.ExponentialTwoGraph(2))
        out["graph_is_same"] = bf.load_machine_topology() is not None
        out["static"] = bf.hierarchical_neighbor_allreduce(value(r))
        other = 1 - bf.machine_rank()
        h = bf.hierarchical_neighbor_allreduce_nonblocking(value(r), 0.75, {other: 0.25}, {other: 1.0})
        out["weighted"] = bf.synchronize(h)
        return out

    res = run_threads(fn, 4, local_size=2)
    machine_avg = [torch.stack([value(2 * m), value(2 * m + 1)]).mean(0) for m in range(2)]
    for r, o in enumerate(res):
        m = r // 2
        assert o["layout"] == (2, m, 2, r % 2)
        assert torch.allclose(o["local_avg"], machine_avg[m], atol=1e-15)
        assert o["machines"] == ([1 - m], [1 - m])
        assert torch.allclose(o["static"], (machine_avg[0] + machine_avg[1]) / 2, atol=1e-15)
        assert torch.allclose(o["weighted"], 0.75 * machine_avg[m] + 0.25 * machine_avg[1 - m], atol=1e-15)


# ---------------------------------------------------------------- topologies


def chain_graph(n: int) -> nx.DiGraph:
    """i -> i+1 with weight 0.3 and self weights 0.7 (rank 0 keeps everything): not uniform."""
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edge(0, 0, weight=1.0)
    for i in range(1, n):
        g.add_edge(i - 1, i, weight=0.3)
        g.add_edge(i, i, weight=0.7)
    return g


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_set_topology_weighted_and_uniform(n: int) -> None:
    def fn() -> dict[str, Any]:
        bf.init()
        r = bf.rank()
        g = chain_graph(n)
        out: dict[str, Any] = {"set": bf.set_topology(g), "same_object": bf.load_topology() is g}
        out["weighted_flag"] = bf.is_topo_weighted()
        out["uniform"] = bf.neighbor_allreduce(value(r))
        out["again"] = bf.set_topology(chain_graph(n))  # an equivalent graph: a no-op, as in BlueFog
        out["kept_first"] = bf.load_topology() is g
        bf.set_topology(g, is_weighted=True)
        out["weighted_flag2"] = bf.is_topo_weighted()
        out["weighted"] = bf.neighbor_allreduce(value(r))
        bf.win_create(value(r), "blocker")
        out["refused"] = bf.set_topology(topology_util.RingGraph(n))  # windows exist: refused
        out["kept"] = bf.load_topology() is g
        bf.win_free()
        out["default"] = bf.set_topology() and topology_util.IsTopologyEquivalent(
            bf.load_topology(), topology_util.ExponentialTwoGraph(n)
        )
        with pytest.raises(InvalidArgumentError, match=r"networkx\.DiGraph"):
            bf.set_topology([[1]])
        with pytest.raises(InvalidArgumentError, match="nodes"):
            bf.set_topology(topology_util.RingGraph(n + 1))
        return out

    res = run_threads(fn, n)
    for r, o in enumerate(res):
        assert o["set"] and o["again"] and o["default"] and o["kept"]
        # with one rank every graph is equivalent to the default one set by init(): nothing changes
        # until is_weighted changes
        assert o["same_object"] is o["kept_first"] is (n > 1)
        assert not o["weighted_flag"] and o["weighted_flag2"]
        assert o["refused"] is False
        if r == 0:
            assert torch.equal(o["uniform"], value(0)) and torch.equal(o["weighted"], value(0))
        else:
            assert torch.allclose(o["uniform"], (value(r) + value(r - 1)) / 2, atol=1e-15)
            assert torch.allclose(o["weighted"], 0.7 * value(r) + 0.3 * value(r - 1), atol=1e-15)


# ---------------------------------------------------------------- windows


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_window_ops(n: int) -> None:
    def fn() -> dict[str, Any]:
        bf.init(topology_fn=topology_util.RingGraph)
        r = bf.rank()
        ins = bf.in_neighbor_ranks()
        x = value(r)
        out: dict[str, Any] = {
            "create": bf.win_create(x, "x"),
            "names": bf.get_current_created_window_names(),
        }
        out["put"] = bf.win_put(x, "x")
        bf.barrier()  # every put has been applied
        out["versions"] = bf.get_win_version("x")
        out["update"] = bf.win_update("x").clone()  # uniform over self and in-neighbors
        out["update_is_registered"] = bf.win_update("x", clone=True) is not x
        bf.barrier()  # every rank has read its buffers before they are overwritten
        h = bf.win_put_nonblocking(x, "x", dst_weights={q: 2.0 for q in bf.out_neighbor_ranks()})
        out["put_handle"] = type(h)
        out["wait"] = bf.win_wait(h)
        bf.barrier()
        out["weighted"] = bf.win_update("x", 1.0, {q: 0.5 for q in ins}, reset=True, clone=True)
        out["get"] = bf.win_get("x")  # fetch each in-neighbor's registered tensor
        with bf.win_mutex("x", for_self=True):
            out["after_get"] = bf.win_update("x", 0.0, {q: 1.0 for q in ins}, clone=True)
        bf.barrier()
        y = torch.cat([value(r), torch.ones(1, dtype=torch.float64)])
        bf.win_create(y, "y", zero_init=True)
        bf.win_wait(bf.win_accumulate_nonblocking(y, "y", 0.5, {q: 0.25 for q in bf.out_neighbor_ranks()}))
        bf.barrier()
        with bf.win_lock("y"):
            pass
        out["collected"] = bf.win_update_then_collect("y").clone()
        hg = bf.win_get_nonblocking("x", require_mutex=True)
        bf.win_wait(hg)
        out["poll_after"] = isinstance(bf.win_poll(bf.win_put_nonblocking(x, "x")), bool)
        out["unknown_wait"] = bf.win_wait(10**9)
        bf.barrier()
        out["free"] = bf.win_free()
        out["names_after"] = bf.get_current_created_window_names()
        return out

    res = run_threads(fn, n)
    for r, o in enumerate(res):
        ins = sorted({(r - 1) % n, (r + 1) % n} - {r})
        assert o["create"] and o["names"] == ["x"] and o["put"] and o["wait"] and o["free"]
        assert o["put_handle"] is int and o["poll_after"] and o["unknown_wait"] is False
        assert o["versions"] == {q: 1 for q in ins}
        x = value(r)
        assert torch.allclose(o["update"], torch.stack([x] + [value(q) for q in ins]).mean(0), atol=1e-15)
        mixed = [
            torch.stack([value(q)] + [value(s) for s in sorted({(q - 1) % n, (q + 1) % n} - {q})]).mean(0)
            for q in range(n)
        ]
        assert torch.allclose(
            o["weighted"],
            mixed[r] + sum((mixed[q] for q in ins), torch.zeros(3, dtype=torch.float64)),
            atol=1e-14,
        )
        assert torch.allclose(
            o["after_get"], sum((mixed[q] for q in ins), torch.zeros(3, dtype=torch.float64)), atol=1e-14
        )
        # push-sum style accumulate: keep half, 1/4 to each out-neighbor; collect adds what arrived
        got = 0.5 * torch.cat([value(r), torch.ones(1, dtype=torch.float64)])
        for q in ins:
            got = got + 0.25 * torch.cat([value(q), torch.ones(1, dtype=torch.float64)])
        assert torch.allclose(o["collected"], got, atol=1e-15)
        assert o["names_after"] == []


# ---------------------------------------------------------------- optimizers


def _train(opt: torch.optim.Optimizer, model: nn.Module, steps: int) -> list[torch.Tensor]:
    for k in range(steps):
        data, target = batch(lowband.rank(), k)
        opt.zero_grad()
        nn.functional.mse_loss(model(data), target).backward()
        opt.step()
    sync = getattr(opt, "synchronize", None)
    if callable(sync):
        sync()
    return [p.detach().clone() for p in model.parameters()]


FACTORIES: dict[str, tuple[Callable[..., Any], type, dict[str, Any]]] = {
    "atc": (bf.DistributedAdaptThenCombineOptimizer, AdaptThenCombineOptimizer, {}),
    "awc": (bf.DistributedAdaptWithCombineOptimizer, AdaptWithCombineOptimizer, {}),
    "atc-allreduce": (
        lambda o, m: bf.DistributedAdaptThenCombineOptimizer(o, m, bf.CommunicationType.allreduce, 2),
        AdaptThenCombineOptimizer,
        {"communication_type": "allreduce", "num_steps_per_communication": 2},
    ),
    "gradient-allreduce": (bf.DistributedGradientAllreduceOptimizer, GradientAllreduceOptimizer, {}),
}


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_optimizer_factories_match_lowband_classes(kind: str, n: int) -> None:
    make, cls, kwargs = FACTORIES[kind]

    def fn() -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
        bf.init()
        model = seeded_model(7)
        groups = [{"params": model[0].parameters(), "lr": 0.05}, {"params": model[2].parameters()}]
        opt = make(torch.optim.SGD(groups, lr=0.1, momentum=0.9), model)
        got = _train(opt, model, 4)
        ref_model = seeded_model(7)
        lrs = {id(p): 0.05 for p in ref_model[0].parameters()}
        ref = cls(
            ref_model,
            lambda ps: torch.optim.SGD(
                [{"params": [p], "lr": lrs.get(id(p), 0.1)} for p in ps], lr=0.1, momentum=0.9
            ),
            **kwargs,
        )
        return got, _train(ref, ref_model, 4), isinstance(opt, cls)

    for got, ref, is_cls in run_threads(fn, n, check=False):
        assert is_cls
        assert all(torch.allclose(a, b, rtol=0, atol=1e-15) for a, b in zip(got, ref))
        assert not all(torch.equal(a, b) for a, b in zip(got, seeded_model(7).parameters()))


def test_deprecated_factories_warn_and_map_to_adapt_with_combine() -> None:
    def fn() -> list[Any]:
        bf.init()
        out = []
        for make, kind in [
            (bf.DistributedAllreduceOptimizer, bf.CommunicationType.allreduce),
            (bf.DistributedNeighborAllreduceOptimizer, bf.CommunicationType.neighbor_allreduce),
            (
                bf.DistributedHierarchicalNeighborAllreduceOptimizer,
                bf.CommunicationType.hierarchical_neighbor_allreduce,
            ),
        ]:
            model = seeded_model(1)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt = make(torch.optim.SGD(model.parameters(), lr=0.1), model)
            out.append(
                (
                    isinstance(opt, AdaptWithCombineOptimizer),
                    opt.communication_type is kind,
                    any(issubclass(w.category, PendingDeprecationWarning) for w in caught),
                )
            )
        return out

    assert all(all(t) for r in run_threads(fn, 2, check=False) for t in r)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_win_put_optimizer(n: int) -> None:
    def fn() -> dict[str, Any]:
        bf.init()
        model = seeded_model(3)
        opt = bf.DistributedWinPutOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
        out: dict[str, Any] = {
            "cls": isinstance(opt, WinPutOptimizer),
            "windows": len(bf.get_current_created_window_names()),
        }
        opt.force_barrier = True
        opt.dst_weights = {q: 1.0 for q in bf.out_neighbor_ranks()}
        out["params"] = _train(opt, model, 3)
        opt.close()
        out["after_close"] = bf.get_current_created_window_names()
        return out

    res = run_threads(fn, n, check=False)
    start = [p.detach() for p in seeded_model(3).parameters()]
    for o in res:
        assert o["cls"] and o["windows"] == 4 and o["after_close"] == []
        assert all(torch.isfinite(p).all() for p in o["params"])
        assert not all(torch.equal(a, b) for a, b in zip(o["params"], start))


def test_optimizer_factory_keeps_each_groups_hyperparameters() -> None:
    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    user = torch.optim.SGD([{"params": [a], "lr": 0.5}, {"params": [b], "momentum": 0.9}], lr=0.1)
    built = bf.optimizer_factory(user)([b, c, a])
    assert type(built) is torch.optim.SGD and built is not user
    by_param = {id(p): g for g in built.param_groups for p in g["params"]}
    assert by_param[id(a)]["lr"] == 0.5 and by_param[id(a)]["momentum"] == 0
    assert by_param[id(b)]["lr"] == 0.1 and by_param[id(b)]["momentum"] == 0.9
    assert by_param[id(c)]["lr"] == 0.1 and by_param[id(c)]["momentum"] == 0  # not the user's: defaults
    with pytest.raises(InvalidArgumentError, match=r"torch\.optim\.Optimizer"):
        bf.optimizer_factory("sgd")  # type: ignore[arg-type]


# ---------------------------------------------------------------- utilities, timeline, misc


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_parameter_and_optimizer_state_utilities(n: int) -> None:
    def fn() -> dict[str, Any]:
        bf.init()
        r = bf.rank()
        model = seeded_model(r)
        bf.broadcast_parameters(model.state_dict(), root_rank=n - 1)
        out: dict[str, Any] = {"bcast": [p.detach().clone() for p in model.parameters()]}
        model2 = seeded_model(r)
        bf.allreduce_parameters(model2.named_parameters())
        out["avg"] = [p.detach().clone() for p in model2.parameters()]
        opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
        if r == 0:  # only the root has state
            data, target = batch(0, 0)
            nn.functional.mse_loss(model(data), target).backward()
            opt.step()
        bf.broadcast_optimizer_state(opt, root_rank=0)
        out["state"] = opt.state_dict()
        return out

    res = run_threads(fn, n)
    models = [list(seeded_model(r).parameters()) for r in range(n)]
    for o in res:
        assert all(torch.equal(a, b) for a, b in zip(o["bcast"], models[n - 1]))
        mean = [torch.stack([m[i] for m in models]).mean(0) for i in range(len(models[0]))]
        assert all(torch.allclose(a, b, atol=1e-15) for a, b in zip(o["avg"], mean))
        s, s0 = o["state"], res[0]["state"]
        assert s["param_groups"][0]["lr"] == 0.01
        assert s["state"].keys() == s0["state"].keys() and len(s0["state"]) == 4
        assert all(torch.equal(s["state"][k]["exp_avg"], s0["state"][k]["exp_avg"]) for k in s0["state"])


def test_timeline_and_queries() -> None:
    def fn() -> dict[str, Any]:
        bf.init()
        out: dict[str, Any] = {"off": bf.timeline_start_activity("w", "FORWARD")}
        lowband.set_trace(True)
        out["on"] = bf.timeline_start_activity("w", "FORWARD") and bf.timeline_end_activity("w")
        with bf.timeline_context("w", "BACKWARD"):
            pass
        out["no_open"] = bf.timeline_end_activity("w")
        out["calls"] = lowband.counters()["timeline"]["calls"]
        out["queries"] = (
            bf.mpi_threads_supported(),
            bf.unified_mpi_window_model_supported(),
            bf.is_homogeneous(),
        )
        bf.set_skip_negotiate_stage(True)
        out["skip"] = bf.get_skip_negotiate_stage()
        bf.set_skip_negotiate_stage(False)
        out["noskip"] = bf.get_skip_negotiate_stage()
        return out

    for o in run_threads(fn, 2):
        assert o["off"] is False and o["on"] is True and o["no_open"] is False and o["calls"] == 2
        assert o["queries"] == (False, True, True)
        assert o["skip"] is True and o["noskip"] is False


def test_bad_arguments_are_reported() -> None:
    def fn() -> None:
        bf.init()
        x = value(0)
        with pytest.raises(TypeError):
            bf.neighbor_allreduce(x, 0.5, {})  # type: ignore[misc] # keyword-only, as in BlueFog 0.3
        with pytest.raises(InvalidArgumentError, match="handle"):
            bf.synchronize(12345)
        with pytest.raises(InvalidArgumentError, match="handle"):
            bf.poll("not a handle")
        with pytest.raises(InvalidArgumentError, match="params"):
            bf.broadcast_parameters(3, 0)

    run_threads(fn, 2)


def test_topology_set_through_lowband_is_seen_and_replaced() -> None:
    def fn() -> tuple[bool, bool, bool, bool]:
        bf.init()
        g = topology_util.RingGraph(3)
        bf.set_topology(g)
        dstate.set_topology(fully_connected(3))  # lowband's own call, behind the compat layer's back
        seen = topology_util.IsTopologyEquivalent(bf.load_topology(), topology_util.FullyConnectedGraph(3))
        not_g = bf.load_topology() is not g
        again = bf.set_topology(g)  # not skipped: lowband's topology is no longer g's
        return seen, not_g, again, dstate.load_topology() == ring(3)

    assert all(all(r) for r in run_threads(fn, 3))
