"""This rank's share of a dataset, for your own training loop: sharded over the strategy's data-parallel
group.

A strategy trains data-parallel over its group (``strategy.group``): the ranks of that group must read
different parts of each epoch, and ranks that hold the same replica's part of a model (the same rank in
their data-parallel groups) the same part. For a strategy over the whole world that is torch's default
(``DistributedSampler`` reads the world's rank and size); when several data-parallel groups run side by
side (a world of 4 as 2 groups ``{0, 2}`` and ``{1, 3}`` of one strategy each, every pair ``{0, 1}`` and
``{2, 3}`` holding one model cut in two), the world's rank and size would give each rank a different
quarter. :func:`shard` and :func:`loader` take the group from the strategy (or a group, or the world):

    sampler = lowband.data.shard(dataset, s)                # torch's DistributedSampler, the group's
    for epoch in range(epochs):
        sampler.set_epoch(epoch)                            # a new shuffle each epoch, alike on every rank
        for x, y in DataLoader(dataset, batch_size=32, sampler=sampler):
            ...

    batches = lowband.data.loader(dataset, s, batch_size=32)   # the same, as a DataLoader
    batches.sampler.set_epoch(epoch)

The shuffle is the sampler's (the same permutation on every rank: ``seed`` + epoch), cut into one
contiguous stride per rank of the group; without ``drop_last`` the epoch is padded with its first
samples to a multiple of the group's size (every rank takes the same number of steps), with it the tail
is dropped. Collective over the group: its ranks agree on the dataset's length and the sampler's
settings first (a rank with another dataset would read overlapping or missing samples silently; it
raises :class:`~lowband.errors.CollectiveMismatchError` on every rank instead).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lowband.comm.agree import agree
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.runtime import world_group


class _HasGroup(Protocol):
    group: Group


def data_group(owner: _HasGroup | Group | None) -> Group:
    """The data-parallel group of ``owner``: a strategy's group, a group itself, or the world (None)."""
    if owner is None or isinstance(owner, Group):
        return world_group(owner, "data.shard")[1]
    g = getattr(owner, "group", None)
    if not isinstance(g, Group):
        raise InvalidArgumentError(
            f"lowband.data: expected a strategy, a lowband Group or None, got {type(owner).__name__}"
        )
    return world_group(g, "data.shard")[1]


def shard(
    dataset: Dataset[Any],
    owner: _HasGroup | Group | None = None,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> DistributedSampler[Any]:
    """Collective over the data-parallel group of ``owner`` (module docstring): a
    ``DistributedSampler`` over ``dataset`` with that group's rank and size. Call ``set_epoch`` on it
    before each epoch."""
    g = data_group(owner)
    where = f"lowband.data.shard on rank {g.world_rank}"
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"{where}: the dataset has no len() (a map-style dataset is sharded; an iterable one shards "
            "itself, e.g. by the group's rank and size)"
        ) from None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgumentError(f"{where}: seed must be an int, got {seed!r}")
    if not isinstance(shuffle, bool) or not isinstance(drop_last, bool):
        raise InvalidArgumentError(f"{where}: shuffle and drop_last must be True or False")
    if drop_last and n < g.size:
        raise InvalidArgumentError(
            f"{where}: drop_last with {n} samples over {g.size} ranks leaves every rank none"
        )
    agree(
        g, "the dataset to shard", [n, seed, int(shuffle), int(drop_last)],
        fields=("the dataset's length", "the seed", "shuffle", "drop_last"), where=where,
    )  # fmt: skip
    return DistributedSampler(
        dataset, num_replicas=g.size, rank=g.rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )


def loader(
    dataset: Dataset[Any],
    owner: _HasGroup | Group | None = None,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    **kwargs: Any,
) -> DataLoader[Any]:
    """Collective: a ``DataLoader`` of this rank's shard (:func:`shard`; ``drop_last`` drops the
    shard's incomplete tail and last batch); other keyword arguments go to ``DataLoader``. Call
    ``.sampler.set_epoch(epoch)`` before each epoch."""
    if "sampler" in kwargs or "batch_sampler" in kwargs:
        raise InvalidArgumentError("lowband.data.loader: it makes the sampler; use shard() with your own")
    sampler = shard(dataset, owner, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)
