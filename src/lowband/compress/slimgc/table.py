"""SlimGC's communication threshold table (Algorithm 1 and 2 of "SlimGC: Gradient Compression
Optimization Strategy For Distributed Deep Learning"): which gradient sizes are worth compressing.

During a warm-up of ``pre_steps`` steps every unit (one parameter tensor) is sent alternately in full
precision (even steps, counted from 0) and compressed (odd steps). :class:`Samples` records, per step
and unit, the communication time and, on compressed steps, the compression time. :func:`build_table`
averages them per unit over the warm-up (Algorithm 1, line 11), then per tensor size, into
:class:`Row`\\ s: ``t_c`` (full precision), ``t_cq`` (compressed communication), ``t_pq`` (compression +
decompression) and the benefit ratio ``t_c / (t_cq + t_pq)``. :meth:`ThresholdTable.best_threshold` is
BestCT, the smallest size whose ratio exceeds 1 (Algorithm 2, line 1: ``rule="paper"``), or, by default
in the strategy, the smallest size from which every larger size's ratio exceeds 1 (``rule="stable"``,
robust to one noisy small tensor); units of at least BestCT bytes are compressed, smaller ones go in
full precision (:func:`compress_mask`).

Edge cases the paper leaves open: no size with a ratio above 1 gives BestCT = inf (compression never
paid off: nothing is compressed); every size above 1 gives the smallest size (everything compressed).

Everything here is pure: the cross-rank part (every rank's samples combined before the table is built,
so every rank builds the same table) is in :mod:`lowband.compress.slimgc.pipeline`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lowband.errors import InvalidArgumentError

Tensor = torch.Tensor
INF = math.inf


def parse_comm_threshold(where: str, value: object) -> float | None:
    """``comm_threshold``: ``"auto"`` (None: measured in the warm-up), a number of bytes >= 0 (0:
    compress every unit), or ``"inf"`` / ``float('inf')`` (compress none)."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return None
        if v in ("inf", "+inf"):
            return INF
        try:
            value = float(v)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise InvalidArgumentError(
            f"{where}: comm_threshold must be 'auto', a number of bytes >= 0 or 'inf', got {value!r}"
        )
    return float(value) if math.isinf(value) else float(int(value))


def compress_mask(sizes: Sequence[int], threshold: float) -> list[bool]:
    """Which units are compressed under ``threshold`` (bytes): those of at least ``threshold`` bytes."""
    return [s >= threshold for s in sizes]


def compressed_step(step: int) -> bool:
    """Warm-up steps alternate: full precision on even steps (from 0), compressed on odd ones."""
    return step % 2 == 1


@dataclass(frozen=True)
class Row:
    """One tensor size of the table: mean seconds per unit of that size over the warm-up."""

    size: int  # bytes of one unit
    units: int  # units of this size
    t_c: float  # full-precision communication
    t_cq: float  # compressed communication
    t_pq: float  # compression + decompression

    @property
    def ratio(self) -> float:
        """The benefit ratio ``t_c / (t_cq + t_pq)``: above 1, compressing this size pays."""
        cost = self.t_cq + self.t_pq
        return self.t_c / cost if cost > 0 else INF


@dataclass(frozen=True)
class ThresholdTable:
    """Rows sorted by size (see the module docstring)."""

    rows: tuple[Row, ...]

    def best_threshold(self, rule: str = "paper") -> float:
        """BestCT; inf when compression never pays off.

        - ``"paper"`` (Algorithm 2, line 1): the smallest size with a ratio above 1;
        - ``"stable"``: the smallest size from which every larger size has a ratio above 1. One noisy
          small tensor whose ratio happens to exceed 1 (a warm-up of a few steps on a shared machine
          measures milliseconds with jitter of the same order) then cannot switch compression on for
          every larger tensor whose own measurement says it does not pay.
        """
        if rule == "paper":
            for r in self.rows:
                if r.ratio > 1.0:
                    return float(r.size)
            return INF
        if rule == "stable":
            best = INF
            for r in reversed(self.rows):
                if r.ratio <= 1.0:
                    break
                best = float(r.size)
            return best
        raise InvalidArgumentError(
            f"ThresholdTable.best_threshold: rule must be 'paper' or 'stable', got {rule!r}"
        )

    def report(self) -> list[dict[str, float]]:
        """The rows as plain dicts (for the bench's results), with their ratio."""
        return [dict(asdict(r), ratio=r.ratio) for r in self.rows]

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> ThresholdTable:
        try:
            rows = tuple(
                Row(int(r["size"]), int(r["units"]), float(r["t_c"]), float(r["t_cq"]), float(r["t_pq"]))
                for r in state["rows"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"ThresholdTable.from_state_dict: malformed state ({exc})") from exc
        return cls(tuple(sorted(rows, key=lambda r: r.size)))


class Samples:
    """Warm-up measurements: ``comm[step, unit]`` (seconds from launch to completion) and
    ``compress[step, unit]`` (seconds of compression + decompression; 0 on full-precision steps)."""

    def __init__(self, steps: int, units: int) -> None:
        if steps < 2 or units < 1:
            raise InvalidArgumentError(
                f"Samples: needs at least 2 warm-up steps and 1 unit, got {steps} steps and {units} units"
            )
        # host bookkeeping (seconds measured on the host): CPU tensors whatever the data's device
        self.comm = torch.zeros(steps, units, dtype=torch.float64, device="cpu")
        self.compress = torch.zeros(steps, units, dtype=torch.float64, device="cpu")

    def add(self, step: int, unit: int, comm: float, compress: float) -> None:
        self.comm[step, unit] = comm
        self.compress[step, unit] = compress

    def state_dict(self) -> dict[str, Any]:
        return {"comm": self.comm.clone(), "compress": self.compress.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        comm, comp = state.get("comm"), state.get("compress")
        if not isinstance(comm, Tensor) or not isinstance(comp, Tensor) or comm.shape != self.comm.shape:
            raise InvalidArgumentError(
                f"Samples.load_state_dict: expected 'comm' and 'compress' tensors of shape "
                f"{tuple(self.comm.shape)} (pre_steps, units)"
            )
        self.comm = comm.to(device="cpu", dtype=torch.float64).clone()
        self.compress = comp.to(device="cpu", dtype=torch.float64).clone()


def build_table(sizes: Sequence[int], comm: Tensor, compress: Tensor) -> ThresholdTable:
    """The table from warm-up samples (``[steps, units]``, steps alternating as :func:`compressed_step`):
    per unit the mean over its full-precision and its compressed steps, then per size the mean over
    the units of that size."""
    steps, n = comm.shape
    if n != len(sizes) or compress.shape != comm.shape or steps < 2:
        raise InvalidArgumentError(
            f"build_table: {len(sizes)} sizes, samples of shapes {tuple(comm.shape)} and "
            f"{tuple(compress.shape)} (need [steps >= 2, units])"
        )
    q = torch.tensor([compressed_step(s) for s in range(steps)], device=comm.device)
    t_c = comm[~q].mean(0)
    t_cq = comm[q].mean(0)
    t_pq = compress[q].mean(0)
    rows = []
    for size in sorted(set(sizes)):
        idx = torch.tensor([i for i, s in enumerate(sizes) if s == size], device=comm.device)
        rows.append(
            Row(
                int(size),
                len(idx),
                float(t_c[idx].mean()),
                float(t_cq[idx].mean()),
                float(t_pq[idx].mean()),
            )
        )
    return ThresholdTable(tuple(rows))
