"""BlueFog 0.3's public names and their documented behaviour, at 3 and 4 thread-ranks: every name of
``bluefog.torch``, ``bluefog.torch.topology_util`` and ``bluefog.common.topology_util``; ``pair_gossip``;
``suspend``/``resume``; the collective ``Infer*`` calls; dtypes gloo lacks; rank lists of any sequence
type; uniform neighbor averaging computed as ``(x + sum_j x_j) / (n + 1)``; the exception classes BlueFog
raises. Each expectation is BlueFog's documented result, rebuilt in one process (the oracle)."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch

import lowband.compat.bluefog.torch as bf
from lowband.compat.bluefog.common import topology_util as common_tu
from lowband.compat.bluefog.torch import topology_util as torch_tu
from lowband.errors import InvalidArgumentError
from lowband.testing import run_threads

SIZES = (3, 4)

#: every public name of bluefog/torch/__init__.py in BlueFog 0.3 (mpi_ops, optimizers, utility,
#: topology_util re-exports)
BLUEFOG_TORCH = [
    "init",
    "shutdown",
    "size",
    "local_size",
    "rank",
    "local_rank",
    "machine_size",
    "machine_rank",
    "load_topology",
    "set_topology",
    "load_machine_topology",
    "set_machine_topology",
    "is_topo_weighted",
    "is_machine_topo_weighted",
    "in_neighbor_ranks",
    "out_neighbor_ranks",
    "in_neighbor_machine_ranks",
    "out_neighbor_machine_ranks",
    "mpi_threads_supported",
    "unified_mpi_window_model_supported",
    "nccl_built",
    "is_homogeneous",
    "suspend",
    "resume",
    "allreduce",
    "allreduce_nonblocking",
    "allreduce_",
    "allreduce_nonblocking_",
    "allgather",
    "allgather_nonblocking",
    "broadcast",
    "broadcast_nonblocking",
    "broadcast_",
    "broadcast_nonblocking_",
    "neighbor_allgather",
    "neighbor_allgather_nonblocking",
    "neighbor_allreduce",
    "neighbor_allreduce_nonblocking",
    "hierarchical_neighbor_allreduce",
    "hierarchical_neighbor_allreduce_nonblocking",
    "pair_gossip",
    "pair_gossip_nonblocking",
    "poll",
    "synchronize",
    "wait",
    "barrier",
    "win_create",
    "win_free",
    "win_update",
    "win_update_then_collect",
    "win_put_nonblocking",
    "win_put",
    "win_get_nonblocking",
    "win_get",
    "win_accumulate_nonblocking",
    "win_accumulate",
    "win_wait",
    "win_poll",
    "win_mutex",
    "get_win_version",
    "get_current_created_window_names",
    "win_associated_p",
    "turn_on_win_ops_with_associated_p",
    "turn_off_win_ops_with_associated_p",
    "set_skip_negotiate_stage",
    "get_skip_negotiate_stage",
    "timeline_start_activity",
    "timeline_end_activity",
    "timeline_context",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "allreduce_parameters",
    "CommunicationType",
    "DistributedAdaptThenCombineOptimizer",
    "DistributedAdaptWithCombineOptimizer",
    "DistributedGradientAllreduceOptimizer",
    "DistributedWinPutOptimizer",
    "DistributedAllreduceOptimizer",
    "DistributedNeighborAllreduceOptimizer",
    "DistributedHierarchicalNeighborAllreduceOptimizer",
    "InferSourceFromDestinationRanks",
    "InferDestinationFromSourceRanks",
    "IsTopologyEquivalent",
    "GetRecvWeights",
    "GetSendWeights",
    "IsRegularGraph",
    "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks",
    "GetInnerOuterRingDynamicSendRecvRanks",
    "GetInnerOuterExpo2DynamicSendRecvRanks",
    "topology_util",
]

#: bluefog/common/topology_util.py's public functions in BlueFog 0.3
BLUEFOG_COMMON_TOPOLOGY = [
    "ExponentialTwoGraph",
    "ExponentialGraph",
    "SymmetricExponentialGraph",
    "MeshGrid2DGraph",
    "StarGraph",
    "RingGraph",
    "FullyConnectedGraph",
    "IsTopologyEquivalent",
    "IsRegularGraph",
    "GetRecvWeights",
    "GetSendWeights",
    "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks",
    "GetInnerOuterRingDynamicSendRecvRanks",
    "GetInnerOuterExpo2DynamicSendRecvRanks",
]

#: bluefog/torch/topology_util.py: the collective Infer* calls and the re-exports of the common module
BLUEFOG_TORCH_TOPOLOGY = [
    *BLUEFOG_COMMON_TOPOLOGY,
    "InferSourceFromDestinationRanks",
    "InferDestinationFromSourceRanks",
]


@pytest.mark.parametrize("name", BLUEFOG_TORCH)
def test_every_bluefog_torch_name_exists(name: str) -> None:
    assert hasattr(bf, name), name
    assert name in bf.__all__


def test_topology_modules_hold_every_name_and_bf_reexports_them() -> None:
    for name in BLUEFOG_COMMON_TOPOLOGY:
        assert callable(getattr(common_tu, name)), name
    for name in BLUEFOG_TORCH_TOPOLOGY:
        assert getattr(torch_tu, name) is getattr(common_tu, name), name
        if name.startswith(("Is", "Get", "Infer")):
            assert getattr(bf, name) is getattr(common_tu, name), name
    assert bf.topology_util is torch_tu


def _x(rank: int, n: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(11 * rank + 3)
    return torch.randn(n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("n", SIZES)
def test_pair_gossip_averages_or_weighs_the_pair(n: int) -> None:
    def fn() -> list[torch.Tensor]:
        bf.init()
        r = bf.rank()
        peer = r ^ 1 if (r ^ 1) < n else None
        if peer is None:  # the odd rank out talks to nobody this round
            return []
        x = _x(r)
        avg = bf.pair_gossip(x, peer)
        weighted = bf.synchronize(bf.pair_gossip_nonblocking(x, peer, self_weight=0.25, pair_weight=0.75))
        assert torch.equal(x, _x(r)), "the input must not change"
        return [avg, weighted]

    for r, got in enumerate(run_threads(fn, n)):
        if not got:
            continue
        peer = r ^ 1
        torch.testing.assert_close(got[0], (_x(r) + _x(peer)) / 2, rtol=0, atol=1e-15)
        torch.testing.assert_close(got[1], 0.25 * _x(r) + 0.75 * _x(peer), rtol=0, atol=1e-15)


def test_suspend_and_resume_leave_ops_working() -> None:
    def fn() -> torch.Tensor:
        bf.init()
        bf.suspend()
        bf.resume()
        out: torch.Tensor = bf.allreduce(torch.ones(2) * bf.rank(), average=False)
        return out

    for got in run_threads(fn, 3):
        assert got.tolist() == [3.0, 3.0]


def _dst(r: int, n: int) -> list[int]:
    """Rank r's destinations: r+1, and r+2 for even r (an irregular graph)."""
    out = [(r + 1) % n]
    if r % 2 == 0 and (r + 2) % n not in out and (r + 2) % n != r:
        out.append((r + 2) % n)
    return out


