"""BlueFog's window ops with an associated p (push-sum weights carried with every window op) and its
timeline file written while the program runs, at 3 and 4 thread-ranks. The expectations are BlueFog's
documented ones (its own associated-p tests) and a single-process oracle of synchronous push-sum rounds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import lowband.compat.bluefog.torch as bf
from lowband.compat.bluefog.common import topology_util
from lowband.testing import run_threads

SIZES = (3, 4)


@pytest.mark.parametrize("n", SIZES)
def test_associated_p_follows_accumulate_and_collect(n: int) -> None:
    """BlueFog's test: on a ring, one sender accumulates with self weight 0.5 and 0.5 to each side; after
    the collect its p is 0.5, its two neighbors' 1.5, everyone else's 1."""

    def fn() -> list[float]:
        bf.init()
        r = bf.rank()
        bf.set_topology(topology_util.RingGraph(n))
        bf.turn_on_win_ops_with_associated_p()
        out = []
        for send_rank in range(n):
            tensor = torch.ones(23, dtype=torch.float64) * r
            name = f"p_{send_rank}"
            bf.win_create(tensor, name)
            left, right = (send_rank - 1) % n, (send_rank + 1) % n
            if r == send_rank:
                bf.win_accumulate(tensor, name=name, self_weight=0.5, dst_weights={left: 0.5, right: 0.5})
            bf.barrier()
            bf.win_update_then_collect(name=name)
            out.append(bf.win_associated_p(name=name))
            bf.barrier()
            bf.win_free(name)
        bf.turn_off_win_ops_with_associated_p()
        return out

    for r, ps in enumerate(run_threads(fn, n)):
        for send_rank, p in enumerate(ps):
            if r == send_rank:
                assert p == 0.5
            elif r in ((send_rank - 1) % n, (send_rank + 1) % n):
                assert abs(p - 1.5) < 1e-12
            else:
                assert p == 1.0


@pytest.mark.parametrize("n", SIZES)
def test_associated_p_moves_exactly_as_the_tensor(n: int) -> None:
    """BlueFog's random test: starting from a tensor of ones and p = 1, any sequence of puts, updates,
    accumulates and collects leaves p equal to every element of the tensor."""

    def fn() -> tuple[float, list[float]]:
        bf.init()
        bf.turn_on_win_ops_with_associated_p()
        g = np.random.default_rng(17 + bf.rank())
        tensor = torch.ones(23, dtype=torch.float64)
        bf.win_create(tensor, "pr", zero_init=True)
        for _ in range(10):
            w = g.random(len(bf.out_neighbor_ranks()) + 1)
            w /= w.sum()
            self_weight = float(w[-1])
            dst_weights = {r: float(w[i]) for i, r in enumerate(bf.out_neighbor_ranks())}
            bf.win_put(
                tensor, self_weight=self_weight, dst_weights=dst_weights, name="pr", require_mutex=True
            )
            bf.win_update(name="pr", require_mutex=True)
            bf.win_accumulate(
                tensor, name="pr", require_mutex=True, self_weight=self_weight, dst_weights=dst_weights
            )
            bf.win_update_then_collect(name="pr")
        bf.barrier()
        bf.win_update_then_collect(name="pr")
        p = bf.win_associated_p(name="pr")
        values = tensor.tolist()
        bf.barrier()
        bf.win_free("pr")
        bf.turn_off_win_ops_with_associated_p()
        return p, values

    for p, values in run_threads(fn, n):
        assert all(abs(p - v) < 1e-12 for v in values), (p, values)


def _start(rank: int) -> torch.Tensor:
    return torch.randn(4, generator=torch.Generator().manual_seed(5 + rank), dtype=torch.float64)


def _push_sum_oracle(n: int, rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """Synchronous push-sum on BlueFog's default graph (exponential-2) in one process: every rank keeps
    1/(d+1) of (x, p) and sends 1/(d+1) to each out-neighbor; then a pull round: x <- x/2 +
    sum_j x_j / (2 k) over the k in-neighbors (their values fetched by win_get)."""
    g = topology_util.ExponentialTwoGraph(n)
    x = np.stack([_start(r).numpy() for r in range(n)])
    p = np.ones(n)
    for _ in range(rounds):
        nx_, np_ = np.zeros_like(x), np.zeros_like(p)
        for i in range(n):
            outs = [j for j in g.successors(i) if j != i]
            share = 1.0 / (len(outs) + 1)
            for j in [i, *outs]:
                nx_[j] += share * x[i]
                np_[j] += share * p[i]
        x, p = nx_, np_
    gx, gp = x.copy(), p.copy()
    for i in range(n):
        ins = [j for j in g.predecessors(i) if j != i]
        gx[i] = 0.5 * x[i] + sum(0.5 / len(ins) * x[j] for j in ins)
        gp[i] = 0.5 * p[i] + sum(0.5 / len(ins) * p[j] for j in ins)
    return np.concatenate([gx, gp[:, None]], axis=1), x.mean(axis=0)


@pytest.mark.parametrize("n", SIZES)
def test_push_sum_rounds_with_associated_p_match_the_oracle(n: int) -> None:
    rounds = 6

    def fn() -> tuple[list[float], float]:
        bf.init()
        bf.turn_on_win_ops_with_associated_p()
        x = _start(bf.rank())
        bf.win_create(x, "x", zero_init=True)
        outs = bf.out_neighbor_ranks()
        share = 1.0 / (len(outs) + 1)
        for _ in range(rounds):
            bf.win_accumulate(x, name="x", self_weight=share, dst_weights=dict.fromkeys(outs, share))
            bf.barrier()
            bf.win_update_then_collect(name="x")
            bf.barrier()
        ins = bf.in_neighbor_ranks()
        bf.win_get(name="x")  # the in-neighbors' x and p, weight 1
        bf.barrier()
        got = bf.win_update(name="x", self_weight=0.5, neighbor_weights=dict.fromkeys(ins, 0.5 / len(ins)))
        assert got is x
        p = bf.win_associated_p("x")
        bf.barrier()
        bf.win_free("x")
        bf.turn_off_win_ops_with_associated_p()
        return x.tolist(), p

    want, _ = _push_sum_oracle(n, rounds)
    for r, (x, p) in enumerate(run_threads(fn, n)):
        np.testing.assert_allclose(np.array([*x, p]), want[r], rtol=0, atol=1e-12)


def test_windows_without_associated_p_keep_p_at_one() -> None:
    def fn() -> float:
        bf.init()
        x = torch.ones(3, dtype=torch.float64)
        bf.win_create(x, "plain")
        bf.win_accumulate(x, name="plain", self_weight=0.5)
        bf.barrier()
        bf.win_update_then_collect("plain")
        p = bf.win_associated_p("plain")
        bf.barrier()
        bf.win_free("plain")
        return p

    assert run_threads(fn, 3) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("n", SIZES)
def test_timeline_file_is_written_while_the_program_runs(
    n: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = str(tmp_path / "timeline")
    monkeypatch.setenv("BLUEFOG_TIMELINE", prefix)

    def fn() -> tuple[bool, list[str]]:
        bf.init()
        path = Path(f"{prefix}{bf.rank()}.json")
        at_init = path.exists()
        bf.allreduce(torch.ones(3), name="grad")
        with bf.timeline_context("grad", "COMPUTE"):
            pass
        bf.barrier()  # the file is rewritten at every barrier, long before shutdown
        events = json.loads(path.read_text())["traceEvents"]
        return at_init, [str(e.get("name", "")) + "/" + str(e.get("cat", "")) for e in events]

    for at_init, names in run_threads(fn, n):
        assert at_init
        assert any("grad" in s and "allreduce" in s for s in names), names
        assert any("COMPUTE" in s for s in names), names
