"""Who trains on after a rank is lost: the pure decision part of a membership change.

When a rank of a strategy's group dies (``on_peer_loss=continue``), each survivor announces itself in
the rendezvous store under the next *epoch* with the index of the exchange it lost the peer at
(:mod:`lowband.comm.membership` does the talking). This module decides, from what a survivor has seen
of those announcements, whether it may *propose* a membership, encodes the proposal, and turns the
one proposal the store kept into the member list every survivor adopts.

Why two survivors can never disagree: the decision is not derived independently by each survivor
from what it happens to have seen. Each one that is ready proposes, and the store keeps only the first
proposal of the epoch (one atomic ``compare_set`` on one key: set if absent, return what is there).
Every survivor, proposer or not, adopts that stored value, and :func:`adopt` is a function of the
value alone. So all survivors adopt the same list, or all raise the same error. What makes a proposal
acceptable (:func:`proposal`): at least a quorum of the last membership announced, and either all of
it announced or nobody new announced for ``settle`` seconds. A survivor that announces after the
decision is not in the list and raises (it arrived too late; it is not averaged with).

A proposal also carries each member's exchange index: survivors that lost the peer at different
exchanges (a rank that died inside an exchange which completed on some ranks only) cannot redo the same
averaging, and :func:`adopt` raises on every one of them rather than letting their replicas diverge
silently. A survivor that waits in vain for a quorum stores a failure instead of a member list, so every
survivor that comes later raises the same error too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lowband.errors import CommFailedError, InvalidArgumentError

_FAILED = "failed:"


@dataclass(frozen=True)
class Decision:
    """What the store kept for an epoch: the members (world ranks, ascending) with the exchange index
    each announced, or a failure (``failure`` names why; ``members`` empty)."""

    members: tuple[int, ...]
    exchanges: tuple[int, ...]
    failure: str = ""


def quorum_size(last: Sequence[int], min_ranks: int | None) -> int:
    """How many of the ``last`` membership must announce: ``min_ranks`` if given, else a majority."""
    if not last:
        raise InvalidArgumentError("membership: the last membership is empty")
    if min_ranks is None:
        return len(last) // 2 + 1
    if isinstance(min_ranks, bool) or not isinstance(min_ranks, int) or min_ranks < 1:
        raise InvalidArgumentError(f"membership: min_ranks must be an int >= 1, got {min_ranks!r}")
    return min_ranks


def proposal(last: Sequence[int], seen: Mapping[int, int], quorum: int, settled: bool) -> str | None:
    """The proposal a survivor may store, or None while it must wait. ``seen``: the announcements it
    has read (world rank -> exchange index); ``settled``: nobody new announced for the settle time."""
    arrived = sorted(r for r in seen if r in set(last))
    if len(arrived) < quorum or (len(arrived) < len(last) and not settled):
        return None
    return ",".join(f"{r}@{seen[r]}" for r in arrived)


def failure(last: Sequence[int], seen: Mapping[int, int], quorum: int, waited: float) -> str:
    """The value stored when the quorum was not met within ``waited`` seconds."""
    arrived = sorted(seen)
    missing = sorted(set(last) - set(seen))
    return (
        f"{_FAILED}a quorum of {quorum} of the last membership {sorted(last)} was not met within "
        f"{waited:g} s: only rank(s) {arrived} reached the agreement, rank(s) {missing} did not"
    )


def decode(value: str) -> Decision:
    """The :class:`Decision` of a stored value (:func:`proposal` or :func:`failure`)."""
    if value.startswith(_FAILED):
        return Decision((), (), value[len(_FAILED) :])
    pairs = [item.split("@") for item in value.split(",")]
    return Decision(tuple(int(r) for r, _ in pairs), tuple(int(e) for _, e in pairs))


def adopt(decision: Decision, me: int, where: str, *, aligned: bool = True) -> tuple[int, ...]:
    """The members ``me`` trains on with; raises :class:`CommFailedError` (the same on every survivor
    for a failure, or for differing exchanges when ``aligned``: a strategy that redoes one averaging
    together) when it cannot. A strategy that averages at every step (``aligned=False``) lets members
    that lost the peer at different steps catch up alone to the latest (:func:`catch_up`)."""
    if decision.failure:
        raise CommFailedError(f"{where}: {decision.failure}")
    if aligned and len(set(decision.exchanges)) > 1:
        at = ", ".join(
            f"rank {r} at exchange {e}" for r, e in zip(decision.members, decision.exchanges, strict=True)
        )
        raise CommFailedError(
            f"{where}: the survivors lost the peer at different exchanges ({at}): the exchange it died in "
            "completed on some ranks only, so they cannot redo one averaging together"
        )
    if me not in decision.members:
        raise CommFailedError(
            f"{where}: rank {me} reached the membership agreement after the others had settled on "
            f"{list(decision.members)}; it is no longer a member"
        )
    return decision.members


def catch_up(decision: Decision) -> int:
    """The step every member of an adopted ``decision`` (``aligned=False``) trains alone to before they
    meet on the new group: the latest announced. Why the latest: a member that announced at step s
    completed s without the others (an averaging of s completed on some ranks only, or s had none), and
    it cannot undo that step; the others can add steps alone, so every member meets the new group with the
    same step count (the same schedule position, and the same number of steps left in the user's loop)."""
    return max(decision.exchanges)


__all__ = ["Decision", "adopt", "catch_up", "decode", "failure", "proposal", "quorum_size"]
