"""Hierarchical neighbor allreduce against a single-process oracle.

Machines are ``local_size`` consecutive ranks. The oracle averages each machine's inputs (``a_m``) and
mixes the machine averages with the machine weights (``W_machine @ A``, or the push/pull formula); every
rank of machine ``m`` must get row ``m``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from oracle import data

import lowband
from lowband.decentral import (
    hierarchical_neighbor_allreduce,
    ihierarchical_neighbor_allreduce,
    in_neighbor_machine_ranks,
    load_machine_topology,
    out_neighbor_machine_ranks,
    set_machine_topology,
)
from lowband.errors import InvalidArgumentError
from lowband.testing import run_threads
from lowband.topology import Topology, exponential_two, fully_connected, ring, star

TOL = 1e-12
SHAPE = (4, 3)
LAYOUTS = [(4, 2), (6, 2), (6, 3), (3, 3), (3, 1), (2, 1), (1, 1)]  # (world size, local size)


def _inputs(n: int, salt: int) -> list[torch.Tensor]:
    return [data(r, SHAPE, torch.float64, salt, integer=False) for r in range(n)]


def _machine_avgs(xs: list[torch.Tensor], ls: int) -> list[torch.Tensor]:
    return [torch.stack(xs[m * ls : (m + 1) * ls]).mean(0) for m in range(len(xs) // ls)]


def _mix(w: np.ndarray, avgs: list[torch.Tensor]) -> list[torch.Tensor]:
    wt = torch.from_numpy(np.array(w, dtype=np.float64))
    return list((wt @ torch.stack(avgs).reshape(len(avgs), -1)).reshape(len(avgs), *avgs[0].shape))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=TOL, atol=TOL)


def _run(fn: Callable[[], list[str]], n: int, ls: int) -> None:
    for bad in run_threads(fn, n, timeout=60, local_size=ls):
        assert not bad, "\n".join(bad)


def _custom(m: int) -> Topology:
    rng = np.random.default_rng(300 + m)
    w = rng.uniform(0.1, 1.0, (m, m)) * (rng.uniform(size=(m, m)) < 0.6)
    np.fill_diagonal(w, 0.5)
    return Topology.from_matrix(w / w.sum(1, keepdims=True))


@pytest.mark.parametrize(("n", "ls"), LAYOUTS, ids=[f"n{n}-local{ls}" for n, ls in LAYOUTS])
def test_static_machine_topologies(n: int, ls: int) -> None:
    nm = n // ls

    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        m = r // ls
        xs = _inputs(n, 1)
        want = _mix(exponential_two(nm).weights, _machine_avgs(xs, ls))[m]
        got = hierarchical_neighbor_allreduce(xs[r])
        if not _close(got, want):
            bad.append(f"rank {r}: default machine topology: {got} != {want}")
        for k, build in enumerate((ring, star, fully_connected, _custom)):
            topo = build(nm)
            xs = _inputs(n, 2 + k)
            want = _mix(topo.weights, _machine_avgs(xs, ls))[m]
            if not _close(hierarchical_neighbor_allreduce(xs[r], machine_topology=topo), want):
                bad.append(f"rank {r}: machine_topology={topo!r}")
            set_machine_topology(topo)
            if load_machine_topology() != topo or in_neighbor_machine_ranks() != topo.in_neighbors(m):
                bad.append(f"rank {r}: set/load_machine_topology, in_neighbor_machine_ranks")
            if out_neighbor_machine_ranks() != topo.out_neighbors(m):
                bad.append(f"rank {r}: out_neighbor_machine_ranks")
            mine = xs[r].clone()
            got = hierarchical_neighbor_allreduce(mine, check_topology=k % 2 == 0, inplace=True)
            if not (got is mine and _close(mine, want)):
                bad.append(f"rank {r}: set_machine_topology({topo!r}), in place")
        set_machine_topology(None)
        if load_machine_topology() != exponential_two(nm):
            bad.append(f"rank {r}: set_machine_topology(None)")
        return bad

    _run(rank_fn, n, ls)


@pytest.mark.parametrize(("n", "ls"), LAYOUTS, ids=[f"n{n}-local{ls}" for n, ls in LAYOUTS])
def test_machine_push_pull_weights(n: int, ls: int) -> None:
    nm = n // ls

    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        m = r // ls
        rng = np.random.default_rng(17 * n + ls)
        e = rng.uniform(size=(nm, nm)) < 0.6
        np.fill_diagonal(e, False)
        rw, sw, a = rng.uniform(0.1, 1, (nm, nm)), rng.uniform(0.1, 1, (nm, nm)), rng.uniform(0.1, 1, nm)
        src = [j for j in range(nm) if e[m, j]]
        dst = [k for k in range(nm) if e[k, m]]
        xs = _inputs(n, 20)
        avgs = _machine_avgs(xs, ls)

        def formula(rr: np.ndarray, ss: np.ndarray) -> torch.Tensor:
            out = a[m] * avgs[m]
            for j in src:
                out = out + float(rr[m, j] * ss[m, j]) * avgs[j]
            return out

        ones = np.ones((nm, nm))
        cases = {
            "pull": ({"src_machine_weights": {j: rw[m, j] for j in src}}, formula(rw, ones)),
            "push": ({"dst_machine_weights": {k: sw[k, m] for k in dst}}, formula(ones, sw)),
            "push-pull": (
                {"src_machine_weights": {j: rw[m, j] for j in src}, "dst_machine_weights": dst},
                formula(rw, ones),
            ),
        }
        for label, (kw, want) in cases.items():
            got = hierarchical_neighbor_allreduce(xs[r], self_weight=a[m], **kw)  # type: ignore[arg-type]
            if not _close(got, want):
                bad.append(f"rank {r} {label}: {got} != {want}")
        return bad

    _run(rank_fn, n, ls)


@pytest.mark.parametrize(("n", "ls"), [(4, 2), (6, 3)])
def test_handles_in_flight_waited_in_reverse_order(n: int, ls: int) -> None:
    nm = n // ls

    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        topos = [ring(nm), fully_connected(nm), exponential_two(nm), star(nm)]
        handles, wants = [], []
        for k, topo in enumerate(topos):
            xs = _inputs(n, 40 + k)
            handles.append(ihierarchical_neighbor_allreduce(xs[r], machine_topology=topo))
            wants.append(_mix(topo.weights, _machine_avgs(xs, ls))[r // ls])
        for k in reversed(range(len(handles))):
            if not _close(handles[k].wait(), wants[k]):
                bad.append(f"rank {r}: handle {k}")
        return bad

    _run(rank_fn, n, ls)


@pytest.mark.parametrize(("n", "ls"), [(4, 2), (2, 2)])
def test_bad_arguments(n: int, ls: int) -> None:
    nm = n // ls

    def rank_fn() -> list[str]:
        r, out = lowband.rank(), []
        m = r // ls
        x = torch.zeros(3, dtype=torch.float64)
        calls: dict[str, Callable[[], object]] = {
            "own machine": lambda: hierarchical_neighbor_allreduce(
                x, self_weight=0.5, src_machine_weights={m: 0.5}
            ),
            "machine out of range": lambda: hierarchical_neighbor_allreduce(
                x, self_weight=0.5, dst_machine_weights=[nm]
            ),
            "no self weight": lambda: hierarchical_neighbor_allreduce(x, src_machine_weights={}),
            "nan": lambda: hierarchical_neighbor_allreduce(
                x, self_weight=float("nan"), dst_machine_weights=[]
            ),
            "topology size": lambda: hierarchical_neighbor_allreduce(x, machine_topology=ring(nm + 1)),
            "int tensor": lambda: hierarchical_neighbor_allreduce(torch.zeros(2, dtype=torch.int64)),
            "set_machine_topology size": lambda: set_machine_topology(ring(nm + 1)),
        }
        for label, call in calls.items():
            try:
                call()
                out.append(f"rank {r}: {label}: no error")
            except InvalidArgumentError as exc:
                if f"on rank {r}" not in str(exc):
                    out.append(f"rank {r}: {label}: message does not name the rank: {exc}")
                if label == "no self weight" and "src_machine_weights needs self_weight" not in str(exc):
                    out.append(f"rank {r}: {label}: message does not name the machine argument: {exc}")
        return out

    _run(rank_fn, n, ls)