@pytest.mark.parametrize("n", SIZES)
def test_infer_functions_are_collective_on_this_ranks_list(n: int) -> None:
    def fn() -> tuple[list[int], list[int], np.ndarray, list[int], list[int]]:
        bf.init()
        r = bf.rank()
        srcs = bf.InferSourceFromDestinationRanks(np.array(_dst(r, n)))
        srcs2, w = bf.InferSourceFromDestinationRanks(tuple(_dst(r, n)), construct_adjacency_matrix=True)
        dsts = bf.topology_util.InferDestinationFromSourceRanks(srcs)
        empty = bf.InferSourceFromDestinationRanks([])  # nobody sends: no sources anywhere
        return srcs, srcs2, w, dsts, empty

    res = run_threads(fn, n)
    edges = {(i, j) for i in range(n) for j in _dst(i, n)}
    for r, (srcs, srcs2, w, dsts, empty) in enumerate(res):
        want = sorted(i for i, j in edges if j == r)
        assert srcs == want and srcs2 == want, (r, srcs, want)
        assert dsts == sorted(_dst(r, n))
        assert empty == []
        # W[i, j]: the weight of edge i -> j; each receiver averages itself and its sources uniformly
        for j in range(n):
            col = [i for i in range(n) if i == j or (i, j) in edges]
            assert np.allclose(w[col, j], 1.0 / len(col)) and np.isclose(w[:, j].sum(), 1.0)
            assert all(w[i, j] == 0 for i in range(n) if i not in col)


