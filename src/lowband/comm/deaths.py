"""Deaths the launcher saw (``lowband run --keep-going``), read by the survivors while they wait.

A survivor waiting on an op whose peer died may not learn it from the op: a killed process's reset can
be lost on a congested link, and its connection then stays open until the timeout (or the heartbeat).
The launcher sees the process end at once; under ``--keep-going`` it hosts the rendezvous store
(:mod:`lowband.testbed.store_host`) and writes each death there, in the store's own keys (no prefix):
``lowband/launcher/{run}/death{n}`` = ``"RANK STATUS"`` for n = 1, 2, ..., then the counter
``lowband/launcher/{run}/deaths`` (one writer, so a counted death is always readable). A strategy reads
the deaths counted since its membership was formed (:class:`DeathNotices`) between its looks at an op
in flight (:mod:`lowband.strategies.peer_loss`).
"""

from __future__ import annotations

import os
from typing import Any


def _base(run: str) -> str:
    return f"lowband/launcher/{run}"


def raw_store(store: Any) -> Any:
    """The store under every ``PrefixStore`` view of it."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def record_death(store: Any, run: str, n: int, rank: int, status: int) -> None:
    """The launcher's write of its ``n``-th death (n = 1, 2, ...; the launcher is the only writer)."""
    store.set(f"{_base(run)}/death{n}", f"{rank} {status}")
    store.add(f"{_base(run)}/deaths", 1)


class DeathNotices:
    """The deaths the launcher of run ``TORCHELASTIC_RUN_ID`` recorded after this object was made."""

    def __init__(self, store: Any) -> None:
        self.run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        self.store = raw_store(store)
        self.seen = self._count()

    def _count(self) -> int:
        return int(self.store.add(f"{_base(self.run)}/deaths", 0)) if self.run else 0

    def new(self) -> list[tuple[int, int]]:
        """(rank, exit status) of each death recorded since the last call (raises the store's errors)."""
        count = self._count()
        out = []
        for n in range(self.seen + 1, count + 1):
            rank, status = bytes(self.store.get(f"{_base(self.run)}/death{n}")).decode().split()
            out.append((int(rank), int(status)))
        self.seen = count
        return out


__all__ = ["DeathNotices", "raw_store", "record_death"]
