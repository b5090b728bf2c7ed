"""Admitting a replacement of a lost rank: its talking part (the decisions are
:mod:`lowband.strategies.peer_join`'s).

Keys, under a strategy's membership prefix ``P`` (the same on the members and the replacement):

- ``P/join/{rank}``: a replacement's request (JSON: a nonce of its own and its agreed configuration);
- ``P/epoch{E}/admit/x{X}``: the replacements the members admit right after exchange ``X`` of membership
  epoch ``E``, set with one ``compare_set`` (the first proposal stays) *before* that exchange and read by
  every member *after* it (:mod:`lowband.strategies.peer_join` says why they all read the same);
- ``P/answer/{rank}/{nonce}``: what the members tell that replacement (JSON: admitted, with the new
  group's key, members and donor, or refused, with why).

The state then goes from the donor to the replacement over the new group (:func:`send_bytes`): the data
path, not the disk.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import torch

from lowband.errors import CommFailedError, CommTimeoutError
from lowband.group import Group

_POLL_S = 0.05
_TAG = 7100  # the state's messages on a group made for the admission (nothing else is on it yet)


def _store_error(where: str, exc: BaseException) -> CommFailedError:
    return CommFailedError(f"{where}: the rendezvous store failed: {exc}")


def request(store: Any, prefix: str, rank: int, nonce: str, config: dict[str, str], where: str) -> None:
    """A replacement asks to join (the newest request of a rank replaces an older one)."""
    try:
        store.set(f"{prefix}/join/{rank}", json.dumps({"nonce": nonce, "config": config}))
    except (RuntimeError, TimeoutError) as exc:
        raise _store_error(where, exc) from exc


def requests(store: Any, prefix: str, absent: Sequence[int], where: str) -> dict[int, dict[str, Any]]:
    """The requests of the ``absent`` world ranks (one store read per rank)."""
    out: dict[int, dict[str, Any]] = {}
    try:
        for r in absent:
            key = f"{prefix}/join/{r}"
            if store.check([key]):
                said = bytes(store.get(key)).decode()
                if said:  # (empty: withdrawn)
                    out[r] = json.loads(said)
    except (RuntimeError, TimeoutError) as exc:
        raise _store_error(where, exc) from exc
    return out


def withdraw(store: Any, prefix: str, rank: int) -> None:
    """Withdraw ``rank``'s request once answered (best effort: an unanswered one is answered again). The
    key is emptied, not deleted: a member that saw it exist and reads it next must not block on a key
    gone meanwhile (a store ``get`` waits for a missing key) nor read half a request."""
    try:
        store.set(f"{prefix}/join/{rank}", "")
    except (RuntimeError, TimeoutError):
        pass


def propose(store: Any, key: str, value: str, where: str) -> None:
    """Store ``value`` under ``key`` unless a proposal is there already."""
    try:
        store.compare_set(key, "", value)
    except (RuntimeError, TimeoutError) as exc:
        raise _store_error(where, exc) from exc


def decided(store: Any, key: str, where: str) -> str | None:
    try:
        return bytes(store.get(key)).decode() if store.check([key]) else None
    except (RuntimeError, TimeoutError) as exc:
        raise _store_error(where, exc) from exc


def answer(store: Any, prefix: str, rank: int, nonce: str, value: dict[str, Any], where: str) -> None:
    try:
        store.set(f"{prefix}/answer/{rank}/{nonce}", json.dumps(value))
    except (RuntimeError, TimeoutError) as exc:
        raise _store_error(where, exc) from exc


def await_answer(
    store: Any, prefix: str, rank: int, nonce: str, timeout: float, where: str
) -> dict[str, Any]:
    """The members' answer to this replacement, polled every 50 ms for at most ``timeout`` seconds."""
    key = f"{prefix}/answer/{rank}/{nonce}"
    deadline = time.monotonic() + timeout
    while True:
        got = decided(store, key, where)
        if got is not None:
            out: dict[str, Any] = json.loads(got)
            return out
        if time.monotonic() >= deadline:
            raise CommTimeoutError(
                f"{where}: no member admitted this replacement within {timeout:g} s (the members admit a "
                "replacement at their next exchange after its request: are they still training, with "
                "on_peer_loss='continue'?)"
            )
        time.sleep(_POLL_S)


def send_bytes(
    group: Group, payload: bytes | None, root: int, timeout: float, where: str, *, to: Sequence[int]
) -> bytes:
    """``payload`` from the group's rank ``root`` to its ranks ``to`` (a length, then the bytes, point to
    point on the group's process group, each bounded by ``timeout``); returns the bytes on every one of
    them (``payload`` itself on ``root``)."""
    import datetime

    td = datetime.timedelta(seconds=timeout)
    try:
        if group.rank == root:
            assert payload is not None
            n = torch.tensor([len(payload)], dtype=torch.int64)
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            for j in to:
                group.pg.send([n], j, _TAG).wait(td)
                group.pg.send([buf], j, _TAG + 1).wait(td)
            return payload
        n = torch.zeros(1, dtype=torch.int64)
        group.pg.recv([n], root, _TAG).wait(td)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        group.pg.recv([buf], root, _TAG + 1).wait(td)
    except RuntimeError as exc:
        raise CommFailedError(f"{where}: the state's transfer failed: {str(exc).splitlines()[0]}") from exc
    return bytes(buf.numpy().tobytes())


__all__ = ["answer", "await_answer", "decided", "propose", "request", "requests", "send_bytes", "withdraw"]