@pytest.mark.parametrize("n", SIZES)
def test_int16_and_other_integer_dtypes_move_as_bluefog_accepts_them(n: int) -> None:
    def fn() -> list[torch.Tensor]:
        bf.init()
        r = bf.rank()
        outs = []
        for dt in (torch.int16, torch.int8, torch.uint8, torch.int32, torch.int64):
            x = (torch.arange(4) + 10 * r).to(dt)
            outs += [bf.broadcast(x, 1), bf.allgather(x), bf.allreduce(x, average=False)]
        return outs

    for got in run_threads(fn, n):
        for k, dt in enumerate((torch.int16, torch.int8, torch.uint8, torch.int32, torch.int64)):
            xs = [(torch.arange(4) + 10 * r).to(dt) for r in range(n)]
            b, g, s = got[3 * k : 3 * k + 3]
            assert b.dtype == dt and torch.equal(b, xs[1])
            assert g.dtype == dt and torch.equal(g, torch.cat(xs))
            assert s.dtype == dt and torch.equal(s, sum(xs[1:], xs[0]))


@pytest.mark.parametrize("n", SIZES)
def test_rank_lists_may_be_numpy_arrays_tuples_or_ranges(n: int) -> None:
    def fn() -> list[torch.Tensor]:
        bf.init()
        r = bf.rank()
        nxt, prv = (r + 1) % n, (r - 1) % n
        x = _x(r)
        a = bf.neighbor_allreduce(
            x, self_weight=0.5, src_weights={np.int64(prv): np.float64(0.5)}, dst_weights=np.array([nxt])
        )
        b = bf.neighbor_allgather(x, src_ranks=np.array([prv]), dst_ranks=(nxt,))
        c = bf.neighbor_allgather(x, src_ranks=range(prv, prv + 1), dst_ranks=[np.int32(nxt)])
        return [a, b, c]

    for r, (a, b, c) in enumerate(run_threads(fn, n)):
        prv = (r - 1) % n
        torch.testing.assert_close(a, (_x(r) + _x(prv)) / 2, rtol=0, atol=1e-15)
        assert torch.equal(b, _x(prv)) and torch.equal(c, _x(prv))


def _big(rank: int) -> torch.Tensor:
    """Integer-valued float32 data whose sums are exact but whose 1/(n+1)-weighted sums are not."""
    return torch.tensor([4_000_001.0 - 7 * rank, 3.0 * rank + 1, 1_234_567.0 + rank], dtype=torch.float32)


@pytest.mark.parametrize("n", SIZES)
def test_uniform_neighbor_averaging_is_exact_on_integer_data(n: int) -> None:
    def fn() -> list[torch.Tensor]:
        bf.init()  # exponential-2 graph, uniform weights
        r = bf.rank()
        srcs = bf.in_neighbor_ranks()
        u = 1.0 / (len(srcs) + 1)
        static = bf.neighbor_allreduce(_big(r))
        explicit = bf.neighbor_allreduce(_big(r), self_weight=u, src_weights=dict.fromkeys(srcs, u))
        return [static, explicit, torch.tensor(srcs)]

    for r, (static, explicit, srcs) in enumerate(run_threads(fn, n)):
        # BlueFog: (x + sum_j x_j) / (n + 1), the sum exact in float32, one correctly rounded division
        total = _big(r).double() + sum(
            (_big(int(j)).double() for j in srcs), torch.zeros(3, dtype=torch.float64)
        )
        want = (total / (len(srcs) + 1)).float()
        assert torch.equal(static, want), (static, want)
        assert torch.equal(explicit, want)


