"""A compressed reducer from user-facing specs, checked whole before anything communicates: the one
builder behind the ``compressed`` strategy, :class:`~lowband.compress.optimizer.CompressedOptimizer`
and :func:`~lowband.compress.hooks.ddp_hook`.

- ``compressor``: a spec (``"topk:ratio=0.01"``, options also separated by ``;`` when nested in another
  spec) or a built :class:`~lowband.compress.base.Compressor`;
- ``reducer``: a transport spec (``"ps"``, ``"twostage:..."``) or ``"auto"``: the allreduce transport
  when the compressor's payloads sum on the wire (the casts: one ring allreduce, bandwidth-optimal),
  else the allgather transport (it carries any payload: fixed or data-dependent sizes, empty ones);
- ``memory``: a memory spec, ``"residual"`` (error feedback, the default) or ``"none"`` (and those a
  compressor brings, e.g. DGC's), checked by the transport's constructor;
- ``seed``: seeds random compressors (with the step and the unit's name).
"""

from __future__ import annotations

from typing import Any

from lowband.compress.base import COMPRESSORS, Compressor, make_compressor
from lowband.compress.memory import MEMORIES, NoMemory
from lowband.compress.reducer import TRANSPORTS, CompressedReducer
from lowband.errors import InvalidArgumentError
from lowband.options import Opt, Options

#: the options of a compressed reducer built from specs, shared by every strategy that builds one (the
#: ``compressed`` and ``slimgc`` strategies: defaults their own) and by :func:`build_reducer`
REDUCER_OPTIONS = Options(
    {
        "compressor": Opt(
            str, spec=COMPRESSORS, objects=(Compressor,),
            doc="the compressor and its options (';' between nested options)",
        ),
        "reducer": Opt(
            str, words=("auto",), spec=TRANSPORTS,
            doc="the transport (auto: allreduce for formats that sum on the wire, else allgather)",
        ),
        "memory": Opt(str, spec=MEMORIES, doc="error feedback: residual, none, dgc (with their options)"),
        "seed": Opt(int, doc="seeds random compressors (with the step and the unit's name)"),
    }
)  # fmt: skip


def resolve_transport(reducer: str, compressor: Compressor) -> tuple[str, dict[str, Any]]:
    """``(transport name, options)`` for the reducer spec ``reducer`` carrying ``compressor``."""
    if reducer == "auto":
        return ("allreduce" if compressor.summable else "allgather"), {}
    return TRANSPORTS.check_spec(reducer)


def build_reducer(
    compressor: str | Compressor = "identity",
    reducer: str = "auto",
    memory: str = "residual",
    *,
    seed: int = 0,
    where: str = "compressed reducer",
) -> CompressedReducer:
    """The :class:`CompressedReducer` the specs describe (module docstring); every name, option and
    value is checked here (:data:`REDUCER_OPTIONS`, nested specs included), and any error is one
    :class:`InvalidArgumentError` prefixed by ``where``."""
    given = {"compressor": compressor, "reducer": reducer, "memory": memory, "seed": seed}
    got = REDUCER_OPTIONS.check(where, given)
    compressor, reducer, memory, seed = (got[k] for k in ("compressor", "reducer", "memory", "seed"))
    try:
        comp = make_compressor(compressor)
        name, options = resolve_transport(reducer, comp)
        return TRANSPORTS.get(name)(comp, memory, seed=seed, **options)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where}: {exc}") from exc
    except TypeError as exc:  # a transport's constructor refusing its arguments
        raise InvalidArgumentError(f"{where}: {exc}") from exc


def describe_reducer(red: CompressedReducer) -> dict[str, Any]:
    """The reducer's compressor (name and options), transport and memory, for reports (JSON-able)."""
    mem = getattr(red.memory, "kind", None) or ("none" if isinstance(red.memory, NoMemory) else None)
    return {
        "compressor": red.compressor.name,
        "compressor_options": {k: _plain(v) for k, v in red.compressor.options().items()},
        "transport": red.transport,
        "memory": str(mem or type(red.memory).__name__),
    }


def _plain(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else repr(v)
