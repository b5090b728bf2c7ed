"""Recovery of the coordinates to apply from a summed sketch (HEAVYMIX), and the top-k selections the
sketched and global-top-k reducers share (pure).

HEAVYMIX (from "Communication-efficient distributed SGD with sketching"): with ``est`` the sketch's
per-coordinate estimates and ``norm_sq`` its estimate of ``||g||^2``, the heavy set is
``H = {i : est_i^2 >= norm_sq / k}`` (the paper's text lacks the square; the intent, and the sketch's
guarantee, is about squares). The paper leaves two cases open; lowband fills them from the intent:

- ``|H| > k``: ``H`` is truncated to the ``k`` largest ``|est_i|`` (ties: the smaller index);
- ``|H| < k``: ``H`` is filled to exactly ``k`` with a uniform random choice from the other coordinates,
  drawn from a generator seeded by ``(seed, step, unit)``, so every rank (which holds the same summed
  sketch, bit for bit) chooses the same set with no communication.

The result is always ``min(k, d)`` distinct indices in ascending order. Oversampling (``oversample =
p > 1``): recover ``ceil(p * k)`` candidates, fetch their exact values, keep the ``k`` largest
(:func:`keep_largest`).

Ties everywhere (:func:`topk_indices`): larger magnitude first, then the smaller position; so a
selection is a function of the values alone (``torch.topk``'s order among equal values is not).

Checked against the paper (Ivkin et al., NeurIPS 2019, Algorithm 2, as gs-SGD restates it): the
threshold on the sketch's estimates, its estimate of ``||g||^2`` (the median over rows of the rows'
sums of squares, as its authors' CountSketch code computes it) and the uniform fill are the paper's.
At most ``k`` coordinates can each hold ``||g||^2 / k``, and a dense gradient has few that do: on the
``fmnist-cnn`` gradient summed over 4 ranks (``benchmarks/gssgd_recovery.py``,
``benchmarks/results/gssgd-recovery/``) 147 of its 532,458 coordinates are heavy at ``k = 5,325``
(density 0.01) and 2 at ``k = 534`` (0.001) (the sketch's estimates find 172 and 3), so HEAVYMIX
fills the rest of ``k`` at random: it finds 4.1% (0.6%) of the true top-k, against 41.9% (8.7%) for the ``k``
largest estimates. Its authors' own code recovers by the largest estimates too (``unSketch(k)`` in
``dhroth/sketchedsgd``), which is lowband's ``recovery="topk"``, the strategies' default;
``recovery="heavymix"`` is the paper's algorithm.
"""

from __future__ import annotations

import math

import torch

from lowband.compress import sparse
from lowband.errors import InvalidArgumentError

Tensor = torch.Tensor


def topk_indices(x: Tensor, k: int) -> Tensor:
    """Positions of the ``k`` largest ``|x|`` (ties: the smaller position), ascending; all of them
    when ``k >= x.numel()`` (the top-k compressor's selection)."""
    return sparse.topk_indices(x.abs(), k)


def heavymix(est: Tensor, norm_sq: float | Tensor, k: int, generator: torch.Generator) -> Tensor:
    """HEAVYMIX's ``min(k, d)`` indices (ascending) from the estimates; see the module docstring.
    ``norm_sq`` may be a 0-dim tensor on ``est``'s device; ``generator`` is a CPU generator (the fill
    is drawn on the CPU and moved, so the choice does not depend on the device)."""
    d = est.numel()
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidArgumentError(f"heavymix: k must be an int >= 1, got {k!r}")
    k = min(k, d)
    is_heavy = est.double().square() >= norm_sq / k
    # the size of the heavy set decides the fill: it must be known on the host (a synchronisation)
    heavy = is_heavy.nonzero().view(-1)
    if heavy.numel() >= k:
        return heavy[topk_indices(est[heavy], k)]
    rest = (~is_heavy).nonzero().view(-1)
    pick = torch.randperm(rest.numel(), generator=generator, device="cpu")[: k - heavy.numel()]
    fill = rest[pick.to(rest.device)]
    return torch.cat([heavy, fill]).sort().values


def candidates(k: int, oversample: float, d: int) -> int:
    """How many coordinates to recover before keeping ``k`` (``ceil(oversample * k)``, at most ``d``)."""
    return min(d, max(k, math.ceil(oversample * k)))


def keep_largest(idx: Tensor, values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` entries of ``(idx, values)`` with the largest ``|values|`` (ties: earlier entry)."""
    keep = topk_indices(values, k)
    return idx[keep], values[keep]


def local_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``(indices, values)`` of the ``k`` largest ``|x|`` (ascending indices)."""
    idx = topk_indices(x, k)
    return idx, x[idx]


def merge_topk(
    ia: Tensor, va: Tensor, ib: Tensor, vb: Tensor, k: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """gTop-k's merge of two sparse vectors: sum them (union of indices), keep the ``k`` entries of
    largest magnitude (ties: the smaller index). Returns ``(idx, val, dropped_idx, dropped_val)``,
    indices ascending; the dropped entries are the partial sums the merge did not keep."""
    # a union of data-dependent size: unique and the masks below synchronise with the host on a device
    u, inv = torch.unique(torch.cat([ia, ib]), return_inverse=True)
    s = va.new_zeros(u.numel()).index_add_(0, inv, torch.cat([va, vb]))
    keep = topk_indices(s, k)
    mask = torch.zeros(u.numel(), dtype=torch.bool, device=u.device)
    mask[keep] = True
    return u[mask], s[mask], u[~mask], s[~mask]
