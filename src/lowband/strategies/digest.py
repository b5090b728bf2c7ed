"""One configuration agreement: every rank of a strategy holds the same configuration, checked when the
strategy is built and again when a checkpoint is loaded, so that no option mismatch reaches gloo (where
a size mismatch aborts the process) or trains replicas apart silently.

A configuration is a flat, ordered ``{field: readable value}`` of strings (:func:`strategy_config`):
the strategy's name, every option of its factory with the defaults filled in (nested compressor,
transport and memory specs canonical: ``"qsgd"`` and ``"qsgd:bucket=512;levels=7"`` are the same
configuration), the model's tied parameters and each parameter's shape and dtype (sharded ones by
their global shape). :func:`agree_values` agrees a vector of per-field hashes with
:func:`lowband.comm.agree` (one store meeting); only on a mismatch do the ranks exchange their readable
values on the group's control process group (two bounded allgathers), so that every rank raises the
same :class:`CollectiveMismatchError` naming each differing field and each rank's value.

Checkpoints (:func:`checkpoint_config`, :func:`check_checkpoint`): a strategy built by
:func:`~lowband.strategies.make_strategy` saves its options in ``state_dict()["config"]``. Loading
agrees across ranks on what each rank loads (steps, the world size it was taken at, its options: one
save of one run), refuses, before anything is loaded, a checkpoint with per-rank state of another world
size (``extra["world_size"]``: re-shard it first where
:func:`~lowband.strategies.compressed_state.reshard_checkpoints` can); any other checkpoint taken at
another size (``state_dict()["world_size"]``, not sharded) loads only where every rank loads the same
content (a hash of it agreed: a replicated state), and is refused on every rank otherwise; then refuses a checkpoint whose
options differ from this strategy's (what the state
means: density, sketch size, compressor, ...), except the options in :data:`STATELESS_OPTIONS` (bucket
sizes regroup the same state).
"""

from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lowband.comm.agree import agree, crc
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.group import Group
from lowband.nn.sharding import shard_specs
from lowband.nn.tied import tied_parameters

#: options that do not change what the saved state means (bucket sizes regroup the same state; the
#: non-finite policy keeps none): a checkpoint loads across them
STATELESS_OPTIONS = frozenset(
    {"bucket_mb", "first_bucket_mb", "bucket_cap_mb", "fuse_mb", "chunk_mb", "on_nonfinite", "accumulate",
     "on_peer_loss", "min_ranks", "peer_settle", "heartbeat"}
)  # fmt: skip
_SHOWN, _WIDTH = 4, 160
_NO_DEFAULT = inspect.Parameter.empty


def option_field(name: str) -> str:
    """The configuration field of strategy option ``name``."""
    return f"option {name!r}"


def canonical(value: object, default: object = _NO_DEFAULT) -> str:
    """A readable value that is equal on two ranks exactly when the values mean the same: an int given
    for a float option counts as that float; containers element-wise; objects by their ``repr`` (by
    their type where that ``repr`` holds an address)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int) and isinstance(default, float):
        return repr(float(value))
    if isinstance(value, (int, float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(canonical(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {canonical(value[k])}" for k in sorted(value, key=str)) + "}"
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


def _keyword_defaults(factory: Callable[..., Any]) -> dict[str, Any]:
    params = inspect.signature(factory).parameters.values()
    return {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY}


def _spec_registries() -> dict[str, Any]:
    """Strategy options whose values are specs of a registry (checked by name there)."""
    from lowband.compress.base import COMPRESSORS
    from lowband.compress.memory import MEMORIES
    from lowband.compress.reducer import TRANSPORTS

    return {"compressor": COMPRESSORS, "reducer": TRANSPORTS, "memory": MEMORIES}


def canonical_spec(spec: str, registry: Any) -> str:
    """``"name:opt=v;opt=v"`` with every option of the registered item, defaults filled in, sorted;
    a name the registry does not know is kept as written (its factory reports it)."""
    from lowband.registry import parse_spec

    try:
        name, options = parse_spec(spec, registry.kind, semicolons=True)
    except InvalidArgumentError:
        return repr(spec)
    if name not in registry:
        return repr(spec)
    defaults = _keyword_defaults(registry.get(name))
    merged = {**defaults, **options}
    opts = ";".join(f"{k}={canonical(merged[k], defaults.get(k, _NO_DEFAULT))}" for k in sorted(merged))
    return f"{name}:{opts}" if opts else name


def model_layout(model: nn.Module) -> dict[str, str]:
    """The model's parameter layout as configuration fields: which parameters are one tensor (tied),
    then each parameter's shape and dtype (a sharded one's global shape and cut)."""
    sharded = shard_specs(model)
    params: dict[str, str] = {}
    for n, p in model.named_parameters():  # a tied parameter once, under its first name
        spec = sharded.get(n)
        shape = tuple(p.shape) if spec is None else tuple(spec.global_shape)
        cut = "" if spec is None else f" sharded along dim {spec.dim}"
        params[f"parameter {n!r}"] = f"{shape} {p.dtype}{cut}"
    tied = "; ".join(sorted(" = ".join(sorted(names)) for names in tied_parameters(model)))
    return {"tied parameters": tied or "none", **params}


def strategy_config(
    name: str, factory: Callable[..., Any] | None, options: Mapping[str, Any], model: nn.Module
) -> dict[str, str]:
    """The configuration of strategy ``name`` built by ``factory`` with ``options`` on ``model``
    (module docstring); pure. ``factory`` None (an unknown name): the options as given."""
    defaults = _keyword_defaults(factory) if factory is not None else {}
    merged = {**defaults, **options}
    specs = _spec_registries()
    out = {"strategy": repr(name)}
    for k in sorted(merged):
        v, d = merged[k], defaults.get(k, _NO_DEFAULT)
        out[option_field(k)] = (
            canonical_spec(v, specs[k]) if k in specs and isinstance(v, str) else canonical(v, d)
        )
    out.update(model_layout(model))
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def describe_differences(tables: list[dict[str, str]], ranks: list[int]) -> str:
    """Each field whose value differs between the ranks' tables, with each value and its ranks."""
    keys = list(dict.fromkeys(k for t in tables for k in t))
    parts = []
    for k in keys:
        vals = [t.get(k, "missing") for t in tables]
        if len(set(vals)) == 1:
            continue
        by: dict[str, list[int]] = {}
        for r, v in zip(ranks, vals):
            by.setdefault(v, []).append(r)
        shown = [f"{v if len(v) <= _WIDTH else v[:_WIDTH] + '...'} on {_ranks(rs)}" for v, rs in by.items()]
        parts.append(f"{k} is " + " but ".join(shown))
    more = f" (and {len(parts) - _SHOWN} more)" if len(parts) > _SHOWN else ""
    return "; ".join(parts[:_SHOWN]) + more


