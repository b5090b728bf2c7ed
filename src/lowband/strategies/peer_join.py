"""A replacement of a lost rank joins the survivors (``on_peer_loss="continue"``; started by ``lowband run
--keep-going --replacements N`` with ``LOWBAND_JOIN=1``).

- *The replacement*: :func:`lowband.init` makes it a world of its own (the rank it replaces);
  :func:`~lowband.strategies.make_strategy` builds its strategy there and then calls :func:`join`: it
  asks to join (its agreed configuration in the request), waits for the members' answer, joins the new
  group, receives a live member's whole state over it (model, optimizer, error-feedback and strategy
  state: :meth:`~lowband.strategies.base.Strategy.state_dict`, the data path, not the disk), loads it and
  returns: ``strategy.steps`` says at which step it goes on.
- *The members*, at each exchange while a world rank is missing: before the averaging,
  :func:`propose` reads the requests of the missing ranks, refuses those whose configuration (options,
  model layout, tied parameters) differs from theirs, naming the fields, and proposes the others for this
  exchange (one ``compare_set``: the first proposal stays); when the next step begins, :func:`admit`
  reads the proposal and, if there is one, admits: a new group over members and replacements, the lowest member
  (the donor) sends its state to each replacement, and every rank checks that each replacement received
  the bytes the donor sent (SHA-256, exchanged by all: one error on every rank otherwise).

Why every member reads the same proposal: it is written only by members before they enter the
exchange's averaging, and read only after their averaging completed, which needs every member to have
entered it. A loss at that exchange starts a new membership epoch, whose keys are new: the request stays
and is proposed again at the next exchange.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch

from lowband.comm import join as wire
from lowband.errors import CommFailedError, InvalidArgumentError
from lowband.runtime import current, open_group, rendezvous_store
from lowband.strategies.digest import exchange_text

if TYPE_CHECKING:
    from lowband.strategies.peer_loss import PeerLoss

#: how long a replacement waits for its admission, in runtime timeouts (the members admit at their next
#: exchange, which a long local period puts far away)
JOIN_WAIT_TIMEOUTS = 5


def _where(s: PeerLoss) -> str:
    return f"strategy {s.name!r} (on_peer_loss='continue') on rank {s.group.world_rank}"


def _admit_key(s: PeerLoss, exchange: int) -> str:
    return f"{s._membership_key}/epoch{s._epochs}/admit/x{exchange}"


def _absent(s: PeerLoss) -> list[int]:
    size = current(_where(s)).size
    return [r for r in range(size) if r not in s.group.ranks]


def _differences(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    keys = sorted(set(mine) | set(theirs))
    return [f"{k}: {theirs.get(k, 'absent')} (the members': {mine.get(k, 'absent')})" for k in keys
            if mine.get(k) != theirs.get(k)]  # fmt: skip


def propose(s: PeerLoss, exchange: int) -> None:
    """Members, before exchange ``exchange``'s averaging: propose the replacements that asked to join."""
    absent = _absent(s)
    if not absent:
        return
    where = _where(s)
    store = rendezvous_store(current(where))
    ok: dict[int, str] = {}
    for r, req in wire.requests(store, s._membership_key, absent, where).items():
        diff = _differences(s.agreed_config or {}, req.get("config", {}))
        if diff:
            refused = f"its configuration differs from the members': {'; '.join(diff[:4])}"
            wire.answer(store, s._membership_key, r, req["nonce"], {"refused": refused}, where)
            wire.withdraw(store, s._membership_key, r)
        else:
            ok[r] = req["nonce"]
    if ok:
        wire.propose(store, _admit_key(s, exchange), json.dumps(sorted(ok.items())), where)


def admit(s: PeerLoss, exchange: int) -> None:
    """Members, when the step after exchange ``exchange``'s begins (the state is the whole last step's,
    and the user's loop did what it does after a step): admit the replacements proposed for it."""
    if not _absent(s):
        return
    # this rank's averagings of that exchange completed (they could not without every member's, each
    # launched after its proposal), so every member has proposed: the proposal read now is final
    s.synchronize()
    where = _where(s)
    ctx = current(where)
    store = rendezvous_store(ctx)
    got = wire.decided(store, _admit_key(s, exchange), where)
    if got is None:
        return
    began = time.monotonic()
    joiners = {int(r): str(n) for r, n in json.loads(got)}
    members = tuple(sorted((*s.group.ranks, *joiners)))
    donor = s.group.ranks[0]
    s._epochs += 1
    key = f"{s._membership_key}/epoch{s._epochs}/group"
    if s.group.world_rank == donor:
        for r, nonce in joiners.items():
            said = {
                "members": list(members),
                "key": key,
                "donor": donor,
                "epoch": s._epochs,
                "exchange": exchange,
            }
            wire.answer(store, s._membership_key, r, nonce, said, where)
            wire.withdraw(store, s._membership_key, r)
    if s.nonfinite is not None:  # the agreements in flight on the old group are read there, by all
        s.nonfinite.settle()
    group = _open(s, members, key)
    payload = None
    if s.group.world_rank == donor:
        buf = io.BytesIO()
        torch.save(s.state_dict(), buf)
        payload = buf.getvalue()
    sent = _transfer(s, group, payload, members.index(donor), list(joiners))
    s.install_group(group)
    event = {"joined_ranks": sorted(joiners), "members": list(members), "step": s.steps, "exchange": exchange,
             "donor": donor, "state_bytes": sent, "admit_s": round(time.monotonic() - began, 4)}  # fmt: skip
    s.peer_losses.append(event)


