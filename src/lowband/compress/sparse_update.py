"""What the globally sparse reducers (gs-SGD, Sketched-SGD, gTop-k) share: the number of coordinates
``k`` of a unit, error feedback per worker, optional worker momentum with Sketched-SGD's masking, and
writing the sparse update back into the gradients.

Error feedback. Each worker keeps a residual per parameter name (a :class:`ResidualMemory`): the
gradient is compensated, ``p = g + e``; once the ``k`` coordinates to apply are known (the same on
every rank) the worker's *contribution* is what of ``p`` went into the applied sum, and the residual
becomes ``e = p - contribution``. The update written into the gradients is the sum over ranks of the
contributions divided by ``P``, so, summed over ranks,
``sum(e after) + P * update = sum(e before) + sum(g)`` (conservation; exact up to rounding).

Momentum. By default there is none here: the wrapped torch optimizer applies its own momentum to the
sparse update. ``momentum = rho > 0`` keeps Sketched-SGD's worker momentum instead (``u = rho u + g``;
``p = e + u``; use a torch optimizer without momentum then), and ``masking=True`` zeroes ``u`` at the
applied coordinates, as Sketched-SGD does so that momentum does not push applied coordinates again.

``k``: ``k`` when given (> 0), else ``ceil(density * numel)`` of each unit; at most the unit's size.
Warm-up (gs-SGD's schedule, after Deep Gradient Compression's): ``warmup="0.25/0.0725/0.015/0.004"``
(or ``"paper"``, that schedule) with ``warmup_steps=S`` applies those densities for ``S`` reductions each
(an epoch each in the paper), then ``density`` or ``k``. The step is the stage's reduction counter, the
same on every rank, so every rank selects the same ``k``.
Indices on the wire are int32 below ``2**31`` elements (int64 above), as the top-k compressor's.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lowband.compress.memory import ResidualMemory, Segments
from lowband.compress.reducer import flatten, segments, unflatten_into
from lowband.compress.sparse import count_from_ratio
from lowband.errors import InvalidArgumentError
from lowband.optim.reducer import Reducer, Timings, Unit
from lowband.options import Opt, Options, Rule

Tensor = torch.Tensor

#: gs-SGD's warm-up densities ("paper"), one per epoch of its first four
PAPER_WARMUP = (0.25, 0.0725, 0.015, 0.004)


def parse_warmup(warmup: str | Sequence[float]) -> tuple[float, ...]:
    """``"0.25/0.0725"``, ``"paper"``, ``""`` or a sequence of densities -> a tuple of densities in
    (0, 1]; ``ValueError`` otherwise (the warmup option's parser, :data:`SPARSE_OPTIONS`)."""
    if isinstance(warmup, str):
        text = warmup.strip()
        if text == "paper":
            return PAPER_WARMUP
        items = [float(v) for v in text.split("/")] if text else []
    else:
        items = list(warmup)
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1 for v in items)
    if not ok:
        raise ValueError(f"warm-up densities must be numbers in (0, 1], got {warmup!r}")
    return tuple(float(v) for v in items)


#: the options of every globally sparse reducer (:class:`SparseUpdateReducer`; defaults its own),
#: checked by its constructor, and of the strategies on them (``gs-sgd``, ``sketched-sgd``, ``gtopk``)
SPARSE_OPTIONS = Options(
    {
        "density": Opt(float, min=0, max=1, doc="the fraction of each unit applied per step (when k=0)"),
        "k": Opt(int, min=0, doc="coordinates applied per unit and step (0: from density)"),
        "momentum": Opt(float, min=0, max=1, doc="Sketched-SGD's worker momentum (0: the optimizer's)"),
        "masking": Opt(bool, doc="zero the worker momentum at the applied coordinates"),
        "seed": Opt(int, doc="seeds the sketches' hashes and random fills"),
        "warmup": Opt(
            str, objects=(list, tuple), parse=parse_warmup,
            what="densities in (0, 1] separated by '/' (e.g. 0.25/0.015), 'paper' or ''",
            doc="warm-up densities, each for warmup_steps reductions",
        ),
        "warmup_steps": Opt(int, min=0, unit="steps", doc="reductions per warm-up density"),
    },
    rules=[
        Rule(("density", "k"), "give density in (0, 1] or k >= 1", lambda o: o["k"] > 0 or o["density"] > 0),
        Rule(
            ("warmup", "warmup_steps"), "a warm-up needs warmup_steps >= 1 (steps per density)",
            lambda o: not parse_warmup(o["warmup"]) or o["warmup_steps"] >= 1,
        ),
    ],
)  # fmt: skip


@dataclass
class Step:
    """One unit's reduction in progress on this rank."""

    key: str
    segs: Segments
    grads: list[Tensor]
    velocity: Tensor | None  # u, with worker momentum
    p: Tensor  # the compensated gradient
    k: int