def exchange_text(g: Group, text: str, where: str, timeout: float) -> list[str]:
    """Every rank's ``text`` of group ``g`` (collective, on its control process group: two allgathers,
    each bounded by ``timeout`` seconds)."""
    data = text.encode()
    wait = datetime.timedelta(seconds=timeout)
    try:
        sizes = torch.empty(g.size, dtype=torch.int64, device="cpu")
        g.control_pg._allgather_base(sizes, torch.tensor([len(data)], dtype=torch.int64, device="cpu")).wait(
            wait
        )
        width = max(1, int(sizes.max()))
        mine = torch.zeros(width, dtype=torch.uint8, device="cpu")
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(g.size * width, dtype=torch.uint8, device="cpu")
        g.control_pg._allgather_base(out, mine).wait(wait)
    except RuntimeError as exc:
        from lowband.comm.handle import comm_error

        raise comm_error(f"{where} (exchanging the differing values)", exc, timeout) from exc
    rows = out.view(g.size, width)
    return [bytes(rows[r, : int(sizes[r])].tolist()).decode() for r in range(g.size)]


def agree_values(group: Group, what: str, values: Mapping[str, str], *, where: str, fix: str) -> None:
    """Raise :class:`CollectiveMismatchError` on every rank of ``group`` unless every rank holds equal
    ``values`` (collective; module docstring). The error names each differing field, each rank's value,
    and ``fix``."""
    from lowband.runtime import world_group

    ctx, g = world_group(group, where)
    if g.size == 1:
        return
    keys = list(values)
    try:
        agree(g, what, [crc((k, values[k])) for k in keys], fields=keys, where=where)
        return
    except CollectiveMismatchError as exc:
        if " differ from rank " not in str(exc):  # another rank is not in this agreement: nothing to ask
            raise
    texts = exchange_text(g, json.dumps(dict(values)), where, ctx.config.timeout)
    detail = describe_differences([json.loads(t) for t in texts], list(g.ranks))
    raise CollectiveMismatchError(f"{where}: the ranks' {what} differ: {detail}; {fix}")


def checkpoint_config(config: Mapping[str, str] | None) -> dict[str, str] | None:
    """What a checkpoint carries of a strategy's configuration: its name and options."""
    if config is None:
        return None
    return {k: v for k, v in config.items() if k == "strategy" or k.startswith("option ")}


