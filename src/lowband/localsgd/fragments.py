"""Streaming fragments of an outer loop (pure): which parameters form each fragment, and at which inner
step each fragment is synchronised.

Streaming DiLoCo ("Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch",
Douillard et al., preprint 2025, arXiv 2501.18512) splits the model into ``F`` fragments that are
synchronised at staggered inner steps of each period of ``H`` steps, so only one fragment's exchange is
in flight at a time and the peak bandwidth falls by ``F``. Here a fragment is a run of consecutive
parameter tensors (the model's order, which is the forward order of most models), the runs balanced by
size; fragment ``p`` is synchronised at the inner steps ``t`` with ``t mod H == ((p + 1) * H // F) mod H``
(the last fragment at the end of each period, as DiLoCo's whole model is: with ``F = 1`` this is DiLoCo's
schedule).

``fragments=auto`` (:func:`choose_fragments`) picks ``F`` from a cost model: a fragment's exchange takes
``alpha + beta * ratio * bytes`` seconds (DreamDDP's fitted link, :mod:`lowband.localsgd.profiler`;
``ratio`` the compressed share of the bytes) and overlaps the ``delay`` inner steps of compute before it
is applied (``delay * step_seconds``); what does not fit is exposed. ``F`` is the smallest minimising the
period's exposed seconds, the sum over fragments of ``max(0, exchange - window)``, among the ``F`` the
schedule allows (``F <= tensors``, ``F <= H``, ``delay * F < H``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lowband.errors import InvalidArgumentError


def split_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """``fragments`` runs of consecutive indices of ``sizes`` (element counts), none empty, covering
    every index in order; each cut is placed where the running total is closest to the next equal share
    (so the largest fragment is as small as consecutive runs allow, to within one tensor)."""
    n = len(sizes)
    if fragments < 1 or fragments > n:
        raise InvalidArgumentError(
            f"fragments={fragments}: must be between 1 and the number of parameter tensors ({n})"
        )
    total = sum(sizes)
    cuts: list[int] = []
    run = 0
    start = 0
    for p in range(1, fragments):
        share = total * p / fragments
        best = None
        # the cut after index i, keeping at least one tensor per fragment on both sides
        lo, hi = (cuts[-1] + 1 if cuts else 1), n - (fragments - p)
        run = sum(sizes[:lo])
        for i in range(lo, hi + 1):
            if best is None or abs(run - share) < abs(best[1] - share):
                best = (i, run)
            if i < n:
                run += sizes[i]
        assert best is not None
        cuts.append(best[0])
    out = []
    for c in [*cuts, n]:
        out.append(list(range(start, c)))
        start = c
    return out


def sync_offsets(fragments: int, inner_steps: int) -> list[int]:
    """Per fragment, the inner step within each period (``t mod H``) at which it is synchronised."""
    if inner_steps < fragments:
        raise InvalidArgumentError(
            f"fragments={fragments} with inner_steps={inner_steps}: each fragment needs its own inner step "
            "of the period (fragments <= inner_steps)"
        )
    return [((p + 1) * inner_steps // fragments) % inner_steps for p in range(fragments)]


def check_delay(delay: int, fragments: int, inner_steps: int) -> None:
    """A fragment's update must land before the fragment is sent again: ``delay < H / F``."""
    if delay < 0 or delay * fragments >= inner_steps:
        raise InvalidArgumentError(
            f"delay={delay} with inner_steps={inner_steps} and fragments={fragments}: a fragment's outer update "
            f"must be applied before its next exchange starts, so 0 <= delay < inner_steps / fragments "
            f"(= {inner_steps / fragments:g})"
        )


def max_fragments(tensors: int, inner_steps: int, delay: int) -> int:
    """The most fragments the schedule allows: one tensor and one inner step each, ``delay * F < H``."""
    most = min(tensors, inner_steps)
    if delay > 0:
        most = min(most, (inner_steps - 1) // delay)
    return most


@dataclass(frozen=True)
class FragmentChoice:
    """What :func:`choose_fragments` decided and why (logged, reported and checkpointed)."""

    #: the chosen split: runs of consecutive tensor indices
    fragments: list[list[int]]
    #: seconds of compute each exchange overlaps (``delay * step_seconds``)
    window: float
    #: the chosen split's predicted exchange seconds, per fragment
    exchange: list[float]
    #: predicted exposed seconds per period for F = 1, 2, ... (index F - 1)
    exposed: list[float]

    @property
    def count(self) -> int:
        return len(self.fragments)

    def explain(self) -> str:
        f, ex = self.count, self.exposed
        why = (
            "the fewest whose every exchange fits the window"
            if ex[f - 1] == 0.0
            else "no split hides every exchange; the fewest with the least exposed time"
        )
        return (
            f"fragments=auto chose F={f} ({why}): exchanges {max(self.exchange):.4g} s at most against "
            f"a window of {self.window:.4g} s; exposed s/period for F=1..{len(ex)}: "
            + ", ".join(f"{x:.4g}" for x in ex)
        )


def choose_fragments(
    sizes: Sequence[int],
    *,
    step_seconds: float,
    alpha: float,
    beta: float,
    inner_steps: int,
    delay: int,
    ratio: float = 1.0,
) -> FragmentChoice:
    """``fragments=auto`` (module doc): ``sizes`` are the tensors' bytes (in order), ``step_seconds`` one
    inner step's compute, ``alpha``/``beta`` the link's fit, ``ratio`` the bytes on the wire per byte of
    pseudo-gradient. Each ``F`` is split by :func:`split_fragments` on the bytes (balanced exchanges)."""
    for what, v in (("step_seconds", step_seconds), ("alpha", alpha), ("beta", beta), ("ratio", ratio)):
        if not v >= 0.0 or v == float("inf"):
            raise InvalidArgumentError(f"fragments=auto: {what} must be finite and >= 0, got {v!r}")
    if delay < 1:
        raise InvalidArgumentError(
            f"fragments=auto with delay={delay}: an exchange overlaps the delay inner steps before it is "
            "applied; with delay=0 nothing overlaps and one fragment is always best (give delay >= 1)"
        )
    most = max_fragments(len(sizes), inner_steps, delay)
    if most < 1:
        raise InvalidArgumentError(
            f"fragments=auto with inner_steps={inner_steps} and delay={delay}: no fragment count fits "
            f"(delay * fragments < inner_steps)"
        )
    window = delay * step_seconds
    best: tuple[float, list[list[int]], list[float]] | None = None
    exposed: list[float] = []
    for f in range(1, most + 1):
        split = split_fragments(sizes, f)
        ex = [alpha + beta * ratio * sum(sizes[i] for i in frag) for frag in split]
        hidden = sum(max(0.0, e - window) for e in ex)
        exposed.append(hidden)
        if best is None or hidden < best[0]:
            best = (hidden, split, ex)
    assert best is not None
    return FragmentChoice(best[1], window, best[2], exposed)


__all__ = [
    "FragmentChoice",
    "check_delay",
    "choose_fragments",
    "max_fragments",
    "split_fragments",
    "sync_offsets",
]
