"""Neighbor collectives (BlueFog partial averaging) at N = 1..4 against single-process oracles.

Every rank builds its seeded float64 input; the oracle rebuilds all of them in one process and computes
``W @ X`` (static and time-varying topologies) or the push/pull/push-pull formula
``a_i x_i + sum_j r_ij s_ij x_j`` from weights every rank draws from the same seed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from oracle import WORLD_SIZES, data

import lowband
from lowband.decentral import (
    grouped_neighbor_allreduce,
    igrouped_neighbor_allreduce,
    in_neighbor_ranks,
    ineighbor_allgather,
    ineighbor_allreduce,
    load_topology,
    neighbor_allgather,
    neighbor_allreduce,
    out_neighbor_ranks,
    set_topology,
)
from lowband.decentral.topocheck import Links, resolve
from lowband.errors import CollectiveMismatchError, CommTimeoutError, InvalidArgumentError
from lowband.testing import run_threads
from lowband.topology import (
    Topology,
    dynamic_one_peer_exponential_two,
    exponential_two,
    fully_connected,
    mesh_grid_2d,
    one_peer_exponential_two,
    ring,
    star,
)

TOL = 1e-12
SHAPE = (3, 5)


def _inputs(n: int, salt: int = 0, shape: tuple[int, ...] = SHAPE) -> list[torch.Tensor]:
    return [data(r, shape, torch.float64, salt, integer=False) for r in range(n)]


def _mix(w: np.ndarray, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The oracle ``W @ X``: row i of W applied to every rank's tensor."""
    wt = torch.from_numpy(np.array(w, dtype=np.float64))
    stacked = torch.stack(xs).reshape(len(xs), -1)
    return list((wt @ stacked).reshape(len(xs), *xs[0].shape))


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=tol, atol=tol)


def _run(fn: Callable[[], list[str]], n: int, **kw: object) -> None:
    for bad in run_threads(fn, n, timeout=60, **kw):  # type: ignore[arg-type]
        assert not bad, "\n".join(bad)


def _custom(n: int) -> Topology:
    """Random sparse row-stochastic weights (not symmetric, some ranks without neighbors)."""
    rng = np.random.default_rng(100 + n)
    w = rng.uniform(0.1, 1.0, (n, n)) * (rng.uniform(size=(n, n)) < 0.5)
    np.fill_diagonal(w, rng.uniform(0.1, 1.0, n))
    return Topology.from_matrix(w / w.sum(1, keepdims=True), name="custom")


BUILDERS: dict[str, Callable[[int], Topology]] = {
    "ring": ring,
    "exp2": exponential_two,
    "star": star,
    "full": fully_connected,
    "mesh": mesh_grid_2d,
    "custom": _custom,
}


