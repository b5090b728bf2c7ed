"""Work in flight per layer, waited just before a forward uses the layer.

Optimizers that communicate a layer's parameters in the background (local SGD's partial averaging,
ATC/AWC combinations) keep one pending operation per layer (or per unit of a layer) and must wait
for it before anything reads those parameters: the next forward through a module holding them, the
layer's optimizer step, a checkpoint. :class:`PendingWork` is that table; :func:`forward_pre_hooks`
registers the forward pre-hooks, one per module holding parameters, with the layers each one uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from torch import nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from lowband.comm.handle import Handle

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

Layers = Sequence[tuple[str, Sequence[nn.Parameter]]]


class Waitable(Protocol[T_co]):
    """Anything with a bounded ``wait()`` returning a result (a :class:`lowband.Handle`)."""

    def wait(self) -> T_co: ...


@dataclass(frozen=True)
class Survival:
    """How waiting for work in flight survives a lost peer (``on_peer_loss="continue"``): ``wait(handle)``
    waits for an operation (polling: beating, watching whether another member noticed a loss);
    ``lost(error, key, launched)`` is told of a failed one (the strategy notices the loss and breaks its
    group); ``drain_s`` bounds the wait for the failed op to end before its buffers are reused. Used by
    local SGD's partial averaging (:class:`lowband.localsgd.runtime.LayerAverager`) and the decentralized
    combinations (:class:`lowband.decentral.optim_base.DecentralizedOptimizer`)."""

    wait: Callable[[Handle[Any]], Any]
    lost: Callable[[BaseException, int, float], None]
    drain_s: float


class PendingWork(Generic[T]):
    """At most one operation in flight per key (a layer or unit index), in launch order.

    ``finish(key, result)`` runs when a key's operation has been waited for (writing a combined value
    back into the parameters, say). Waiting for a key with nothing in flight does nothing.
    """

    def __init__(self, finish: Callable[[int, T], None] | None = None) -> None:
        self._works: dict[int, Waitable[T]] = {}
        self._finish = finish

    def add(self, key: int, work: Waitable[T]) -> None:
        """Record ``work`` for ``key``, after waiting for the one already in flight there, if any."""
        self.wait(key)
        self._works[key] = work

    def __setitem__(self, key: int, work: Waitable[T]) -> None:
        self.add(key, work)

    def wait(self, key: int) -> None:
        """Wait for ``key``'s operation (if any) and finish it."""
        work = self._works.pop(key, None)
        if work is not None:
            result = work.wait()
            if self._finish is not None:
                self._finish(key, result)

    def wait_keys(self, keys: Sequence[int]) -> None:
        for k in keys:
            self.wait(k)

    def wait_all(self, *, in_key_order: bool = False) -> None:
        """Wait for everything in flight, in launch order (or ascending keys)."""
        self.wait_keys(sorted(self._works) if in_key_order else list(self._works))

    def pop(self, key: int) -> Waitable[T]:
        """Take ``key``'s operation out without waiting (the caller waits)."""
        return self._works.pop(key)

    def keys(self) -> list[int]:
        return list(self._works)

    def __contains__(self, key: object) -> bool:
        return key in self._works

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._works))

    def __len__(self) -> int:
        return len(self._works)


def module_layers(model: nn.Module, layers: Layers) -> list[tuple[nn.Module, list[int]]]:
    """Every module holding parameters directly, with the layers that own them (a module reusing a
    tied parameter also lists the layer owning it), in registration order."""
    owner = {id(p): i for i, (_, ps) in enumerate(layers) for p in ps}
    out: list[tuple[nn.Module, list[int]]] = []
    for _, mod in model.named_modules():
        idx = sorted({owner[id(p)] for p in mod.parameters(recurse=False) if id(p) in owner})
        if idx:
            out.append((mod, idx))
    return out


def forward_pre_hooks(
    model: nn.Module, layers: Layers, fn: Callable[[list[int]], None]
) -> list[RemovableHandle]:
    """Call ``fn(layer indices)`` before the forward of every module holding parameters of ``layers``;
    returns the hooks' handles (``remove()`` them to detach)."""

    def hook_for(idx: list[int]) -> Callable[[nn.Module, Any], None]:
        def hook(_m: nn.Module, _args: Any) -> None:
            fn(idx)

        return hook

    return [mod.register_forward_pre_hook(hook_for(idx)) for mod, idx in module_layers(model, layers)]