class SparseUpdateReducer(Reducer):
    """The shared part of the gs-SGD, Sketched-SGD and gTop-k reducers; see the module docstring."""

    name = "sparse"
    #: compression (sketching, residuals) and recovery seconds, all on the thread that reduces and waits
    timings: Timings

    def __init__(
        self,
        *,
        density: float,
        k: int,
        momentum: float = 0.0,
        masking: bool = False,
        seed: int = 0,
        warmup: str | Sequence[float] = "",
        warmup_steps: int = 0,
    ) -> None:
        given = {
            "density": density, "k": k, "momentum": momentum, "masking": masking, "seed": seed,
            "warmup": warmup, "warmup_steps": warmup_steps,
        }  # fmt: skip
        o = SPARSE_OPTIONS.check(type(self).__name__, given)
        self.density: float = o["density"]
        self.k: int = o["k"]
        self.momentum: float = o["momentum"]
        self.masking: bool = o["masking"]
        self.seed: int = o["seed"]
        self.warmup = parse_warmup(o["warmup"])
        self.warmup_steps: int = o["warmup_steps"]
        self.memory = ResidualMemory()
        self.velocity = ResidualMemory(beta=momentum) if momentum > 0 else None
        self.timings = Timings()
        #: the coordinates applied in each unit's last reduction (ascending), for reports and checks
        self.last_indices: dict[str, Tensor] = {}

    def warmup_density(self, step: int | None) -> float | None:
        """The warm-up density at reduction ``step``, or None once the warm-up is over (or with none)."""
        if step is None or not self.warmup or step >= len(self.warmup) * self.warmup_steps:
            return None
        return self.warmup[max(step, 0) // self.warmup_steps]

    def densities(self) -> list[float | None]:
        """Every density this reducer can use: the warm-up's, then None for the steady state."""
        return [*dict.fromkeys(self.warmup), None]

    def k_for(self, numel: int, step: int | None = None, *, density: float | None = None) -> int:
        """The number of coordinates applied for a unit of ``numel`` elements at reduction ``step``: the
        warm-up density's count while it lasts (or ``density``'s when given), else ``k``, else
        ``ceil(density * numel)`` (a product within 1e-9 of an integer counts as that integer, as for
        the top-k compressor); at least 1 and at most ``numel``."""
        d = density if density is not None else self.warmup_density(step)
        if d is not None:
            k = count_from_ratio(d, numel)
        else:
            k = self.k if self.k > 0 else count_from_ratio(self.density, numel)
        return max(1, min(k, numel)) if numel else 0

    def unit_seed(self, key: str) -> int:
        """A seed for the unit's hashes, from the reducer's seed and the unit's key."""
        return zlib.crc32(f"{self.seed}/{key}".encode()) | (self.seed & 0xFFFFFFFF) << 32

    def begin(self, unit: Unit, grads: list[Tensor], step: int | None = None) -> Step:
        """Flatten, add worker momentum and the residual; ``k`` for reduction ``step``."""
        with torch.no_grad():
            flat = flatten(grads)
            segs = segments(unit, grads)
            u = self.velocity.compensate(segs, flat) if self.velocity is not None else None
            p = self.memory.compensate(segs, flat if u is None else u)
        return Step(unit.key, segs, grads, u, p, self.k_for(flat.numel(), step))

    def add_decode(self, seconds: float) -> None:
        """Count recovery time: it runs where the handle is waited (the training thread for the stage)."""
        self.timings.decompress_s += seconds
        self.timings.decompress_inline_s += seconds

    def apply(self, st: Step, idx: Tensor, contribution: Tensor, summed: Tensor, size: int) -> list[Tensor]:
        """Residual ``p - contribution``; gradients ``summed / size`` at ``idx``, zero elsewhere."""
        t0 = time.perf_counter()
        self.last_indices[st.key] = idx
        with torch.no_grad():
            self.memory.update(st.segs, st.p, contribution)
            if self.velocity is not None and st.velocity is not None:
                kept = torch.zeros_like(st.velocity)
                if self.masking:
                    kept[idx] = st.velocity[idx]
                self.velocity.update(st.segs, st.velocity, kept)
            out = torch.zeros_like(st.p)
            out[idx] = summed / size if size > 1 else summed
            res = unflatten_into(out, st.grads)
        self.timings.compress_s += time.perf_counter() - t0
        return res

    @staticmethod
    def masked(p: Tensor, idx: Tensor) -> Tensor:
        """``p`` at ``idx``, zero elsewhere (a worker's contribution when it sends its exact values)."""
        out = torch.zeros_like(p)
        out[idx] = p[idx]
        return out

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "density": self.density,
            "k": self.k,
            "momentum": self.momentum,
            "masking": self.masking,
        }
        if self.warmup:
            out["warmup"] = "/".join(f"{d:g}" for d in self.warmup)
            out["warmup_steps"] = self.warmup_steps
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "memory": self.memory.state_dict(),
            "velocity": None if self.velocity is None else self.velocity.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, Mapping) or "memory" not in state:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: expects a dict with 'memory', got "
                f"{sorted(state) if isinstance(state, Mapping) else type(state).__name__}"
            )
        if (state.get("velocity") is None) != (self.velocity is None):
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: the checkpoint was taken with momentum "
                f"{'off' if state.get('velocity') is None else 'on'}, this reducer has it "
                f"{'off' if self.velocity is None else 'on'}"
            )
        self.memory.load_state_dict(state["memory"])
        if self.velocity is not None:
            self.velocity.load_state_dict(state["velocity"])

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"