@pytest.mark.parametrize("n", SIZES)
def test_errors_are_the_classes_bluefog_raises(n: int) -> None:
    def fn() -> list[str]:
        bf.init()
        r = bf.rank()
        caught = []
        # a dynamic call whose senders and receivers disagree: rank 0 sends to 1, nobody lists 0
        dst = [1] if r == 0 else [(r + 1) % n]
        src = {(r - 1) % n: 0.5} if r not in (1,) else {2 % n: 0.5}
        try:
            bf.neighbor_allreduce(
                _x(r), self_weight=0.5, src_weights=src, dst_weights=dst, enable_topo_check=True
            )
        except ValueError as exc:
            caught.append(type(exc).__name__)
        try:
            bf.set_topology(nx.Graph())  # not a DiGraph
        except TypeError as exc:
            caught.append(type(exc).__name__)
            assert "networkx.DiGraph" in str(exc)
        try:
            bf.neighbor_allreduce(_x(r), self_weight=0.5)
        except ValueError as exc:
            caught.append(type(exc).__name__)
            assert isinstance(exc, InvalidArgumentError)
        return caught

    for got in run_threads(fn, n):
        assert got == ["TopologyMismatchError", "TopologyTypeError", "InvalidArgumentError"], got


#: BlueFog 0.3's signatures of the names added here (bluefog/torch/mpi_ops.py, bluefog/torch/topology_util.py);
#: a trailing keyword-only argument is lowband's extension
NEW_SIGNATURES = {
    "pair_gossip": ["tensor", "target_rank", "self_weight", "pair_weight", "name"],
    "pair_gossip_nonblocking": ["tensor", "target_rank", "self_weight", "pair_weight", "name"],
    "suspend": [],
    "resume": [],
    "win_associated_p": ["name"],
    "turn_on_win_ops_with_associated_p": [],
    "turn_off_win_ops_with_associated_p": [],
    "InferSourceFromDestinationRanks": ["dst_ranks", "construct_adjacency_matrix", "rank"],
    "InferDestinationFromSourceRanks": ["src_ranks", "construct_adjacency_matrix", "rank"],
}


@pytest.mark.parametrize("name", sorted(NEW_SIGNATURES))
def test_signatures_of_the_added_names(name: str) -> None:
    import inspect

    params = inspect.signature(getattr(bf, name)).parameters
    assert list(params) == NEW_SIGNATURES[name]
    positional = [p for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == [n for n in NEW_SIGNATURES[name] if n != "rank"]
    for p in positional[1:]:
        if p.name in ("self_weight", "pair_weight", "name"):
            assert p.default is None
        if p.name == "construct_adjacency_matrix":
            assert p.default is False


NEIGHBOR_WIN = ["put", "put_nonblocking", "get", "get_nonblocking", "accumulate", "accumulate_nonblocking"]


@pytest.mark.parametrize("op", NEIGHBOR_WIN)
def test_neighbor_win_names_are_the_window_ops(op: str) -> None:
    alias, name = getattr(bf, f"neighbor_win_{op}"), getattr(bf, f"win_{op}")
    assert alias.__wrapped__ is name.__wrapped__
    assert f"neighbor_win_{op}" in bf.__all__


def test_neighbor_win_ops_move_what_win_ops_move() -> None:
    def fn() -> list[torch.Tensor]:
        bf.init(topology_fn=torch_tu.RingGraph)
        r, ins = bf.rank(), bf.in_neighbor_ranks()
        bf.win_create(_x(r), "a")
        bf.win_create(torch.zeros(5, dtype=torch.float64), "b", zero_init=True)
        assert bf.neighbor_win_put(_x(r), "a")
        assert bf.win_wait(bf.neighbor_win_accumulate_nonblocking(_x(r), "b", 1.0))
        bf.barrier()
        got = [bf.win_update("a", 0.0, {q: 1.0 for q in ins}, clone=True)]
        got.append(bf.win_update("b", 0.0, {q: 1.0 for q in ins}, clone=True))
        bf.barrier()
        bf.win_free()
        return got

    for r, (a, b) in enumerate(run_threads(fn, 3)):
        expect = _x((r - 1) % 3) + _x((r + 1) % 3)
        assert torch.allclose(a, expect, atol=1e-12), r
        assert torch.allclose(b, expect, atol=1e-12), r
