"""Cases of BlueFog's own test suite (``test/torch_ops_test.py``, ``test/torch_basics_test.py``),
restated on 2-4 thread-ranks with the compat import: the gathered order of ``neighbor_allgather`` with
``src_ranks`` given, and ``set_topology`` while a window exists."""

from __future__ import annotations

from typing import Any

import networkx as nx
import numpy as np
import pytest
import torch

import lowband.compat.bluefog.torch as bf
from lowband.compat.bluefog.common import topology_util
from lowband.testing import run_threads


@pytest.mark.parametrize("n", [2, 3, 4])
def test_neighbor_allgather_order_dynamic(n: int) -> None:
    """BlueFog's ``test_neighbor_allgather_order_dynamic``: random permutations (numpy arrays) of the
    other ranks as sources and destinations; the gathered values come in the order of ``src_ranks``."""

    def fn() -> tuple[list[int], list[float], list[float]]:
        bf.init()
        r = bf.rank()
        rng = np.random.default_rng(100 + r)
        src_ranks = rng.permutation([i for i in range(n) if i != r])
        dst_ranks = rng.permutation(src_ranks)
        gathered = bf.neighbor_allgather(
            torch.FloatTensor([r]),
            dst_ranks=dst_ranks,  # type: ignore[arg-type]  # numpy arrays, as BlueFog's test passes
            src_ranks=src_ranks,  # type: ignore[arg-type]
        )
        default = bf.neighbor_allgather(torch.FloatTensor([r]))  # the static topology: in_neighbor_ranks
        return [int(s) for s in src_ranks], gathered.tolist(), default.tolist()

    res = run_threads(fn, n)
    for r, (src, gathered, default) in enumerate(res):
        assert gathered == [float(s) for s in src], r
        assert default == [float(j) for j in topology_util.ExponentialTwoGraph(n).predecessors(r) if j != r]
    if n == 4:  # the permutations are not all ascending, so the order is really the one given
        assert any(src != sorted(src) for src, _, _ in res)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_set_topology_fail_with_win_create(n: int) -> None:
    """BlueFog's ``test_set_topology_fail_with_win_create``: while a window exists a different topology
    is refused (False) and the default one stays. At 3 ranks the test's ``RingGraph(3)`` has the weights
    of the default ``ExponentialGraph(3)`` (every rank averages all three, 1/3 each); BlueFog's
    ``set_topology`` checks ``IsTopologyEquivalent`` before anything else and returns True for an
    equivalent graph (nothing changes), windows or not, and so does lowband: the upstream test's
    ``assert not is_set`` holds at 2 and 4 ranks only. A graph that does differ at 3 ranks is refused."""

    def fn() -> dict[str, Any]:
        bf.init()
        out: dict[str, Any] = {"created": bf.win_create(torch.FloatTensor([1]), "win_create_test")}
        if n == 2:
            graph = nx.from_numpy_array(np.array([[0, 0.2], [0.2, 0]]), create_using=nx.DiGraph)
        else:
            graph = topology_util.RingGraph(n)
        out["same_as_default"] = topology_util.IsTopologyEquivalent(graph, bf.load_topology())
        out["is_set"] = bf.set_topology(graph)
        out["kept"] = topology_util.IsTopologyEquivalent(
            bf.load_topology(), topology_util.ExponentialGraph(n)
        )
        # a graph unlike the default (RingGraph(2, ...) is the default one at 2 ranks)
        other = topology_util.RingGraph(n, connect_style=1) if n > 2 else graph
        out["other_set"] = bf.set_topology(other)
        out["kept_after_other"] = topology_util.IsTopologyEquivalent(
            bf.load_topology(), topology_util.ExponentialGraph(n)
        )
        out["freed"] = bf.win_free()
        out["set_after_free"] = bf.set_topology(other)
        return out

    for r, o in enumerate(run_threads(fn, n)):
        assert o["created"] and o["freed"] and o["set_after_free"], (r, o)
        assert o["kept"] and o["kept_after_other"], (r, o)
        assert o["other_set"] is False, (r, o)
        assert o["same_as_default"] is (n == 3), (r, o)
        assert o["is_set"] is (n == 3), (r, o)  # False as the upstream test asserts, except at 3 ranks
