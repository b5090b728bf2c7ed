"""Example: train your own model with DreamDDP (partial-synchronisation local SGD) under torchrun.

    torchrun --nproc-per-node 4 examples/dreamddp_train.py --steps 200     # or: lowband run -n 4 ...
    python examples/dreamddp_train.py --steps 50                            # one rank, no launcher

Data: scikit-learn's digits (offline), sharded by rank. The strategy profiles the model on its first
step (per-layer forward/backward, allreduce cost on the actual links, interference), schedules which
layers (or chunks of large layers) each of the H local iterations averages, and then averages them in
place during backward. The script prints the schedule, saves the profile (``--profile-out``, reusable
with ``--profile``), checkpoints half-way, resumes from the checkpoint into a fresh strategy, and
checks that the resumed run ends where an uninterrupted one would (exact equality).
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Iterable

import torch
from sklearn.datasets import load_digits
from torch import nn

import lowband
from lowband.localsgd import PartialSyncStrategy, save_profile
from lowband.strategies import make_strategy


def make_model() -> nn.Module:
    torch.manual_seed(0)  # Algorithm 1 starts every rank from the same w_0
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batches(rank: int, world: int, batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    shard = torch.arange(rank, len(x), world)
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(steps):
        idx = shard[torch.randint(len(shard), (batch,), generator=g)]
        out.append((x[idx], y[idx]))
    return out


def train(
    s: PartialSyncStrategy, data: list[tuple[torch.Tensor, torch.Tensor]], first: int, last: int
) -> float:
    loss = float("nan")
    for k in range(first, last):
        xb, yb = data[k]

        def loss_fn(m: nn.Module, xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> torch.Tensor:
            return nn.functional.cross_entropy(m(xb), yb)

        loss = s.train_step(loss_fn)
    s.synchronize()
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--period", type=int, default=5, help="H: local iterations per period")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--split", default="auto", help="'auto', 0 (whole layers, the paper) or bytes")
    ap.add_argument("--profile", default=None, help="a saved profile (JSON) instead of profiling")
    ap.add_argument("--profile-out", default=None, help="save the profile here (rank 0)")
    args = ap.parse_args()
    split: int | str = args.split if args.split == "auto" else int(args.split)

    lowband.init()
    r, n = lowband.rank(), lowband.size()
    data = batches(r, n, args.batch, args.steps)

    def strategy() -> PartialSyncStrategy:
        s = make_strategy(
            "dreamddp", make_model(), make_optimizer, period=args.period, split=split, profile=args.profile
        )
        assert isinstance(s, PartialSyncStrategy)
        return s

    half = args.steps // 2
    s = strategy()
    train(s, data, 0, half)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)  # profile, units, schedule, counters, optimizer state, model
    loss = train(s, data, half, args.steps)

    resumed = strategy()
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    train(resumed, data, half, args.steps)
    same = all(torch.equal(a, b) for a, b in zip(s.module.parameters(), resumed.module.parameters()))

    rep = s.report()
    if r == 0:
        print(f"{n} rank(s), H = {args.period}: units {rep['layers']}")
        print(f"schedule (units averaged per local iteration): {rep['schedule']}")
        pred = rep["predicted_step_s"]
        print(f"predicted iteration {pred * 1e3:.2f} ms" if pred is not None else "no prediction")
        print(f"final loss on rank 0: {loss:.4f}; resumed run identical: {same}")
        if args.profile_out and s.profile is not None:
            save_profile(s.profile, args.profile_out)
            print(f"profile saved to {args.profile_out}")
    if not same:
        raise SystemExit(f"rank {r}: the resumed run differs from the uninterrupted one")
    lowband.shutdown()


if __name__ == "__main__":
    main()