def _random_weights(n: int, trial: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Edges E[i, j] (j sends to i), receive weights R, send scales S, self weights a; same on every rank."""
    rng = np.random.default_rng(7 * n + trial)
    e = rng.uniform(size=(n, n)) < 0.6
    np.fill_diagonal(e, False)
    return e, rng.uniform(0.1, 1.0, (n, n)), rng.uniform(0.1, 1.0, (n, n)), rng.uniform(0.1, 1.0, n)


def _formula(
    i: int, a: np.ndarray, xs: list[torch.Tensor], src: list[int], r: np.ndarray, s: np.ndarray
) -> torch.Tensor:
    """Eq. 10: ``a_i x_i + sum_{j in src} r_ij s_ij x_j``."""
    out = a[i] * xs[i]
    for j in src:
        out = out + float(r[i, j] * s[i, j]) * xs[j]
    return out


# ---------------------------------------------------------------- static topologies


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_static_topologies_match_w_times_x(n: int) -> None:
    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        xs = _inputs(n)
        want = _mix(exponential_two(n).weights, xs)[r]
        if not _close(neighbor_allreduce(xs[r]), want):
            bad.append(f"rank {r}: default (never set) topology is not exponential_two")
        for i, (label, build) in enumerate(BUILDERS.items()):
            topo = build(n)
            xs = _inputs(n, i + 1)
            want = _mix(topo.weights, xs)[r]
            got = neighbor_allreduce(xs[r], topology=topo, name=label)
            if not _close(got, want):
                bad.append(f"rank {r}: {label} topology= argument: {got} != {want}")
            set_topology(topo)
            if load_topology() != topo or in_neighbor_ranks() != topo.in_neighbors(r):
                bad.append(f"rank {r}: {label} set_topology/load_topology/in_neighbor_ranks")
            if out_neighbor_ranks() != topo.out_neighbors(r):
                bad.append(f"rank {r}: {label} out_neighbor_ranks")
            for check in (True, False):
                got = neighbor_allreduce(xs[r], check_topology=check)
                if not _close(got, want):
                    bad.append(f"rank {r}: {label} set_topology, check_topology={check}")
        set_topology(None)
        if load_topology() != exponential_two(n):
            bad.append(f"rank {r}: set_topology(None) is not exponential_two")
        return bad

    _run(rank_fn, n)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_dynamic_one_peer_exponential_two(n: int) -> None:
    """2n steps of the one-peer exp2 topology, through topology=dyn.at(k) and through the rank-local
    generator (push-pull weights), both equal DynamicTopology.at(k).weights @ X."""
    dyn = dynamic_one_peer_exponential_two(n)

    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        gen = one_peer_exponential_two(n, r)
        for k in range(2 * n):
            xs = _inputs(n, 10 + k)
            want = _mix(dyn.at(k).weights, xs)[r]
            got = neighbor_allreduce(xs[r], topology=dyn.at(k))
            if not _close(got, want):
                bad.append(f"rank {r} step {k}: topology=dyn.at(k)")
            send, recv = next(gen)
            w = 1.0 / (len(recv) + 1)
            got = neighbor_allreduce(
                xs[r], self_weight=w, src_weights=dict.fromkeys(recv, w), dst_weights=send
            )
            if not _close(got, want):
                bad.append(f"rank {r} step {k}: generator push-pull")
        return bad

    _run(rank_fn, n)


# ---------------------------------------------------------------- dynamic weights: push, pull, push-pull


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_push_pull_and_push_pull_match_the_formula(n: int) -> None:
    def rank_fn() -> list[str]:
        i, bad = lowband.rank(), []
        for trial in range(3):
            e, rw, sw, a = _random_weights(n, trial)
            xs = _inputs(n, 20 + trial)
            src = [j for j in range(n) if e[i, j]]
            dst = [k for k in range(n) if e[k, i]]

            ones = np.ones((n, n))
            cases = {
                "pull": (dict(src_weights={j: rw[i, j] for j in src}), _formula(i, a, xs, src, rw, ones)),
                "push": (dict(dst_weights={k: sw[k, i] for k in dst}), _formula(i, a, xs, src, ones, sw)),
                "push list": (dict(dst_weights=dst), _formula(i, a, xs, src, ones, ones)),
                "push-pull": (
                    dict(src_weights={j: rw[i, j] for j in src}, dst_weights={k: sw[k, i] for k in dst}),
                    _formula(i, a, xs, src, rw, sw),
                ),
            }
            for label, (kw, want) in cases.items():
                for check in (None, False):
                    got = neighbor_allreduce(xs[i], self_weight=a[i], check_topology=check, **kw)  # type: ignore[arg-type]
                    if not _close(got, want):
                        bad.append(f"rank {i} trial {trial} {label} check={check}: {got} != {want}")
        return bad

    _run(rank_fn, n)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_inplace_out_of_place_and_noncontiguous(n: int) -> None:
    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        topo = ring(n)
        xs = [x.t() for x in _inputs(n, 30, (5, 3))]  # non-contiguous views
        want = _mix(topo.weights, [x.contiguous() for x in xs])[r]
        mine = xs[r].clone().t().contiguous().t()  # a non-contiguous copy
        before = mine.clone()
        got = neighbor_allreduce(mine, topology=topo)
        if not (_close(got, want) and torch.equal(mine, before)):
            bad.append(f"rank {r}: out of place changed the input or is wrong")
        h = ineighbor_allreduce(mine, topology=topo, inplace=True)
        res = h.wait()
        if not (res is mine and _close(mine, want) and not mine.is_contiguous()):
            bad.append(f"rank {r}: in place did not write the input")
        return bad

    _run(rank_fn, n)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_half_precision_and_empty_tensors(n: int) -> None:
    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        topo = exponential_two(n)
        for dt, tol in ((torch.float32, 1e-6), (torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
            xs = _inputs(n, 40)
            want = _mix(topo.weights, xs)[r].to(dt)
            got = neighbor_allreduce(xs[r].to(dt), topology=topo)
            if not (got.dtype == dt and torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)):
                bad.append(f"rank {r}: {dt}")
        for shape in ((), (0,), (0, 3)):
            xs = _inputs(n, 41, shape)
            if not _close(neighbor_allreduce(xs[r], topology=topo), _mix(topo.weights, xs)[r]):
                bad.append(f"rank {r}: shape {shape}")
        return bad

    _run(rank_fn, n)


@pytest.mark.parametrize("n", (3, 4))
def test_subgroup_has_its_own_topology_and_group_ranks(n: int) -> None:
    """Ops on a group of world ranks 1..n-1 use group ranks; its topology is set apart from the world's."""

    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        sub = lowband.new_group(list(range(1, n)))
        set_topology(star(n))
        if sub is None:
            return bad
        m = n - 1
        xs = _inputs(n, 35)
        set_topology(ring(m), group=sub)
        want = _mix(ring(m).weights, xs[1:])[sub.rank]
        if not (_close(neighbor_allreduce(xs[r], group=sub), want) and load_topology(sub) == ring(m)):
            bad.append(f"rank {r}: subgroup static ring")
        if load_topology() != star(n) or in_neighbor_ranks(sub) != ring(m).in_neighbors(sub.rank):
            bad.append(f"rank {r}: the world's topology changed with the subgroup's")
        got = neighbor_allreduce(xs[r], self_weight=0.5, dst_weights=[(sub.rank + 1) % m], group=sub)
        if m > 1 and not _close(got, 0.5 * xs[r] + xs[1 + (sub.rank - 1) % m]):
            bad.append(f"rank {r}: subgroup push with group ranks")
        return bad

    _run(rank_fn, n)


# ---------------------------------------------------------------- nonblocking handles


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_handles_in_flight_waited_in_reverse_order(n: int) -> None:
    def rank_fn() -> list[str]:
        i, bad = lowband.rank(), []
        e, rw, _, a = _random_weights(n, 5)
        src = [j for j in range(n) if e[i, j]]
        dst = [k for k in range(n) if e[k, i]]
        topos = [ring(n), star(n), exponential_two(n), fully_connected(n)]
        issued, wants = [], []
        for step in range(8):
            xs = _inputs(n, 50 + step)
            if step % 4 == 3:  # push-pull between static ones
                issued.append(
                    ineighbor_allreduce(
                        xs[i], self_weight=a[i], src_weights={j: rw[i, j] for j in src}, dst_weights=dst
                    )
                )
                wants.append(_formula(i, a, xs, src, rw, np.ones((n, n))))
            else:
                topo = topos[step % len(topos)]
                issued.append(ineighbor_allreduce(xs[i], topology=topo, check_topology=step % 2 == 0))
                wants.append(_mix(topo.weights, xs)[i])
        rows = [data(j, (j + 1, 2), torch.float64, 60) for j in range(n)]
        issued.append(ineighbor_allgather(rows[i]))
        srcs = exponential_two(n).in_neighbors(i)
        wants.append(torch.cat([rows[j] for j in srcs]) if srcs else torch.empty(0, 2, dtype=torch.float64))
        for k in reversed(range(len(issued))):
            got = issued[k].wait()
            if not _close(got, wants[k]):
                bad.append(f"rank {i}: handle {k} waited out of order")
        return bad

    _run(rank_fn, n)


# ---------------------------------------------------------------- fusion


def _mixed_tensors(rank: int, salt: int) -> list[torch.Tensor]:
    shapes_dtypes = [
        ((4, 3), torch.float64),
        ((), torch.float32),
        ((7,), torch.float32),
        ((0, 2), torch.float64),
        ((2, 3, 2), torch.float16),
        ((5,), torch.float64),
        ((3, 3), torch.bfloat16),
        ((33,), torch.float32),
    ]
    return [data(rank, s, dt, salt + k, integer=False) for k, (s, dt) in enumerate(shapes_dtypes)]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_fusion_of_mixed_shapes_and_dtypes_equals_unfused(n: int) -> None:
    def rank_fn() -> list[str]:
        i, bad = lowband.rank(), []
        e, rw, sw, a = _random_weights(n, 9)
        src = {j: float(rw[i, j]) for j in range(n) if e[i, j]}
        dst = {k: float(sw[k, i]) for k in range(n) if e[k, i]}
        weight_sets: list[dict[str, object]] = [
            {},
            {"topology": star(n)},
            {"self_weight": float(a[i]), "src_weights": src, "dst_weights": dst},
        ]
        for wi, kw in enumerate(weight_sets):
            ts = _mixed_tensors(i, 70 + wi)
            unfused = [neighbor_allreduce(t, **kw) for t in ts]  # type: ignore[arg-type]
            for threshold in (0, 64, 1 << 20, None):
                got = grouped_neighbor_allreduce(ts, fusion_threshold=threshold, **kw)  # type: ignore[arg-type]
                same = all(
                    g.dtype == u.dtype and g.shape == u.shape and torch.equal(g, u)
                    for g, u in zip(got, unfused)
                )
                if not same:
                    bad.append(f"rank {i}: weights {wi} threshold {threshold}: fused != unfused")
            copies = [t.clone() for t in ts]
            h = igrouped_neighbor_allreduce(copies, inplace=True, fusion_threshold=64, **kw)  # type: ignore[arg-type]
            got = h.wait()
            if not (
                all(g is c for g, c in zip(got, copies))
                and all(torch.equal(c, u) for c, u in zip(copies, unfused))
            ):
                bad.append(f"rank {i}: weights {wi}: in-place fused")
        if grouped_neighbor_allreduce([]) != []:
            bad.append(f"rank {i}: empty list")
        return bad

    _run(rank_fn, n)


# ---------------------------------------------------------------- allgather


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_neighbor_allgather_with_uneven_first_dims(n: int) -> None:
    def rank_fn() -> list[str]:
        i, bad = lowband.rank(), []
        e, *_ = _random_weights(n, 11)
        src = [j for j in range(n) if e[i, j]]
        dst = [k for k in range(n) if e[k, i]]
        shuffled = src[1:] + src[:1]  # not ascending where there are two sources or more
        for dt in (torch.float64, torch.int64, torch.bool):
            rows = [data(j, (j % 3, 4), torch.float64, 80).to(dt) for j in range(n)]  # dim 0 of 0, 1 or 2

            def want(srcs: list[int], rows: list[torch.Tensor] = rows, dt: torch.dtype = dt) -> torch.Tensor:
                return torch.cat([rows[j] for j in srcs]) if srcs else torch.empty(0, 4, dtype=dt)

            cases = {
                "static": ({}, exponential_two(n).in_neighbors(i)),
                "topology": ({"topology": ring(n)}, ring(n).in_neighbors(i)),
                "pull": ({"src_ranks": src}, src),
                "push": ({"dst_ranks": dst}, src),
                "both": ({"src_ranks": src, "dst_ranks": dst}, src),
                # the gathered order follows src_ranks as given (BlueFog's order), not ascending
                "pull, given order": ({"src_ranks": shuffled}, shuffled),
                "both, given order": ({"src_ranks": shuffled[::-1], "dst_ranks": dst[::-1]}, shuffled[::-1]),
            }
            for label, (kw, srcs) in cases.items():
                got = neighbor_allgather(rows[i], **kw)  # type: ignore[arg-type]
                if not (got.dtype == dt and torch.equal(got, want(srcs))):
                    bad.append(f"rank {i} {dt} {label}: {got} != {want(srcs)}")
        scalars = [torch.tensor(float(j)) for j in range(n)]
        got = neighbor_allgather(scalars[i], topology=fully_connected(n))
        if not torch.equal(got, torch.tensor([float(j) for j in range(n) if j != i])):
            bad.append(f"rank {i}: 0-d allgather {got}")
        return bad

    _run(rank_fn, n)


# ---------------------------------------------------------------- topology check


def test_resolve_is_pure_and_discovers_sides() -> None:
    """The edge resolution on a hand-made table (no communication): push-only rows learn their sources."""
    from lowband.comm import validate
    from lowband.decentral.peers import Peers
    from lowband.decentral.topocheck import make_row

    plans = [Peers(1.0, {1: 1.0, 2: 1.0}, None), Peers(1.0, None, {0: 1.0}), Peers(1.0, {}, None)]
    rows = [make_row("neighbor_allreduce", torch.float32, (3,), p, 3).tolist() for p in plans]
    links = [resolve("test", (0, 1, 2), me, rows) for me in range(3)]
    assert links == [Links([1, 2], [], [3, 3, 3]), Links([], [0], [3, 3, 3]), Links([], [0], [3, 3, 3])]
    rows[1][validate.HEADER + 0] = 0  # rank 1 now knows it receives from nobody, but 0 sends to it
    with pytest.raises(CollectiveMismatchError, match="rank 0 sends to rank 1 but rank 1 does not receive"):
        resolve("test", (0, 1, 2), 2, rows)


@pytest.mark.parametrize("n", (2, 3, 4))
def test_mismatched_sends_and_receives_raise_on_every_rank(n: int) -> None:
    def rank_fn() -> list[str]:
        r, out = lowband.rank(), []
        x = data(r, SHAPE, torch.float64, 90)
        cases = [
            # rank 0 sends to rank 1, which receives from nobody
            (
                {0: {"dst_weights": [1], "src_weights": {}}},
                "rank 0 sends to rank 1 but rank 1 does not receive",
            ),
            # rank 1 receives from rank 0, which sends to nobody
            (
                {1: {"src_weights": {0: 0.5}, "dst_weights": {}}},
                "rank 1 receives from rank 0 but rank 0 does not send",
            ),
        ]
        for per_rank, msg in cases:
            kw = per_rank.get(r, {"src_weights": {}, "dst_weights": {}})
            try:
                neighbor_allreduce(x, self_weight=0.5, **kw)  # type: ignore[arg-type]
                out.append(f"rank {r}: no error for {msg!r}")
            except CollectiveMismatchError as exc:
                if msg not in str(exc) or f"on rank {r}" not in str(exc):
                    out.append(f"rank {r}: wrong message {exc}")
        try:  # shapes differ between ranks
            neighbor_allreduce(data(r, (r + 1,), torch.float64, 91))
            out.append(f"rank {r}: no error for different shapes")
        except CollectiveMismatchError as exc:
            if "shape differ" not in str(exc):
                out.append(f"rank {r}: wrong shape message {exc}")
        try:  # allgather: dims after the first differ
            neighbor_allgather(torch.zeros(2, 2 + (r == 1)))
            out.append(f"rank {r}: no error for allgather trailing dims")
        except CollectiveMismatchError:
            pass
        # the group is still usable after the errors
        if not _close(
            neighbor_allreduce(x, topology=ring(n)), _mix(ring(n).weights, _inputs_at(n, SHAPE, 90))[r]
        ):
            out.append(f"rank {r}: op after the errors is wrong")
        return out

    _run(rank_fn, n)


def _inputs_at(n: int, shape: tuple[int, ...], salt: int) -> list[torch.Tensor]:
    return [data(j, shape, torch.float64, salt) for j in range(n)]


@pytest.mark.parametrize("how", ("flag", "group"))
@pytest.mark.parametrize("n", (2, 3))
def test_unchecked_mismatch_times_out_boundedly(n: int, how: str) -> None:
    """With the check off (check_topology=False, or a group.unchecked()), rank 1 waits for a message that
    rank 0 never sends: it raises CommTimeoutError after the short comm timeout; the others finish."""

    def rank_fn() -> list[str]:
        r, out = lowband.rank(), []
        x = data(r, SHAPE, torch.float64, 95)
        kw = (
            {"src_weights": {0: 0.5}, "dst_weights": {}} if r == 1 else {"src_weights": {}, "dst_weights": {}}
        )
        try:
            if how == "flag":
                neighbor_allreduce(x, self_weight=0.5, check_topology=False, **kw)  # type: ignore[arg-type]
            else:
                neighbor_allreduce(x, self_weight=0.5, group=lowband.world().unchecked(), **kw)  # type: ignore[arg-type]
            if r == 1:
                out.append(f"rank 1 ({how}): no timeout")
        except CommTimeoutError:
            if r != 1:
                out.append(f"rank {r} ({how}): unexpected timeout")
        return out

    _run(rank_fn, n, comm_timeout=1.0)


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("n", (1, 2))
def test_bad_arguments_raise_invalid_argument(n: int) -> None:
    def rank_fn() -> list[str]:
        r, out = lowband.rank(), []
        x = torch.zeros(3, dtype=torch.float64)
        other = (r + 1) % n
        bad_calls: dict[str, Callable[[], object]] = {
            "src self": lambda: neighbor_allreduce(x, self_weight=0.5, src_weights={r: 0.5}),
            "src out of range": lambda: neighbor_allreduce(x, self_weight=0.5, src_weights={n: 0.5}),
            "src negative": lambda: neighbor_allreduce(x, self_weight=0.5, src_weights={-1: 0.5}),
            "src not a mapping": lambda: neighbor_allreduce(x, self_weight=0.5, src_weights=[other]),  # type: ignore[arg-type]
            "dst duplicate": lambda: neighbor_allreduce(x, self_weight=0.5, dst_weights=[other, other]),
            "dst self": lambda: neighbor_allreduce(x, self_weight=0.5, dst_weights=[r]),
            "nan weight": lambda: neighbor_allreduce(x, self_weight=float("nan"), dst_weights=[]),
            "inf weight": lambda: neighbor_allreduce(x, self_weight=0.5, src_weights={other: float("inf")}),
            "bool weight": lambda: neighbor_allreduce(x, self_weight=True, dst_weights=[]),  # type: ignore[arg-type]
            "str weight": lambda: neighbor_allreduce(x, self_weight="1", dst_weights=[]),  # type: ignore[arg-type]
            "src without self": lambda: neighbor_allreduce(x, src_weights={}),
            "dst without self": lambda: neighbor_allreduce(x, dst_weights=[]),
            "self alone": lambda: neighbor_allreduce(x, self_weight=1.0),
            "topology and weights": lambda: neighbor_allreduce(
                x, self_weight=1.0, dst_weights=[], topology=ring(n)
            ),
            "topology size": lambda: neighbor_allreduce(x, topology=ring(n + 1)),
            "dynamic topology": lambda: neighbor_allreduce(x, topology=dynamic_one_peer_exponential_two(n)),  # type: ignore[arg-type]
            "int tensor": lambda: neighbor_allreduce(torch.zeros(3, dtype=torch.int64)),
            "bool tensor": lambda: neighbor_allreduce(torch.zeros(3, dtype=torch.bool)),
            "not a tensor": lambda: neighbor_allreduce([1.0]),  # type: ignore[arg-type]
            "check flag": lambda: neighbor_allreduce(x, check_topology=1),  # type: ignore[arg-type]
            "grouped int": lambda: grouped_neighbor_allreduce([x, torch.zeros(2, dtype=torch.int32)]),
            "grouped not a list": lambda: grouped_neighbor_allreduce(x),  # type: ignore[arg-type]
            "grouped threshold": lambda: grouped_neighbor_allreduce([x], fusion_threshold=-1),
            "allgather src self": lambda: neighbor_allgather(x, src_ranks=[r]),
            "allgather topology and ranks": lambda: neighbor_allgather(x, src_ranks=[], topology=ring(n)),
            "set_topology size": lambda: set_topology(ring(n + 1)),
            "set_topology type": lambda: set_topology(np.eye(n)),  # type: ignore[arg-type]
        }
        for label, call in bad_calls.items():
            try:
                call()
                out.append(f"rank {r}: {label}: no error")
            except InvalidArgumentError as exc:
                if f"on rank {r}" not in str(exc):
                    out.append(f"rank {r}: {label}: message does not name the rank: {exc}")
        return out

    _run(rank_fn, n)


def test_int_tensors_are_rejected_naming_the_fix() -> None:
    def rank_fn() -> str:
        try:
            neighbor_allreduce(torch.zeros(3, dtype=torch.int32))
        except InvalidArgumentError as exc:
            return str(exc)
        return ""

    (msg,) = run_threads(rank_fn, 1)
    assert "floating-point" in msg and "int32" in msg


def test_byte_counters() -> None:
    """sent = bytes of the tensor times the number of destinations; received likewise per source."""
    n = 4

    def rank_fn() -> dict[str, dict[str, int]]:
        x = torch.zeros(10, dtype=torch.float64)
        neighbor_allreduce(x, topology=exponential_two(n))
        neighbor_allgather(torch.zeros(lowband.rank() + 1, 2), topology=ring(n))
        return lowband.counters()

    for r, c in enumerate(run_threads(rank_fn, n, trace=True)):
        topo = exponential_two(n)
        assert c["neighbor_allreduce"]["bytes_sent"] == 80 * len(topo.out_neighbors(r))
        assert c["neighbor_allreduce"]["bytes_received"] == 80 * len(topo.in_neighbors(r))
        assert c["neighbor_allgather"]["bytes_sent"] == 8 * (r + 1) * 2
        assert c["neighbor_allgather"]["bytes_received"] == 8 * sum(j + 1 for j in ring(n).in_neighbors(r))
