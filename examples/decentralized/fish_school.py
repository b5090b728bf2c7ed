"""Fish school: cooperative predator localisation over a time-varying graph, paper §IV-B, Listing 2.

Every rank is a fish. At each step the fish share their positions (``bf.allgather``); fish closer than
``threshold`` are neighbors, so the topology changes as the school moves. Each fish observes a noisy
distance ``d`` and direction ``u`` (unit vector from the predator to the fish) and estimates the predator
position ``w`` by diffusion (adapt-then-combine LMS) on ``f_i(w) = 1/2 [d_i - u_i^T (x_i - w)]^2``:

    psi_i = w_i - gamma * grad f_i(w_i)
    w_i   = sum_j a_ij psi_j       (pull-style neighbor_allreduce, Metropolis-Hastings weights a_ij)

then moves: ``disperse`` flees from the estimated predator, ``encircle`` swims to a circle around it.
Rank 0 writes the trajectories and the estimation error as a PNG, and an animation as a GIF when Pillow
is importable (it comes with matplotlib).

    torchrun --nproc-per-node 8 examples/decentralized/fish_school.py --mode encircle --out school.png
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

import lowband.compat.bluefog.torch as bf

PREDATOR = (4.0, 3.0)


def get_neighbor_ranks(loc_map: torch.Tensor, rank: int, threshold: float) -> tuple[list[int], list[int]]:
    """The fish within ``threshold`` of fish ``rank`` and their degrees (from every fish's position)."""
    dist = torch.cdist(loc_map, loc_map)
    adjacent = dist < threshold
    adjacent.fill_diagonal_(False)
    degrees = adjacent.sum(1).tolist()
    nb_ranks = [int(j) for j in torch.nonzero(adjacent[rank]).flatten().tolist()]
    return nb_ranks, [int(degrees[j]) for j in nb_ranks]


def get_mh_weights(nb_ranks: list[int], nb_degrees: list[int], degree: int) -> tuple[float, dict[int, float]]:
    """Metropolis-Hastings weights: ``1 / (1 + max(d_i, d_j))`` per neighbor, the rest kept."""
    src_weights = {r: 1.0 / (1 + max(degree, d)) for r, d in zip(nb_ranks, nb_degrees)}
    return 1.0 - sum(src_weights.values()), src_weights


def get_dist_and_direct(
    x: torch.Tensor, w_star: torch.Tensor, gen: torch.Generator, noise: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy distance and unit direction from the predator ``w_star`` to the fish at ``x``."""
    rel = x - w_star
    theta = torch.atan2(rel[1], rel[0]) + noise * torch.randn((), generator=gen, dtype=torch.float64)
    d = rel.norm() + noise * torch.randn((), generator=gen, dtype=torch.float64)
    return d, torch.stack([torch.cos(theta), torch.sin(theta)])


def cal_grad(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Gradient of ``1/2 [d - u^T (x - w)]^2`` with respect to ``w``."""
    return (d - u.dot(x - w)) * u


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm().clamp_min(1e-9)


def separation(x: torch.Tensor, loc_map: torch.Tensor, spacing: float) -> torch.Tensor:
    """A push away from the fish closer than ``spacing`` (stronger the closer they are)."""
    rel = x - loc_map
    dist = rel.norm(dim=1, keepdim=True)
    near = (dist > 1e-9) & (dist < spacing)
    return torch.where(near, rel / dist.clamp_min(1e-9) * (spacing - dist), torch.zeros_like(rel)).sum(0)


def escape(
    x: torch.Tensor, v: torch.Tensor, w: torch.Tensor, push: torch.Tensor, speed: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn away from the estimated predator ``w`` (and from crowding neighbors) and swim."""
    v = 0.7 * v + 0.3 * speed * _unit(_unit(x - w) + push)
    return x + v, v


def encircle(
    x: torch.Tensor, v: torch.Tensor, w: torch.Tensor, push: torch.Tensor, speed: float, radius: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Swim to the circle of ``radius`` around the estimated predator ``w``, circling it, spaced out
    from crowding neighbors."""
    radial = _unit(x - w)
    tangent = torch.stack([-radial[1], radial[0]])
    gap = (x - w).norm() - radius
    v = 0.7 * v + 0.3 * speed * _unit(-math.tanh(gap) * radial + 0.5 * tangent + push)
    return x + v, v


def run(
    steps: int = 100,
    mode: str = "disperse",
    out: str | None = "fish_school.png",
    *,
    seed: int = 0,
    threshold: float = 3.0,
    gamma: float = 0.3,
    noise: float = 0.05,
    speed: float = 0.1,
    radius: float = 1.5,
    spacing: float = 0.8,
    gif: bool = True,
    verbose: bool = False,
) -> dict[str, Any]:
    """Simulate the school on this rank (after ``bf.init()``); rank 0 writes ``out`` (PNG) and, with
    ``gif``, the same name with ``.gif``. Returns the mean estimation error per step (over the fish),
    every step's positions (``steps + 1`` x fish x 2) and the files written (on rank 0)."""
    if mode not in ("disperse", "encircle"):
        raise ValueError(f"fish_school.run: mode must be 'disperse' or 'encircle', got {mode!r}")
    me = bf.rank()
    gen = torch.Generator().manual_seed(1000 * seed + me)
    w_star = torch.tensor(PREDATOR, dtype=torch.float64)
    x = 0.8 * torch.randn(2, generator=gen, dtype=torch.float64)  # self location
    v = torch.zeros(2, dtype=torch.float64)  # self velocity
    w = x.clone()  # estimate of the predator location: no idea yet
    positions, errors = [], []
    for k in range(steps):
        loc_map = bf.allgather(x.view(1, 2), name="locations")
        positions.append(loc_map)
        nb_ranks, nb_degrees = get_neighbor_ranks(loc_map, me, threshold)
        # Set topology weights according to Metropolis-Hastings Rule.
        self_weight, src_weights = get_mh_weights(nb_ranks, nb_degrees, len(nb_ranks))
        # observe noisy distance and direction to the predator
        d, u = get_dist_and_direct(x, w_star, gen, noise)
        # estimate the predator's position with diffusion (adapt, then combine)
        grad = cal_grad(x, w, d, u)
        psi = w - gamma * grad
        # Pull-style neighbor communication
        w = bf.neighbor_allreduce(psi, self_weight=self_weight, src_weights=src_weights, name="estimate")
        errors.append(float((w - w_star).norm()))
        # take escape or encircle actions: location and velocity change
        push = separation(x, loc_map, spacing)
        x, v = escape(x, v, w, push, speed) if mode == "disperse" else encircle(x, v, w, push, speed, radius)
        if verbose and k % max(1, steps // 10) == 0 and me == 0:
            print(
                f"step {k:4d}: rank 0 has {len(nb_ranks)} neighbors, estimation error {errors[-1]:.3f}",
                flush=True,
            )
    positions.append(bf.allgather(x.view(1, 2), name="locations"))
    err = bf.allgather(torch.tensor([errors], dtype=torch.float64)).mean(0)
    traj = torch.stack(positions)
    files: list[str] = []
    if me == 0 and out is not None:
        files = _draw(traj, err, w_star, mode, radius, Path(out), gif)
    return {"errors": err.tolist(), "positions": traj, "estimate": w, "files": files}


def _draw(
    traj: torch.Tensor,
    err: torch.Tensor,
    w_star: torch.Tensor,
    mode: str,
    radius: float,
    out: Path,
    gif: bool,
) -> list[str]:
    """Trajectories and error as a PNG at ``out``; an animation as ``out`` with ``.gif`` if asked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = traj.shape[1]
    fig = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(fig)
    ax, ax_err = fig.subplots(1, 2)
    for i in range(n):
        (line,) = ax.plot(traj[:, i, 0], traj[:, i, 1], lw=1)
        ax.plot(traj[0, i, 0], traj[0, i, 1], "o", color=line.get_color(), ms=4)
        ax.plot(traj[-1, i, 0], traj[-1, i, 1], ">", color=line.get_color(), ms=6)
    ax.plot(*w_star.tolist(), "r*", ms=15, label="predator")
    if mode == "encircle":
        t = torch.linspace(0, 2 * math.pi, 100)
        ax.plot(w_star[0] + radius * torch.cos(t), w_star[1] + radius * torch.sin(t), "r:", lw=0.8)
    ax.set_aspect("equal")
    ax.set_title(f"{n} fish, {mode} (o start, > end)")
    ax.legend(loc="best")
    ax_err.semilogy(err.clamp_min(1e-12))
    ax_err.set_xlabel("step")
    ax_err.set_ylabel("mean |estimate - predator|")
    ax_err.set_title("cooperative estimate of the predator")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    files = [str(out)]
    if gif:
        try:
            import PIL  # noqa: F401 - PillowWriter needs it
        except ImportError:
            return files
        files.append(_animate(traj, w_star, mode, radius, out.with_suffix(".gif")))
    return files


def _animate(traj: torch.Tensor, w_star: torch.Tensor, mode: str, radius: float, path: Path) -> str:
    from matplotlib.animation import FuncAnimation, PillowWriter
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    lo = torch.minimum(traj.reshape(-1, 2).min(0).values, w_star) - 1
    hi = torch.maximum(traj.reshape(-1, 2).max(0).values, w_star) + 1
    ax.set_xlim(float(lo[0]), float(hi[0]))
    ax.set_ylim(float(lo[1]), float(hi[1]))
    ax.set_aspect("equal")
    ax.plot(*w_star.tolist(), "r*", ms=15)
    fish = ax.plot([], [], "o", ms=6)[0]
    frames = list(range(0, traj.shape[0], max(1, traj.shape[0] // 60)))

    def draw(k: int) -> Any:
        fish.set_data(traj[k, :, 0].tolist(), traj[k, :, 1].tolist())
        ax.set_title(f"{mode}: step {k}")
        return (fish,)

    FuncAnimation(fig, draw, frames=frames, blit=False).save(str(path), writer=PillowWriter(fps=10))
    return str(path)


def main() -> int:
    p = argparse.ArgumentParser(
        description="Fish school: cooperative predator localisation (BlueFog paper §IV-B)"
    )
    p.add_argument("--steps", type=int, default=100, help="simulation steps (default 100)")
    p.add_argument("--mode", choices=("disperse", "encircle"), default="disperse")
    p.add_argument("--out", default="fish_school.png", help="PNG to write (a .gif is written next to it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-gif", action="store_true", help="write the PNG only")
    args = p.parse_args()
    bf.init()
    try:
        res = run(args.steps, args.mode, args.out, seed=args.seed, gif=not args.no_gif, verbose=True)
        if bf.rank() == 0:
            e = res["errors"]
            print(f"mean estimation error: {e[0]:.3f} at step 0, {e[-1]:.3f} at step {len(e) - 1}")
            print("wrote " + ", ".join(res["files"]))
    finally:
        bf.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
