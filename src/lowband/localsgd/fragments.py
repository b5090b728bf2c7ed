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
"""

from __future__ import annotations

from collections.abc import Sequence

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


__all__ = ["check_delay", "split_fragments", "sync_offsets"]
