"""BlueFog's message for an op called before ``bf.init()``: lowband's own error names
``lowband.init()``, which a BlueFog program never calls; the public functions of the compat module are
wrapped so the error names ``bf.init()`` instead (same class, :class:`NotInitializedError`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, MutableMapping
from typing import Any

from lowband.errors import NotInitializedError

MOD = "lowband.compat.bluefog.torch"

#: functions that work (or say what to do) without a context
_EXEMPT = frozenset({"init", "shutdown"})


def needs_init(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` re-raising :class:`NotInitializedError` as one that tells the caller to call ``bf.init()``."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NotInitializedError as exc:
            raise NotInitializedError(
                f"{MOD}.{name}: BlueFog is not initialised on this process; call bf.init() first "
                f"(import lowband.compat.bluefog.torch as bf; bf.init())"
            ) from exc

    return call


def wrap_public(namespace: MutableMapping[str, Any], names: list[str]) -> None:
    """Replace every public function of ``namespace`` named in ``names`` by its :func:`needs_init` form."""
    for name in names:
        fn = namespace.get(name)
        # the topology builders need no context, and bf re-exports them as the same objects
        if name not in _EXEMPT and inspect.isfunction(fn) and not fn.__module__.endswith("topology_util"):
            namespace[name] = needs_init(name, fn)