def join_if_replacement(strategy: Any, where: str) -> None:
    """:func:`~lowband.strategies.make_strategy` on a replacement (``LOWBAND_JOIN=1``): :func:`join`, or
    a clear error for a strategy that cannot admit one."""
    from lowband.strategies.peer_loss import PeerLoss

    if not isinstance(strategy, PeerLoss) or strategy.peer_loss != "continue":
        strategy.close()
        raise InvalidArgumentError(
            f"{where}: this process replaces a lost rank (LOWBAND_JOIN=1, lowband run --replacements) but "
            f"strategy {strategy.name!r} does not train on without lost ranks: give it on_peer_loss='continue' "
            "(localsgd, diloco, dreamddp, plsgd-enp, flsgd-overlap, atc and awc with allreduce_every > 0), or run "
            "without --replacements"
        )
    join(strategy)


def join(s: PeerLoss) -> None:
    """The replacement: ask, wait, join the group, take a live member's state (module docstring)."""
    where = f"strategy {s.name!r} (a replacement of rank {s.group.world_rank})"
    ctx = current(where)
    store = rendezvous_store(ctx)
    nonce = uuid.uuid4().hex
    began = time.monotonic()
    wire.request(store, s._membership_key, s.group.world_rank, nonce, s.agreed_config or {}, where)
    said = wire.await_answer(
        store, s._membership_key, s.group.world_rank, nonce, JOIN_WAIT_TIMEOUTS * ctx.config.timeout, where
    )
    if "refused" in said:
        raise CommFailedError(f"{where}: the members refused it: {said['refused']}")
    admitted = time.monotonic()
    members = tuple(int(r) for r in said["members"])
    group = _open(s, members, str(said["key"]))
    got = _transfer(s, group, None, members.index(int(said["donor"])), [s.group.world_rank])
    s._epochs = int(said["epoch"])
    s.install_group(group)
    s.peer_losses.append(
        {"joined_ranks": [group.world_rank], "members": list(members), "step": s.steps,
         "exchange": int(said["exchange"]), "donor": int(said["donor"]), "state_bytes": got,
         "wait_s": round(admitted - began, 4), "transfer_s": round(time.monotonic() - admitted, 4)}
    )  # fmt: skip


def _open(s: PeerLoss, members: tuple[int, ...], key: str) -> Any:
    where = _where(s)
    try:  # (bounded: gloo waits for the members' addresses in the store up to the timeout)
        return open_group(current(where), members, key, f"{s.name}-members{s._epochs}")
    except (RuntimeError, TimeoutError) as exc:
        raise CommFailedError(
            f"{where}: the group of ranks {list(members)} could not be made: {exc}"
        ) from exc


def _transfer(s: PeerLoss, group: Any, payload: bytes | None, root: int, joiners: list[int]) -> int:
    """The donor's state to the replacements (loaded there), checked by SHA-256 on every rank; returns
    the bytes the donor sent (to each replacement)."""
    where = _where(s)
    timeout = current(where).config.timeout
    me = group.world_rank
    if me in joiners or payload is not None:
        data = wire.send_bytes(
            group, payload, root, timeout, where, to=[group.ranks.index(j) for j in joiners]
        )
    else:
        data = b""
    digest = f"{hashlib.sha256(data).hexdigest()} {len(data)}" if data else ""
    seen = exchange_text(group, digest, f"{where}: the replacement's state checksum", timeout)
    sums = {group.ranks[i]: d for i, d in enumerate(seen) if d}
    if len(set(sums.values())) != 1 or set(sums) != {group.ranks[root], *joiners}:
        raise CommFailedError(
            f"{where}: the state sent to the replacement(s) {joiners} arrived altered (SHA-256 by rank: {sums})"
        )
    if me in joiners:
        s.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))
    return int(sums[group.ranks[root]].split()[1])


__all__ = ["JOIN_WAIT_TIMEOUTS", "admit", "join", "join_if_replacement", "propose"]
