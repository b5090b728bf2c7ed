"""Parameters shared between modules (tied weights): an output layer that reads the input table's
weight (``m.dec.weight = m.emb.weight``, as most language models are built), or one module registered
at several paths.

``model.parameters()`` and ``model.named_parameters()`` list such a parameter once, under its first
name, and everything in lowband that counts, reduces or averages parameters goes through them (units,
layers, optimizers), so a tied parameter is counted, communicated and stepped once. What a tie does
break is replacing or cutting a module: a strategy that swaps a table for a partitioned one or
synchronises only the rows its lookups read would leave the other module on a stale copy or lose its
gradient. Such a strategy calls :func:`refuse_tied` on the tensors it takes over, before it changes
anything, and the user gets one error naming both modules and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lowband.errors import InvalidArgumentError


def tied_parameters(model: nn.Module) -> list[tuple[str, ...]]:
    """Every parameter of ``model`` registered under more than one name: its names in registration
    order (the first is the one ``named_parameters()`` reports), one tuple per parameter, in the
    order of their first names."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [tuple(ns) for ns in names.values() if len(ns) > 1]


def module_path(param_name: str) -> str:
    """The path of the module holding parameter ``param_name`` ("" for the model itself)."""
    return param_name.rpartition(".")[0]


def _module(path: str) -> str:
    return f"module {path!r}" if path else "the model itself"


def refuse_tied(model: nn.Module, params: Iterable[torch.Tensor], *, where: str, why: str, fix: str) -> None:
    """Raise :class:`InvalidArgumentError` when one of ``params`` (the tensors a strategy replaces or
    cuts) is shared by several modules of ``model`` (one module registered at several paths is not a
    tie: every read of its weight goes through it), naming the modules and parameter names, ``why``
    the strategy cannot keep it shared, and ``fix``. Local and deterministic: every rank holding the
    same model raises alike, before any communication."""
    taken = {id(p) for p in params}
    first = dict(model.named_parameters())
    for names in tied_parameters(model):
        if id(first[names[0]]) not in taken:
            continue
        mods = [module_path(n) for n in names]
        if len({id(model.get_submodule(x)) for x in mods}) == 1:
            continue  # one module registered at several paths: every read of the weight goes through it
        others = ", ".join(_module(x) for x in mods[1:])
        raise InvalidArgumentError(
            f"{where}: the weight of {_module(mods[0])} is shared with {others} (parameters "
            f"{', '.join(repr(n) for n in names)} are one tensor: tied weights); {why}; {fix}"
        )
