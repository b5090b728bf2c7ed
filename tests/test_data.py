"""lowband.data: each rank's shard of a dataset by its strategy's data-parallel group.

Checked against a single-process oracle (torch's sampler algorithm, rebuilt for every rank: the
permutation of ``seed + epoch``, padded or cut to a multiple of the group's size, every size-th sample
from the rank's index), on the world and on side-by-side data-parallel groups (ranks holding the same
part of a model read the same samples), and end to end: a strategy trained on ``loader`` batches
equals one model trained on the union of every rank's batch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import lowband
from lowband.data import loader, shard
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.strategies import make_strategy
from lowband.testing import run_threads

LR = 0.1


def _oracle(n: int, size: int, rank: int, seed: int, epoch: int, drop_last: bool) -> list[int]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    if drop_last:
        order = order[: n - n % size]
    else:
        order += order[: (-n) % size]
    return order[rank::size]


def _dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(n, 3, generator=g, dtype=torch.float64), torch.arange(n))


def _indices(n: int, drop_last: bool) -> list[list[int]]:
    s = shard(_dataset(n), None, seed=3, drop_last=drop_last)
    out = []
    for epoch in range(2):
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_world_shards_match_the_oracle(world: int, drop_last: bool) -> None:
    n = 10
    res = run_threads(_indices, world, n, drop_last)
    for epoch in range(2):
        for r in range(world):
            assert res[r][epoch] == _oracle(n, world, r, 3, epoch, drop_last)
        seen = sorted(i for r in range(world) for i in res[r][epoch])
        if drop_last:
            assert len(set(seen)) == len(seen) == n - n % world  # disjoint
        else:
            assert set(seen) == set(range(n))  # every sample, padded to equal shares
            assert len({len(res[r][epoch]) for r in range(world)}) == 1
    if world > 1:
        assert res[0][0] != res[0][1]  # a new shuffle each epoch


def _side_by_side() -> dict[str, object]:
    """World of 4 as two data-parallel groups {0, 2} and {1, 3} (pairs {0, 1}, {2, 3} hold one model
    each): shard by the strategy's group."""
    r = lowband.rank()
    groups = [lowband.new_group([0, 2]), lowband.new_group([1, 3])]
    g = groups[r % 2]
    assert g is not None
    torch.manual_seed(0)
    s = make_strategy("stage", nn.Linear(3, 1).double(), lambda p: torch.optim.SGD(p, lr=LR), group=g)
    by_strategy = list(shard(_dataset(10), s, seed=1))
    by_group = list(shard(_dataset(10), g, seed=1))
    by_world = list(shard(_dataset(10), None, seed=1))
    batches = [b[1].tolist() for b in loader(_dataset(10), s, batch_size=2, seed=1)]
    s.close()
    return {"strategy": by_strategy, "group": by_group, "world": by_world, "batches": batches}


def test_side_by_side_data_parallel_groups() -> None:
    res = run_threads(_side_by_side, 4)
    for r in range(4):
        dp_rank = r // 2  # rank's index in its group {0, 2} or {1, 3}
        assert res[r]["strategy"] == res[r]["group"] == _oracle(10, 2, dp_rank, 1, 0, False)
        assert res[r]["world"] == _oracle(10, 4, r, 1, 0, False)
        want = _oracle(10, 2, dp_rank, 1, 0, False)
        assert res[r]["batches"] == [want[i : i + 2] for i in range(0, len(want), 2)]
    assert res[0]["strategy"] == res[1]["strategy"]  # one model's two halves read the same samples
    assert not set(res[0]["strategy"]) & set(res[2]["strategy"])  # the replicas read different ones


def _model() -> nn.Linear:
    """The same start on every rank from a generator of its own (thread ranks share torch's global one)."""
    m = nn.Linear(3, 1).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return m


def _train(n_samples: int) -> list[float]:
    m = _model()
    s = make_strategy("stage", m, lambda p: torch.optim.SGD(p, lr=LR))
    batches = loader(_dataset(n_samples), s, batch_size=2, seed=4)
    for epoch in range(2):
        batches.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for x, y in batches:
            s.train_step(lambda mod, x=x, y=y: ((mod(x).squeeze(1) - y.double()) ** 2).mean())
    s.close()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()


def test_training_on_shards_equals_one_model_on_the_union() -> None:
    world, n = 3, 12  # 4 samples per rank, 2 batches of 2 each per epoch
    res = run_threads(_train, world, n)
    ds = _dataset(n)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for epoch in range(2):
        shards = [_oracle(n, world, r, 4, epoch, False) for r in range(world)]
        for k in range(0, len(shards[0]), 2):
            opt.zero_grad()
            losses = []
            for r in range(world):
                x, y = ds[shards[r][k : k + 2]]
                losses.append(((ref(x).squeeze(1) - y.double()) ** 2).mean())
            (sum(losses) / world).backward()  # type: ignore[operator]
            opt.step()
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    for r in range(world):
        torch.testing.assert_close(torch.tensor(res[r], dtype=torch.float64), want, rtol=1e-12, atol=1e-12)


def _mismatched() -> str:
    try:
        shard(_dataset(10 + lowband.rank()), None)
    except CollectiveMismatchError as exc:
        return str(exc)
    return "accepted"


def test_ranks_with_different_datasets_are_refused_on_every_rank() -> None:
    for msg in run_threads(_mismatched, 2):
        assert "the dataset's length" in msg


def _bad(what: str) -> str:
    try:
        if what == "iterable":
            shard(iter(range(3)), None)  # type: ignore[arg-type]
        elif what == "owner":
            shard(_dataset(4), "world")  # type: ignore[arg-type]
        elif what == "sampler":
            loader(_dataset(4), None, batch_size=2, sampler=None)
        else:
            shard(_dataset(1), None, drop_last=True)
    except InvalidArgumentError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize(
    ("what", "msg"),
    [("iterable", "has no len()"), ("owner", "expected a strategy"), ("sampler", "it makes the sampler"),
     ("tiny", "leaves every rank none")],
)  # fmt: skip
def test_bad_arguments(what: str, msg: str) -> None:
    assert msg in run_threads(_bad, 2, what)[0]
