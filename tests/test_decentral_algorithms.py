"""The BlueFog paper's decentralized algorithms (examples/decentralized/*.py, written with the BlueFog
compatibility API) run on 1-4 thread-ranks and are checked against single-process oracles that rebuild
every rank's seeded data (float64)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.bench.workloads import least_squares, linreg_problem
from lowband.testing import run_threads
from lowband.topology import dynamic_one_peer, mesh_grid_2d

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "decentralized"))

import async_push_sum
import common
import dgd
import exact_diffusion
import fish_school
import gradient_tracking
import push_sum_gradient_tracking

WORLD_SIZES = (1, 2, 3, 4)


def problem(n: int) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Every rank's ``(A_i, b_i)`` (b as a column) and the centralized optimum, rebuilt from the seed."""
    p = linreg_problem(common.SEED, n, common.ROWS, common.DIM)
    a = [ai.numpy() for ai, _ in p]
    b = [bi.numpy()[:, None] for _, bi in p]
    return a, b, least_squares(p).numpy()[:, None]


def exponential_two_weights(n: int) -> np.ndarray:
    """Uniform pull weights of the exponential-2 graph: rank i averages itself and i - 2^k (mod n)."""
    w = np.zeros((n, n))
    for i in range(n):
        srcs = {(i - 2**k) % n for k in range(n.bit_length()) if 2**k < n} - {i}
        for j in srcs | {i}:
            w[i, j] = 1.0 / (len(srcs) + 1)
    return w


def dgd_oracle(n: int, gamma: float, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (16)-(17) in one process: every iterate of every rank (iters x n x dim), and DGD's fixed
    point, the solution of x = W (x - gamma (H x - c)) stacked over ranks."""
    a, b, _ = problem(n)
    w = exponential_two_weights(n)
    d = a[0].shape[1]
    x = np.zeros((n, d))
    out = []
    for _ in range(iters):
        y = np.stack([x[i] - gamma * (a[i].T @ (a[i] @ x[i][:, None] - b[i]))[:, 0] for i in range(n)])
        x = w @ y
        out.append(x)
    h = np.zeros((n * d, n * d))
    c = np.zeros(n * d)
    for i in range(n):
        h[i * d : (i + 1) * d, i * d : (i + 1) * d] = a[i].T @ a[i]
        c[i * d : (i + 1) * d] = (a[i].T @ b[i])[:, 0]
    wk = np.kron(w, np.eye(d))
    m = wk @ (np.eye(n * d) - gamma * h)
    fixed = np.linalg.solve(np.eye(n * d) - m, gamma * wk @ c).reshape(n, d)
    return np.stack(out), fixed


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_dgd_iterates_match_the_simulation_and_reach_its_fixed_point(n: int) -> None:
    iters, gamma = 150, 0.01
    res = run_threads(dgd.run, n, iters, gamma, check=False)
    expect, fixed = dgd_oracle(n, gamma, iters)
    got = np.stack([r["iterates"].numpy() for r in res], axis=1)  # iters x n x dim
    assert got.shape == expect.shape
    assert np.abs(got - expect).max() < 1e-10
    assert np.abs(got[-1] - fixed).max() < 1e-8
    x_opt = problem(n)[2][:, 0]
    bias = np.linalg.norm(fixed - x_opt, axis=1).max() / np.linalg.norm(x_opt)
    if n == 4:  # not fully connected: DGD's constant-step fixed point is biased (Exact Diffusion fixes it)
        assert bias > 1e-4
    else:  # exponential-2 with n <= 3 is complete: DGD is exact
        assert bias < 1e-10


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize(
    "algorithm", [exact_diffusion, gradient_tracking, push_sum_gradient_tracking], ids=lambda m: m.__name__
)
def test_bias_corrected_algorithms_reach_the_centralized_optimum(algorithm: object, n: int) -> None:
    res = run_threads(algorithm.run, n, check=False)  # type: ignore[attr-defined]
    x_opt = problem(n)[2]
    for r in res:
        x = r["x"].numpy()
        assert x.shape == x_opt.shape
        assert np.linalg.norm(x - x_opt) / np.linalg.norm(x_opt) < 1e-6
    if algorithm is push_sum_gradient_tracking:
        # v stays 1 iff every step's push matrix is also row-stochastic (n <= 2); else it corrects the bias
        dyn = dynamic_one_peer(mesh_grid_2d(n))
        doubly = all(dyn.at(k, "push").is_row_stochastic() for k in range(len(r["errors"])))
        drift = max(float((r["v"] - 1).abs().max()) for r in res)
        assert drift < 1e-12 if doubly else drift > 1e-3


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_async_push_sum_reaches_the_exact_average_at_different_speeds(n: int) -> None:
    dim, iters = 4, 100
    res = run_threads(lambda: async_push_sum.run(iters, dim, delay=0.001), n, check=False)
    x0 = torch.stack(
        [torch.randn(dim, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(n)]
    )
    exact = x0.mean(0)
    for r in res:
        assert (r["estimate"] - exact).abs().max() < 1e-6
    # push-sum conserves the totals: sum of x and of p over ranks (windows collected at the end)
    assert abs(sum(r["p"] for r in res) - n) < 1e-9
    assert (torch.stack([r["x"] for r in res]).sum(0) - x0.sum(0)).abs().max() < 1e-9


@pytest.mark.parametrize(("n", "mode"), [(4, "encircle"), (4, "disperse"), (1, "disperse")])
def test_fish_school_writes_the_trajectory_and_the_estimate_improves(
    tmp_path: Path, n: int, mode: str
) -> None:
    out = tmp_path / f"school-{mode}.png"
    res = run_threads(lambda: fish_school.run(25, mode, str(out), gif=(mode == "encircle")), n, check=False)
    assert res[0]["files"][0] == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if mode == "encircle":
        assert out.with_suffix(".gif").read_bytes()[:4] == b"GIF8"
    assert all(r["files"] == [] for r in res[1:])
    errors = res[0]["errors"]
    assert len(errors) == 25
    assert errors[-1] < 0.1 * errors[0]
    assert res[0]["positions"].shape == (26, n, 2)
    # every rank saw the same positions (allgather) and the same mean error
    assert all(torch.equal(r["positions"], res[0]["positions"]) for r in res)


def test_fish_school_neighbors_and_weights() -> None:
    loc = torch.tensor([[0.0, 0.0], [1.0, 0.0], [5.0, 0.0], [0.0, 1.5]], dtype=torch.float64)
    nb, deg = fish_school.get_neighbor_ranks(loc, 0, 2.0)
    assert (nb, deg) == ([1, 3], [2, 2])
    self_w, src = fish_school.get_mh_weights(nb, deg, len(nb))
    assert src == {1: 1 / 3, 3: 1 / 3} and abs(self_w - 1 / 3) < 1e-15
    assert fish_school.get_neighbor_ranks(loc, 2, 2.0) == ([], [])
    # the LMS gradient vanishes at the true position when the observation is exact
    x, w = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([4.0, 3.0], dtype=torch.float64)
    d, u = (x - w).norm(), (x - w) / (x - w).norm()
    assert fish_school.cal_grad(x, w, d, u).abs().max() < 1e-15
