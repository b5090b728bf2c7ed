"""What a strategy's cost model predicts for one step (:meth:`lowband.strategies.Strategy.predict`).

Times are seconds per training step (one optimizer step of every rank), averaged over a period for
strategies that communicate in some steps only:

- ``iteration_s``: the job's pace, what ``lowband bench`` measures as the iteration time;
- ``compute_s``: forward, backward and optimizer step with no communication;
- ``compress_s``: compression work on the critical path (compress, decompress, PowerSGD's products);
- ``comm_s``: communication not hidden behind computation, so that
  ``iteration_s = compute_s + compress_s + comm_s``;
- ``bytes_per_step``: bytes each rank sends per step (logical, headers aside);
- convergence flags, the settings known to cost convergence: ``local_steps`` (H, steps between two
  synchronisations; 1 = every step), ``compression`` (dense gradient bytes / bytes on the wire; 1 = none),
  ``staleness`` (steps a synchronised value arrives late; 0 = none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowband.errors import InvalidArgumentError


@dataclass(frozen=True)
class Prediction:
    """One strategy's predicted step (module doc)."""

    iteration_s: float
    compute_s: float
    compress_s: float
    comm_s: float
    bytes_per_step: float
    local_steps: int = 1
    compression: float = 1.0
    staleness: int = 0
    note: str = ""

    def __post_init__(self) -> None:
        for k in ("iteration_s", "compute_s", "compress_s", "comm_s", "bytes_per_step"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and v >= 0 and v == v and v != float("inf")):
                raise InvalidArgumentError(f"Prediction: {k} must be finite and >= 0, got {v!r}")
        if self.local_steps < 1 or self.compression < 1.0 or self.staleness < 0:
            raise InvalidArgumentError(
                f"Prediction: local_steps >= 1, compression >= 1 and staleness >= 0 are needed, got "
                f"{self.local_steps}, {self.compression}, {self.staleness}"
            )

    @classmethod
    def of(
        cls, compute_s: float, compress_s: float, comm_s: float, bytes_per_step: float, **flags: Any
    ) -> Prediction:
        """The prediction whose iteration is the sum of its parts (negative rounding clipped to 0)."""
        comm_s = max(0.0, comm_s)
        return cls(compute_s + compress_s + comm_s, compute_s, compress_s, comm_s, bytes_per_step, **flags)

    @property
    def flags(self) -> dict[str, float]:
        """The convergence flags that are set (empty: nothing known to cost convergence)."""
        out: dict[str, float] = {}
        if self.local_steps > 1:
            out["local_steps"] = self.local_steps
        if self.compression > 1.0 + 1e-9:
            out["compression"] = round(self.compression, 1)
        if self.staleness > 0:
            out["staleness"] = self.staleness
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "predicted_ms": self.iteration_s * 1e3,
            "compute_ms": self.compute_s * 1e3,
            "compress_ms": self.compress_s * 1e3,
            "comm_not_overlapped_ms": self.comm_s * 1e3,
            "bytes_per_rank_step": self.bytes_per_step,
            "flags": self.flags,
            "note": self.note,
        }
