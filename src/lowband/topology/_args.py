"""Argument checks shared by the topology modules (pure: no communication, no runtime)."""

from __future__ import annotations

import operator
from collections.abc import Iterable

from lowband.errors import InvalidArgumentError


def fn(name: str) -> str:
    """The public name of a function of this package, as error messages spell it."""
    return f"lowband.topology.{name}"


def as_int(where: str, what: str, value: object) -> int:
    """``value`` as an int (Python or NumPy integer, never bool), or an error naming it."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{where}: {what} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"{where}: {what} must be an int, got {type(value).__name__} {value!r}"
        ) from None


def check_size(where: str, size: object, what: str = "size") -> int:
    """A graph size: an int >= 1."""
    n = as_int(where, what, size)
    if n < 1:
        raise InvalidArgumentError(f"{where}: {what} must be >= 1, got {n}")
    return n


def check_rank(where: str, rank: object, size: int, what: str = "rank") -> int:
    """A rank of a graph of ``size`` nodes: an int in ``[0, size)``."""
    r = as_int(where, what, rank)
    if not 0 <= r < size:
        raise InvalidArgumentError(f"{where}: {what} must be in [0, {size}), got {r}")
    return r


def check_base(where: str, base: object) -> int:
    """The base of an exponential graph: an int >= 2."""
    b = as_int(where, "base", base)
    if b < 2:
        raise InvalidArgumentError(f"{where}: base must be an int >= 2, got {b}")
    return b


def check_step(where: str, step: object) -> int:
    """A step (iteration) index of a time-varying topology: an int >= 0."""
    s = as_int(where, "step", step)
    if s < 0:
        raise InvalidArgumentError(f"{where}: step must be >= 0, got {s}")
    return s


def check_rank_list(where: str, what: str, ranks: object, owner: int, size: int) -> list[int]:
    """One rank's list of peers: distinct ints in ``[0, size)``, not ``owner`` itself."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise InvalidArgumentError(
            f"{where}: {what} of rank {owner} must be a list of ranks, got {type(ranks).__name__}"
        )
    out: list[int] = []
    for r in ranks:
        peer = check_rank(where, r, size, what=f"{what} of rank {owner}: entry")
        if peer == owner:
            raise InvalidArgumentError(f"{where}: {what} of rank {owner} contains the rank itself")
        if peer in out:
            raise InvalidArgumentError(f"{where}: {what} of rank {owner} contains {peer} twice")
        out.append(peer)
    return out


def check_local_size(where: str, size: int, local_size: object) -> tuple[int, int]:
    """``(local_size, machine_size)`` of a homogeneous machine layout: ``local_size`` divides ``size``."""
    ls = check_size(where, local_size, what="local_size")
    if size % ls != 0:
        raise InvalidArgumentError(
            f"{where}: local_size {ls} does not divide size {size} (machines must hold equally many ranks)"
        )
    return ls, size // ls
