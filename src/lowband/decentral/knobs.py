"""Knobs: public attributes of the optimizer wrappers that are validated (and normalised) each time they
are set, so a bad value fails where it is set, naming the attribute, the rank and the value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar, overload

from lowband.decentral.combine import CommunicationType
from lowband.decentral.peers import check_dst, check_weight, check_weight_map
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.topology import DynamicTopology, Topology

T = TypeVar("T")


class KnobOwner(Protocol):
    """What the checks need from the object owning the knob."""

    where: str
    group: Group

    def machine_layout(self) -> tuple[int, int]: ...


class Knob(Generic[T]):
    """A public attribute whose value is validated (and normalised) by ``check(owner, name, value)``
    each time it is set."""

    def __init__(self, check: Callable[[Any, str, object], T]) -> None:
        self._check = check
        self._name = ""
        self._attr = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name, self._attr = name, f"_knob_{name}"

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> Knob[T]: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...
    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self._attr)

    def __set__(self, obj: object, value: object) -> None:
        setattr(obj, self._attr, self._check(obj, self._name, value))


def _bad(owner: KnobOwner, what: str, need: str, value: object) -> InvalidArgumentError:
    return InvalidArgumentError(f"{owner.where}: {what} must be {need}, got {value!r}")


def check_bool(owner: KnobOwner, what: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _bad(owner, what, "a bool", value)
    return value


def check_period(owner: KnobOwner, what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(owner, what, "an int >= 1", value)
    return value


def check_comm_type(owner: KnobOwner, what: str, value: object) -> CommunicationType:
    """A :class:`CommunicationType`, or its name or value as a string."""
    if isinstance(value, CommunicationType):
        return value
    for ct in CommunicationType:
        if value in (ct.name, ct.value):
            return ct
    raise _bad(owner, what, f"a CommunicationType (one of {[c.name for c in CommunicationType]})", value)


def check_self_weight(owner: KnobOwner, what: str, value: object) -> float | None:
    return None if value is None else check_weight(owner.where, what, value)


def check_src(owner: KnobOwner, what: str, value: object) -> dict[int, float] | None:
    """``{rank: weight}`` over other ranks of the group (machine ranks for ``*_machine_*``)."""
    if value is None:
        return None
    size, me = owner.machine_layout() if "machine" in what else (owner.group.size, owner.group.rank)
    return check_weight_map(owner.where, what, value, size, me)


def check_dst_knob(owner: KnobOwner, what: str, value: object) -> dict[int, float] | None:
    """``{rank: scale}`` or a list of ranks (scale 1)."""
    if value is None:
        return None
    size, me = owner.machine_layout() if "machine" in what else (owner.group.size, owner.group.rank)
    return check_dst(owner.where, what, value, size, me)


def check_topology_knob(owner: KnobOwner, what: str, value: object) -> Topology | None:
    """A static :class:`Topology` over the group's ranks (machines for ``machine_topology``)."""
    if value is None:
        return None
    size = owner.machine_layout()[0] if "machine" in what else owner.group.size
    if not isinstance(value, Topology) or value.size != size:
        raise _bad(owner, what, f"None or a lowband.topology.Topology of {size} ranks", value)
    return value


def check_dynamic_knob(owner: KnobOwner, what: str, value: object) -> DynamicTopology | None:
    """A :class:`DynamicTopology` over the group's ranks (machines for ``dynamic_machine_topology``)."""
    if value is None:
        return None
    size = owner.machine_layout()[0] if "machine" in what else owner.group.size
    if not isinstance(value, DynamicTopology) or value.size != size:
        raise _bad(owner, what, f"None or a lowband.topology.DynamicTopology of {size} ranks", value)
    return value
