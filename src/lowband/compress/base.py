"""What a compressor is: a pure map from a flat gradient to a :class:`Payload` (the tensors put on the
wire, with their exact size) and back.

A :class:`Compressor` never talks to other ranks; transports (:mod:`lowband.compress.reducer`) move
payloads and decide how the ranks' payloads combine, and error feedback lives in
:mod:`lowband.compress.memory`. Every compressor works on one flat 1-D floating-point tensor (the
gradients of one unit of the gradient stage, concatenated) and returns its decode as a new flat tensor of
the same length and dtype.

Randomness. A compressor that draws random numbers takes them from :meth:`CompressContext.generator`:
``shared=True`` gives the same stream on every rank (random-k's coordinates: nothing but values goes on
the wire), ``shared=False`` one stream per rank (stochastic rounding: independent across ranks). Both
are seeded from ``(seed, step, unit name)``, so a run replays exactly and a resumed run continues the
same streams.

Registry. Compressors are registered by name with keyword-only, typed options; a spec
``"topk:ratio=0.01"`` builds one (:func:`make_compressor`). An unknown name or option, or an option of
the wrong type, is one clear error.
"""

from __future__ import annotations

import abc
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowband.compress.finite import check_finite
from lowband.errors import InvalidArgumentError
from lowband.options import Options
from lowband.registry import Registry
from lowband.registry import parse_spec as registry_parse_spec

Tensor = torch.Tensor


@dataclass(frozen=True)
class Payload:
    """One rank's compressed unit: ``data`` is what goes on the wire (1-D contiguous tensors of any
    dtype, possibly empty); ``numel`` and ``dtype`` describe the flat tensor it encodes (the same on
    every rank, never sent)."""

    data: tuple[Tensor, ...]
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """The exact number of bytes of ``data`` (the wire size, headers of a transport aside)."""
        return sum(t.numel() * t.element_size() for t in self.data)


@dataclass(frozen=True)
class CompressContext:
    """What a compressor is told besides the tensor: the unit's name (its key in the gradient stage),
    the step (the same on every rank), this rank's index in the group, and the user's seed."""

    name: str
    step: int
    rank: int = 0
    seed: int = 0

    def generator(self, *, shared: bool, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded from ``(seed, step, name)`` (and the rank unless ``shared``)."""
        key = f"{self.seed}/{self.step}/{self.name}" + ("" if shared else f"/rank{self.rank}")
        g = torch.Generator(device=device)
        g.manual_seed(zlib.crc32(key.encode()) | (self.seed & 0xFFFFFFFF) << 32)
        return g


class Compressor(abc.ABC):
    """A pure compressor; see the module docstring.

    Class attributes tell transports what they may do with its payloads:

    - ``summable``: payloads of different ranks for the same unit and step (contexts differing only in
      ``rank``) may be summed tensor by tensor on the wire and
      ``decompress(sum of payloads) == sum of decompress(payload)`` (casts; random-k, whose coordinates
      come from the shared stream): an allreduce transports them;
    - ``fixed_size``: the payload's tensor sizes depend on ``numel`` alone (so every rank's sizes are
      known without an exchange); data-dependent sizes (a threshold selection) need an allgather-v.
    """

    name: ClassVar[str] = "compressor"
    summable: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True

    @abc.abstractmethod
    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        """Encode the flat tensor ``x`` (1-D, floating point, finite); never modifies ``x``."""

    @abc.abstractmethod
    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        """Decode ``payload`` into a new flat tensor of ``payload.numel`` elements of ``payload.dtype``."""

    def options(self) -> dict[str, Any]:
        """The compressor's options (for reports and ``repr``)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """State needed to resume (none for a pure compressor)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: this compressor holds no state, got keys {sorted(state)}"
            )

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


def check_input(c: Compressor, x: object, ctx: CompressContext) -> Tensor:
    """The argument check every compressor runs first: a 1-D floating-point tensor of finite values.

    Finiteness is checked at once for a CPU tensor; on an accelerator it is checked without a host
    synchronisation and reported when the device's flag has landed (typically one reduction later);
    ``LOWBAND_CHECK_FINITE=sync|off`` changes that (:mod:`lowband.compress.finite`)."""
    where = f"lowband compressor {c.name!r} on unit {ctx.name!r} (rank {ctx.rank}) at step {ctx.step}"
    if not isinstance(x, Tensor):
        raise InvalidArgumentError(f"{where}: expected a tensor, got {type(x).__name__}")
    if x.dim() != 1 or not x.is_floating_point():
        raise InvalidArgumentError(
            f"{where}: expected a flat (1-D) floating-point tensor, got shape {tuple(x.shape)} dtype {x.dtype}"
        )
    if x.numel():
        check_finite(where, x)
    return x


CompressorFactory = Callable[..., Compressor]

#: every compressor: ``factory(**options) -> Compressor``
COMPRESSORS: Registry[CompressorFactory] = Registry("compressor")


def register_compressor(
    name: str, description: str, options: Options | None = None
) -> Callable[[CompressorFactory], CompressorFactory]:
    """Class/function decorator; ``options`` declares the factory's keyword-only parameters, the
    compressor's options (:mod:`lowband.options`)."""
    return COMPRESSORS.registering(name, description, options)


def parse_spec(spec: str, what: str = "compressor") -> tuple[str, dict[str, Any]]:
    """``"topk:ratio=0.01,seed=3"`` -> ``("topk", {"ratio": 0.01, "seed": 3})`` (int, float, bool or str);
    ``;`` may separate options too (``"qsgd:levels=16;bucket=512"``, for a spec nested in another)."""
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidArgumentError(f"{what} spec must be a non-empty str, got {spec!r}")
    return registry_parse_spec(spec, what, semicolons=True)


def make_compressor(spec: str | Compressor, **options: Any) -> Compressor:
    """A compressor from a spec (``"onebit:threshold=0.5"``) and extra ``options``; a Compressor is
    returned as is (then ``options`` must be empty)."""
    if isinstance(spec, Compressor):
        if options:
            raise InvalidArgumentError(
                f"make_compressor: options {sorted(options)} given with a built {spec!r}"
            )
        return spec
    name, opts = parse_spec(spec)
    opts.update(options)
    factory = COMPRESSORS.get(name, "make_compressor")
    return factory(**COMPRESSORS.check_options(name, opts, f"compressor {name!r}"))
