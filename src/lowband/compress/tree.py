"""The recursive halving/doubling tree of "A Distributed SGD Algorithm with Global Sketching for Deep
Learning Training Acceleration" as a pure schedule (its executor is :func:`lowband.comm.tree.itree`).

Reduce round ``i = 1 .. ceil(log2 P)``: the members are the ranks ``0, 2^(i-1), 2 * 2^(i-1), ...`` below
``P``; member ``2m + 1`` sends its partial result to member ``2m``, which combines (adds) it. When the
number of members is odd, the last one (the largest rank) sits the round out and goes on to the next
round as it is: so any ``P`` reaches the single root, rank 0, in ``ceil(log2 P)`` rounds (P = 3:
``1 -> 0``, then ``2 -> 0``; P = 5: ``1 -> 0, 3 -> 2``, then ``2 -> 0``, then ``4 -> 0``). The broadcast
replays the reduce rounds in reverse with every message turned round, so the result reaches every rank in
``ceil(log2 P)`` more rounds: ``2 ceil(log2 P)`` in all, the paper's count for any ``P``.

Every non-root rank sends exactly one message in the reduce and receives exactly one in the broadcast;
rank ``r`` receives one message in the reduce (and sends one in the broadcast) for every round ``i``
with ``r`` a multiple of ``2^i`` and ``r + 2^(i-1) < P``; the root does so in every round.

:func:`star_schedule` is the central alternative (Sketched-SGD's parameter server on rank 0): one round
in which every rank sends to the root, one in which the root sends to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowband.errors import InvalidArgumentError

#: a round: ``(src, dst)`` messages, all posted at once (a rank may receive several)
Round = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TreeSchedule:
    """``reduce`` rounds (``dst`` combines what ``src`` sends into its own) then ``broadcast`` rounds
    (``dst`` takes what ``src`` sends); the result ends on ``root`` after the reduce rounds."""

    size: int
    reduce: tuple[Round, ...]
    broadcast: tuple[Round, ...]
    root: int = 0

    @property
    def rounds(self) -> int:
        return len(self.reduce) + len(self.broadcast)

    def counts(self, rank: int) -> tuple[int, int, int, int]:
        """``(reduce sends, reduce receives, broadcast sends, broadcast receives)`` of ``rank``."""
        rs = sum(src == rank for rnd in self.reduce for src, _ in rnd)
        rr = sum(dst == rank for rnd in self.reduce for _, dst in rnd)
        bs = sum(src == rank for rnd in self.broadcast for src, _ in rnd)
        br = sum(dst == rank for rnd in self.broadcast for _, dst in rnd)
        return rs, rr, bs, br


def _check_size(where: str, size: object) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgumentError(f"{where}: size must be an int >= 1, got {size!r}")
    return size


def tree_schedule(size: int) -> TreeSchedule:
    """The halving/doubling tree over ``size`` ranks; see the module docstring."""
    _check_size("tree_schedule", size)
    members = list(range(size))
    rounds: list[Round] = []
    while len(members) > 1:
        rounds.append(tuple((members[2 * m + 1], members[2 * m]) for m in range(len(members) // 2)))
        members = members[::2]
    back = tuple(tuple((dst, src) for src, dst in rnd) for rnd in reversed(rounds))
    return TreeSchedule(size, tuple(rounds), back, 0)


def star_schedule(size: int, root: int = 0) -> TreeSchedule:
    """Every rank sends to ``root`` in one round; ``root`` sends the result to every rank in one round."""
    _check_size("star_schedule", size)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise InvalidArgumentError(f"star_schedule: root must be a rank in [0, {size}), got {root!r}")
    others = [r for r in range(size) if r != root]
    if not others:
        return TreeSchedule(size, (), (), root)
    return TreeSchedule(size, (tuple((r, root) for r in others),), (tuple((root, r) for r in others),), root)
