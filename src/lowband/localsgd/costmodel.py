"""DreamDDP's time cost model: per-layer costs and the event model of one local iteration (Eq. 7).

Layers are indexed in FORWARD order: ``profile.layers[0]`` is the paper's layer 1 (input side),
``profile.layers[L - 1]`` its layer L (output side). Backward runs L -> 1, i.e. index ``L - 1`` down to 0.

Event model of one local iteration that averages the layers of ``layer_set`` (times from its start):

- the forward pass takes ``sum(fwd)``; then backward runs layer by layer, index ``L - 1`` down to 0;
- a layer's averaging (allreduce of its parameters, ``comm`` seconds) starts at
  ``max(its backward end, end of the previous averaging)``; averagings run in backward order on one link;
- the iteration ends at ``max(backward end, last averaging end)``.

This is Eq. 7 of the paper with its ``tau`` recurrence, generalised to sets that are not intervals.
Eq. 8 (``objective_eq8``) is the paper's interval approximation: the set's averagings run back to
back from the backward end of its latest layer ``h0``, ignoring waits for later backward passes.

Interference (lowband's extension beyond Eq. 7). Eq. 7 assumes an averaging runs beside backward for
free (a GPU with its own NIC). Where computation and communication share CPU cores they slow each other
down; ``CostProfile.kappa`` and ``CostProfile.sigma`` (measured, >= 0) model it as a two-resource event
timeline of the backward pass and the link:

- while a backward layer AND an averaging are both in progress, backward progresses at rate
  ``1 / (1 + kappa)`` and the averaging at ``1 / (1 + sigma)`` (a layer's ``bwd`` and ``comm`` are its
  quiet work); when only one is in progress it runs at full speed;
- averagings still queue in backward order on one link (FIFO), each entering the queue at the end of its
  layer's (possibly slowed) backward; the forward pass never overlaps an averaging;
- the iteration ends at ``fwd_total + max(backward end, last averaging end)``.

Because the link's rate depends only on whether backward is running, the queue's total remaining work
is its whole state, and after the last averaging of a set enters the queue the rest of the iteration
has a closed form. With ``kappa == sigma == 0`` every function takes the plain Eq. 7 code path, so
results are bit-identical to the paper's model. ``objective_eq8`` stays the paper's formula (no
interference); ``flsgd_period_time`` has no overlap, hence no interference either.

Every function here is pure and deterministic; floating-point operations happen in one fixed order so
that equal inputs give bit-identical results whichever function computes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from lowband.errors import InvalidArgumentError


def _check_factor(where: str, what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{where}: {what} must be a number (a fractional slowdown), got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0.0:
        raise InvalidArgumentError(f"{where}: {what} must be finite and >= 0, got {value!r}")
    return v


def _check_time(where: str, what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{where}: {what} must be a number of seconds, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0.0:
        raise InvalidArgumentError(f"{where}: {what} must be finite and >= 0, got {value!r}")
    return v


@dataclass(frozen=True)
class LayerCost:
    """Costs of one parameter-owning layer: forward, backward, and averaging its parameters alone."""

    name: str
    fwd: float  # seconds
    bwd: float  # seconds
    comm: float  # seconds to allreduce this layer's parameters alone
    nbytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise InvalidArgumentError(f"LayerCost: name must be a str, got {self.name!r}")
        for what in ("fwd", "bwd", "comm"):
            object.__setattr__(
                self, what, _check_time(f"LayerCost({self.name!r})", what, getattr(self, what))
            )
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise InvalidArgumentError(
                f"LayerCost({self.name!r}): nbytes must be an int >= 0, got {self.nbytes!r}"
            )

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "fwd": self.fwd, "bwd": self.bwd, "comm": self.comm, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LayerCost:
        try:
            return cls(str(d["name"]), d["fwd"], d["bwd"], d["comm"], d.get("nbytes", 0))
        except (KeyError, TypeError) as e:
            raise InvalidArgumentError(f"LayerCost.from_json: bad layer entry {d!r} ({e!r})") from None


@dataclass(frozen=True)
class CostProfile:
    """Per-layer costs of a model, layers in FORWARD order (``layers[0]`` is the paper's layer 1).

    ``alpha``/``beta`` are the communication fit ``comm(bytes) = alpha + beta * bytes`` the per-layer
    ``comm`` values came from (0 when unknown). ``kappa``/``sigma`` are the measured interference
    (module doc): computation runs ``1 + kappa`` times slower while an averaging is in flight, an
    averaging ``1 + sigma`` times slower while computation runs (0: the paper's model)."""

    layers: tuple[LayerCost, ...]
    alpha: float = 0.0
    beta: float = 0.0
    kappa: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not layers:
            raise InvalidArgumentError("CostProfile: layers must hold at least one layer, got none")
        for i, lc in enumerate(layers):
            if not isinstance(lc, LayerCost):
                raise InvalidArgumentError(f"CostProfile: layers[{i}] must be a LayerCost, got {lc!r}")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "alpha", _check_time("CostProfile", "alpha", self.alpha))
        object.__setattr__(self, "beta", _check_time("CostProfile", "beta", self.beta))
        object.__setattr__(self, "kappa", _check_factor("CostProfile", "kappa", self.kappa))
        object.__setattr__(self, "sigma", _check_factor("CostProfile", "sigma", self.sigma))

    @property
    def interference(self) -> bool:
        """True when ``kappa`` or ``sigma`` is non-zero (the event model then simulates interference)."""
        return self.kappa > 0.0 or self.sigma > 0.0

    def with_interference(self, kappa: float, sigma: float) -> CostProfile:
        """This profile with interference parameters ``kappa`` and ``sigma`` (validated)."""
        return CostProfile(self.layers, self.alpha, self.beta, kappa, sigma)

    @property
    def L(self) -> int:
        """Number of layers."""
        return len(self.layers)

    @cached_property
    def fwd_total(self) -> float:
        """Forward time of one iteration (sum over layers, in forward order)."""
        t = 0.0
        for lc in self.layers:
            t += lc.fwd
        return t

    @cached_property
    def bwd_ends(self) -> tuple[float, ...]:
        """``bwd_ends[i]``: time from the start of backward to the end of layer ``i``'s backward."""
        ends = [0.0] * self.L
        t = 0.0
        for i in range(self.L - 1, -1, -1):
            t += self.layers[i].bwd
            ends[i] = t
        return tuple(ends)

    @property
    def bwd_total(self) -> float:
        """Backward time of one iteration."""
        return self.bwd_ends[0]

    @cached_property
    def bwd_below(self) -> tuple[float, ...]:
        """``bwd_below[i]``: backward time of the layers after ``i`` in backward (indices ``< i``).

        This is the paper's ``t_BP^{L_{h:H}} - t_BP^{h0}`` for ``h0 = i``: the computation left to hide
        communication that starts after layer ``i``'s backward."""
        below = [0.0] * self.L
        t = 0.0
        for i in range(self.L):
            below[i] = t
            t += self.layers[i].bwd
        return tuple(below)

    @property
    def comm_total(self) -> float:
        t = 0.0
        for i in range(self.L - 1, -1, -1):
            t += self.layers[i].comm
        return t

    def comm_for_bytes(self, nbytes: int) -> float:
        """Predicted time to average ``nbytes`` bytes in one message, from the fit ``alpha + beta * nbytes``."""
        return self.alpha + self.beta * nbytes

    @classmethod
    def from_lists(
        cls,
        fwd: Sequence[float],
        bwd: Sequence[float],
        comm: Sequence[float],
        *,
        names: Sequence[str] | None = None,
        nbytes: Sequence[int] | None = None,
    ) -> CostProfile:
        """A profile from per-layer lists in forward order (names default to ``layer{i}``)."""
        n = len(fwd)
        if len(bwd) != n or len(comm) != n or (names is not None and len(names) != n):
            raise InvalidArgumentError(
                f"CostProfile.from_lists: fwd, bwd, comm (and names) must have equal lengths, got "
                f"{len(fwd)}, {len(bwd)}, {len(comm)}" + ("" if names is None else f", {len(names)}")
            )
        if nbytes is not None and len(nbytes) != n:
            raise InvalidArgumentError(
                f"CostProfile.from_lists: nbytes has length {len(nbytes)}, expected {n}"
            )
        return cls(
            tuple(
                LayerCost(
                    names[i] if names is not None else f"layer{i}",
                    fwd[i],
                    bwd[i],
                    comm[i],
                    nbytes[i] if nbytes is not None else 0,
                )
                for i in range(n)
            )
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": [lc.to_json() for lc in self.layers],
            "alpha": self.alpha,
            "beta": self.beta,
            "kappa": self.kappa,
            "sigma": self.sigma,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CostProfile:
        if not isinstance(d, Mapping) or not isinstance(d.get("layers"), list):
            raise InvalidArgumentError(
                f"CostProfile.from_json: expected a dict with a 'layers' list, got {d!r}"
            )
        return cls(
            tuple(LayerCost.from_json(x) for x in d["layers"]),
            d.get("alpha", 0.0),
            d.get("beta", 0.0),
            d.get("kappa", 0.0),  # profiles saved before interference was measured: the paper's model
            d.get("sigma", 0.0),
        )


def check_layer_set(where: str, profile: CostProfile, layer_set: Iterable[int]) -> tuple[int, ...]:
    """``layer_set`` as a sorted tuple of distinct forward indices in ``range(profile.L)``, or an error."""
    out: set[int] = set()
    for i in layer_set:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < profile.L:
            raise InvalidArgumentError(
                f"{where}: layer index {i!r} out of range (the profile has {profile.L} layers, 0..{profile.L - 1})"
            )
        out.add(i)
    return tuple(sorted(out))


# ---------------------------------------------------------------- interference timeline (kappa, sigma)
#
# A timeline state ``(t, q, last)``: time ``t`` from the start of backward at the end of layer ``last``'s
# backward, just after its averaging entered the queue, and ``q`` the queue's remaining quiet work.


def start_state(profile: CostProfile, top: int) -> tuple[float, float, int]:
    """Timeline state when the first (latest) averaged layer ``top`` has finished its backward.

    No averaging is in flight before it, so backward has run at full speed up to ``bwd_ends[top]``."""
    return (profile.bwd_ends[top], profile.layers[top].comm, top)


def add_layer(profile: CostProfile, state: tuple[float, float, int], i: int) -> tuple[float, float, int]:
    """Advance the timeline through the backward of layers ``last - 1`` down to ``i`` (``i < last``), each
    slowed while the queue is busy, then queue layer ``i``'s averaging."""
    t, q, last = state
    k1 = 1.0 + profile.kappa
    s1 = 1.0 + profile.sigma
    for j in range(last - 1, i - 1, -1):
        w = profile.layers[j].bwd
        if q <= 0.0:
            t += w
        elif q * s1 >= w * k1:  # the link stays busy for the whole layer
            t += w * k1
            q = max(0.0, q - w * k1 / s1)
        else:  # the queue drains during the layer; the rest of it runs at full speed
            d = q * s1
            t += d + max(0.0, w - d / k1)
            q = 0.0
    return (t, q + profile.layers[i].comm, i)


def finish(profile: CostProfile, state: tuple[float, float, int]) -> tuple[float, float]:
    """``(backward end, last averaging end)`` from ``state`` when no further averaging is queued."""
    t, q, last = state
    b = profile.bwd_below[last]
    if q <= 0.0:
        return (t + b, t)
    if b <= 0.0:
        return (t, t + q)
    k1 = 1.0 + profile.kappa
    s1 = 1.0 + profile.sigma
    if q * s1 <= b * k1:  # the queue drains first
        d = q * s1
        return (t + d + max(0.0, b - d / k1), t + d)
    d = b * k1
    return (t + d, t + d + max(0.0, q - d / s1))


def _interfered(profile: CostProfile, idx: tuple[int, ...]) -> tuple[float, float]:
    """``(backward end, last averaging end)`` of a non-empty sorted set under interference."""
    state = start_state(profile, idx[-1])
    for i in reversed(idx[:-1]):
        state = add_layer(profile, state, i)
    return finish(profile, state)


def comm_end(profile: CostProfile, layer_set: Iterable[int]) -> float:
    """End of the last averaging of ``layer_set``, from the start of backward (``-inf`` when empty)."""
    idx = check_layer_set("comm_end", profile, layer_set)
    if profile.interference and idx:
        return _interfered(profile, idx)[1]
    ends = profile.bwd_ends
    end = -math.inf
    for i in reversed(idx):
        end = max(ends[i], end) + profile.layers[i].comm
    return end


def iteration_time(profile: CostProfile, layer_set: Iterable[int]) -> float:
    """Time of one local iteration that averages ``layer_set`` (forward indices), by the Eq. 7 event model
    (with interference when ``profile.kappa`` or ``profile.sigma`` is non-zero, see the module doc)."""
    if profile.interference:
        idx = check_layer_set("iteration_time", profile, layer_set)
        if idx:
            return profile.fwd_total + max(_interfered(profile, idx))
    return profile.fwd_total + max(profile.bwd_total, comm_end(profile, layer_set))


def _check_sets(where: str, sets: Sequence[Iterable[int]]) -> None:
    if isinstance(sets, (str, bytes)) or not isinstance(sets, Sequence) or len(sets) < 1:
        raise InvalidArgumentError(f"{where}: sets must be a non-empty sequence of layer sets, got {sets!r}")


def iteration_times(profile: CostProfile, sets: Sequence[Iterable[int]]) -> tuple[float, ...]:
    """``iteration_time`` of each local iteration of a period."""
    _check_sets("iteration_times", sets)
    return tuple(iteration_time(profile, s) for s in sets)


def period_time(profile: CostProfile, sets: Sequence[Iterable[int]]) -> float:
    """Time of one period of ``len(sets)`` local iterations (event model), summed in iteration order."""
    total = 0.0
    for t in iteration_times(profile, sets):
        total += t
    return total


def exposed_comm_time(profile: CostProfile, sets: Sequence[Iterable[int]]) -> float:
    """Communication time not hidden by computation in one period: ``period_time - H * (fwd + bwd)``."""
    return period_time(profile, sets) - len(sets) * (profile.fwd_total + profile.bwd_total)


def flsgd_period_time(profile: CostProfile, H: int) -> float:
    """Period time of classic FLSGD: H iterations, then all parameters averaged with no overlap."""
    if isinstance(H, bool) or not isinstance(H, int) or H < 1:
        raise InvalidArgumentError(f"flsgd_period_time: H must be an int >= 1, got {H!r}")
    return H * (profile.fwd_total + profile.bwd_total) + profile.comm_total


def eq8_set_cost(profile: CostProfile, layer_set: Iterable[int]) -> float:
    """One term of Eq. 8: ``bwd up to h0 + max(bwd left after h0, sum of comm)``; ``bwd_total`` if empty.

    ``h0`` is the set's latest layer (first in backward). For interval sets the first two terms are the
    paper's ``t_BP^{L_{1:h-1}} + t_BP^{h0}``."""
    idx = check_layer_set("objective_eq8", profile, layer_set)
    if not idx:
        return profile.bwd_total
    h0 = idx[-1]
    s = 0.0
    for i in reversed(idx):
        s += profile.layers[i].comm
    return profile.bwd_ends[h0] + max(profile.bwd_below[h0], s)


def objective_eq8(profile: CostProfile, sets: Sequence[Iterable[int]]) -> float:
    """The paper's Eq. 8 objective ``P_H^L`` (no forward term: add ``H * fwd_total`` to compare with
    ``period_time``, which it never exceeds then)."""
    _check_sets("objective_eq8", sets)
    total = 0.0
    for s in sets:
        total += eq8_set_cost(profile, s)
    return total
