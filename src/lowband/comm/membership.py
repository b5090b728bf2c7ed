"""The membership agreement's talking part: survivors of a lost rank meet in the rendezvous store.

Each survivor sets ``PREFIX/epoch{e}/rank{r}`` to the exchange index it lost the peer at, then polls
(every 10 ms, bounded by ``timeout``) the other members' keys and the epoch's decision key. As soon as
:func:`lowband.membership.proposal` allows, it stores its proposal with ``compare_set`` (kept only if
no decision is there yet) and adopts whatever the key holds; one that finds a decision adopts it. One
that waits ``timeout`` in vain stores a failure the same way. Why this cannot split the survivors:
:mod:`lowband.membership`. The store is the one every rank met through (the launcher's under
``lowband run``/torchrun and the test harness, rank 0's under a plain ``env://`` start: there the loss
of rank 0 ends the store too, and the survivors raise).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from lowband import membership
from lowband.errors import CommFailedError

_POLL_S = 0.01


def _decided(store: Any, key: str) -> str | None:
    if not store.check([key]):
        return None
    return bytes(store.get(key)).decode()


def agree(
    store: Any,
    prefix: str,
    last: Sequence[int],
    me: int,
    exchange: int,
    *,
    min_ranks: int | None,
    settle: float,
    timeout: float,
    where: str,
    aligned: bool = True,
) -> membership.Decision:
    """The decision every survivor of ``last`` adopts: the members (world ranks, ascending) it continues
    with and the exchange each announced; raises :class:`CommFailedError` naming the cause on every
    survivor when there is no such list (:func:`lowband.membership.adopt`, ``aligned`` there)."""
    quorum = membership.quorum_size(last, min_ranks)
    decision_key = f"{prefix}/decision"
    try:
        store.set(f"{prefix}/rank{me}", str(exchange))
        began = newest = time.monotonic()
        seen: dict[int, int] = {}
        while True:
            got = _decided(store, decision_key)
            if got is not None:
                break
            for r in last:
                if r not in seen and store.check([f"{prefix}/rank{r}"]):
                    seen[r] = int(bytes(store.get(f"{prefix}/rank{r}")).decode())
                    newest = time.monotonic()
            now = time.monotonic()
            value = membership.proposal(last, seen, quorum, settled=now - newest >= settle)
            if value is None and now - began >= timeout:
                value = membership.failure(last, seen, quorum, timeout)
            if value is not None:
                got = bytes(store.compare_set(decision_key, "", value)).decode()
                break
            time.sleep(_POLL_S)
    except (RuntimeError, TimeoutError) as exc:  # the store itself is gone (its host died)
        raise CommFailedError(
            f"{where}: the rendezvous store failed during the membership agreement: {exc}"
        ) from exc
    decision = membership.decode(got)
    membership.adopt(decision, me, where, aligned=aligned)
    return decision


__all__ = ["agree"]