def check_checkpoint(strategy: Any, state: Mapping[str, Any]) -> None:
    """Before ``strategy`` (built with ``agreed_config``) loads ``state`` on every rank: the ranks agree
    on what they load, then options that change what the state means are compared (module docstring)."""
    g: Group = strategy.group
    where = f"{type(strategy).__name__}.load_state_dict on rank {g.rank}"
    saved = state.get("config")
    extra = state.get("extra")
    resplit = extra.get("world_size") if isinstance(extra, Mapping) else None  # re-shardable state
    taken_at = resplit if resplit is not None else state.get("world_size")
    clock = getattr(strategy, "checkpoint_clock", None)  # what equal saves share (default: the steps)
    values = {
        "steps": repr(state.get("steps") if clock is None else clock(state)),
        "the world size it was taken at": repr(taken_at),
    }
    if isinstance(saved, Mapping):
        values.update({str(k): str(v) for k, v in saved.items()})
    agree_values(
        g, "checkpoints being loaded", values, where=where,
        fix="every rank loads its own checkpoint of the same save (same run, same step)",
    )  # fmt: skip
    if isinstance(taken_at, int) and taken_at != g.size and resplit is None:
        if "sharding" not in state:  # sharded state: its layout says what this rank can load
            _check_replicated(g, state, taken_at, where)
    elif isinstance(taken_at, int) and taken_at != g.size:  # refused before anything is loaded
        from lowband.strategies.compressed_state import RESHARDABLE

        fix = (
            f"re-shard every rank's checkpoint first: lowband.strategies.reshard_checkpoints(every rank's "
            f"checkpoint, {g.size}) (residuals keep their sum over ranks)"
            if state.get("strategy") in RESHARDABLE
            else f"its per-rank state does not re-shard: resume at {taken_at} ranks"
        )
        raise InvalidArgumentError(
            f"{where}: the checkpoint was taken at {taken_at} ranks, this group has {g.size}; {fix}"
        )
    mine = checkpoint_config(getattr(strategy, "agreed_config", None))
    if mine is None or not isinstance(saved, Mapping):
        return
    free = {option_field(k) for k in STATELESS_OPTIONS}
    # an option left unset now (None: decided at run time, e.g. DreamDDP's period, profile and schedule)
    # takes the value the checkpoint restores
    diffs = [
        k
        for k in dict.fromkeys([*saved, *mine])
        if k not in free and mine.get(k) != "None" and saved.get(k) != mine.get(k)
    ]
    if diffs:
        shown = "; ".join(
            f"{k} was {saved.get(k, 'missing')} when saved, is {mine.get(k, 'missing')} now"
            for k in diffs[:_SHOWN]
        )
        raise InvalidArgumentError(
            f"{where}: the checkpoint's state means something else under this strategy's options: {shown}; "
            "build the strategy with the options it was saved with to resume it"
        )


def content_crc(value: object) -> int:
    """A 31-bit hash of a state's content: every tensor's dtype, shape and bytes, every other value's
    ``repr``, mappings by key in any order (equal on two ranks iff, up to collisions, they hold the same
    state: an optimizer's state filled in another order is the same state)."""
    h = 0

    def walk(v: object) -> None:
        nonlocal h
        if isinstance(v, torch.Tensor):
            t = v.detach().to_dense() if v.is_sparse else v.detach()
            h = zlib.crc32(f"T{t.dtype}{tuple(t.shape)}".encode(), h)
            h = zlib.crc32(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), h)
        elif isinstance(v, Mapping):
            h = zlib.crc32(f"M{len(v)}".encode(), h)
            for k, x in sorted(v.items(), key=lambda kv: repr(kv[0])):  # in any insertion order
                h = zlib.crc32(repr(k).encode(), h)
                walk(x)
        elif isinstance(v, (list, tuple)):
            h = zlib.crc32(f"L{len(v)}".encode(), h)
            for x in v:
                walk(x)
        else:
            h = zlib.crc32(repr(v).encode(), h)

    walk(value)
    return h & 0x7FFFFFFF


def identical_on_every_rank(g: Group, tensors: Sequence[torch.Tensor], where: str) -> bool:
    """Collective on ``g``'s control process group: whether every rank holds the same ``tensors`` (dtype,
    shape and bytes; a 62-bit hash of them compared: two small values travel, not the tensors; a
    collision is a chance in 4e18)."""
    from lowband.comm.control import control_allreduce
    from lowband.runtime import current

    if g.size == 1:
        return True
    hasher = hashlib.blake2b(digest_size=8)
    for t in tensors:
        hasher.update(f"{t.dtype}{tuple(t.shape)}".encode())
        hasher.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    h = int.from_bytes(hasher.digest(), "little") >> 2
    pair = torch.tensor([h, -h], dtype=torch.int64)
    both = control_allreduce(g, pair, "max", current(where).config.timeout, where)
    return int(both[0]) == -int(both[1])  # the largest hash is the smallest


def _check_replicated(g: Group, state: Mapping[str, Any], taken_at: int, where: str) -> None:
    """A checkpoint of ``taken_at`` ranks loads at this group's size only where it holds no per-rank
    state: every rank loads the same content (a replica: DDP's model and optimizer, a local-SGD run saved
    right after an averaging with no momenta). Else every rank refuses it (rank r of the old run's
    replica, momenta or residuals are not this run's rank r's)."""
    try:
        agree(g, "checkpoint contents", [content_crc(state)], fields=["content"], where=where)
    except CollectiveMismatchError as exc:
        if " differ from rank " not in str(exc):  # another rank is not in this agreement
            raise
        raise InvalidArgumentError(
            f"{where}: the checkpoint was taken at {taken_at} ranks, this group has {g.size}, and the ranks "
            "load different states (per-rank state: replicas, momenta, residuals, which do not re-split); "
            f"resume at {taken_at} ranks, or load the averaged model (average_state_dict) into a fresh run"
        ) from None
