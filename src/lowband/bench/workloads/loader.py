"""A user's workload named by a spec: ``package.module:factory`` or ``path/to/file.py:factory``.

``factory`` (a function, a class, or a :class:`~lowband.bench.workloads.base.Workload` instance; dotted
attributes are followed) is called with the workload's options and must give a ``Workload``. A module is
imported as Python would (the current directory is searched too, as ``python -m`` does); a file is
loaded by its path. :func:`canonical_spec` makes a file's path absolute, so that the rank processes,
which load the workload again by the same spec, find it whatever their working directory.

Every failure (no such module or file, an error inside the module, a missing attribute, a factory that
does not return a ``Workload``) is one :class:`~lowband.errors.InvalidArgumentError` line naming the spec.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from lowband.bench.workloads.base import Workload
from lowband.errors import InvalidArgumentError


def is_spec(name: str) -> bool:
    """Whether ``name`` names a user's workload (``module:factory`` or ``file.py:factory``), not a
    registered one."""
    return ":" in name


def _split(spec: str) -> tuple[str, str]:
    target, _, attr = spec.rpartition(":")
    if not target or not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise InvalidArgumentError(
            f"workload {spec!r}: expected module:factory or path/to/file.py:factory "
            "(e.g. mypkg.mymodule:make_workload)"
        )
    return target, attr


def _is_file(target: str) -> bool:
    return target.endswith(".py") or os.sep in target or "/" in target


def canonical_spec(spec: str) -> str:
    """``spec`` with a file's path made absolute (a module spec is returned as is); checked to parse."""
    target, attr = _split(spec)
    if not _is_file(target):
        return spec
    return f"{Path(target).expanduser().resolve()}:{attr}"


def _import_file(spec: str, target: str) -> ModuleType:
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise InvalidArgumentError(f"workload {spec!r}: no such file {str(path)!r}")
    name = f"lowband_user_workload_{path.stem}_{abs(hash(str(path))):x}"
    if name in sys.modules:
        return sys.modules[name]
    mspec = importlib.util.spec_from_file_location(name, path)
    if mspec is None or mspec.loader is None:
        raise InvalidArgumentError(f"workload {spec!r}: {str(path)!r} cannot be loaded as Python")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        mspec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise InvalidArgumentError(
            f"workload {spec!r}: loading {str(path)!r} failed: {type(e).__name__}: {e}"
        ) from e
    return module


def _import_module(spec: str, target: str) -> ModuleType:
    cwd = os.getcwd()
    try:
        try:
            return importlib.import_module(target)
        except ModuleNotFoundError as e:
            top = target.split(".")[0]
            if e.name != top or cwd in sys.path or "" in sys.path:
                raise
            sys.path.append(cwd)  # as `python -m` would find it (the `lowband` script does not)
            return importlib.import_module(target)
    except ModuleNotFoundError as e:
        raise InvalidArgumentError(
            f"workload {spec!r}: cannot import {target!r}: {e} (is it installed, or in {cwd}?)"
        ) from e
    except Exception as e:
        raise InvalidArgumentError(
            f"workload {spec!r}: importing {target!r} failed: {type(e).__name__}: {e}"
        ) from e


def load_workload(spec: str, **options: Any) -> Workload:
    """The :class:`Workload` that ``spec``'s factory returns when called with ``options``."""
    target, attr = _split(spec)
    module = _import_file(spec, target) if _is_file(target) else _import_module(spec, target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InvalidArgumentError(f"workload {spec!r}: {target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, Workload):
        if options:
            raise InvalidArgumentError(
                f"workload {spec!r}: {attr} is a Workload instance, it takes no options"
            )
        wl = obj
    elif callable(obj):
        try:
            wl = obj(**options)
        except Exception as e:
            raise InvalidArgumentError(
                f"workload {spec!r}: {attr}({', '.join(options)}) failed: {type(e).__name__}: {e}"
            ) from e
    else:
        raise InvalidArgumentError(f"workload {spec!r}: {attr} is a {type(obj).__name__}, not a factory")
    if not isinstance(wl, Workload):
        raise InvalidArgumentError(
            f"workload {spec!r}: {attr}() returned a {type(wl).__name__}, not a "
            "lowband.bench.workloads.Workload (subclass it: build_model, batches, loss)"
        )
    if wl.name == Workload.name:
        wl.name = Path(target).stem if _is_file(target) else target.rpartition(".")[2]
    return wl
