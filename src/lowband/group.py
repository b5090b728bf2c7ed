"""A process group as lowband sees it: a torch ProcessGroup plus the ranks it spans."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from lowband.errors import InvalidArgumentError


@dataclass(eq=False)
class Group:
    """A set of ranks that communicate together.

    ``pg`` is the torch ``ProcessGroup`` (gloo, NCCL, or a device-dispatching one) the ops run on.
    ``ranks[i]`` is the world rank of the group's rank ``i``; every rank argument of a lowband op
    (roots, sources, destinations) is a rank *in the group*, as in MPI.
    """

    pg: Any
    ranks: tuple[int, ...]
    rank: int
    name: str = "world"
    #: a second process group over the same ranks for lowband's own small control messages (the
    #: cross-rank argument check), so they never queue behind large data ops in ``pg``'s workers
    ctl: Any = None
    #: the cross-rank argument check for ops on this group: None follows the runtime's setting
    check: bool | None = None
    #: what names this group alike on every member and apart from every other group of the run (the
    #: argument check's store prefix); empty: the name and ranks
    key: str = ""
    _seq: itertools.count[int] = field(default_factory=itertools.count, repr=False)
    #: set by ``lowband.destroy_group`` (shared with the :meth:`unchecked` views of this group)
    _destroyed: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def destroyed(self) -> bool:
        return self._destroyed.is_set()

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def world_rank(self) -> int:
        return self.ranks[self.rank]

    @property
    def control_pg(self) -> Any:
        return self.ctl if self.ctl is not None else self.pg

    def unchecked(self) -> Group:
        """The same group (same process groups) with the per-op argument check off: for code that
        validated its layout once (a strategy checks its model at construction) and then issues
        many small ops, where the check's extra collective per op would cost latency."""
        return dataclasses.replace(self, check=False)

    def next_seq(self) -> int:
        """Sequence number of the next collective on this group (the same on every member)."""
        return next(self._seq)

    def check_rank(self, op: str, what: str, r: object) -> int:
        """Validate a rank argument of ``op``; returns it as an int."""
        if isinstance(r, bool) or not isinstance(r, int):
            raise InvalidArgumentError(
                f"lowband.{op} on rank {self.world_rank}: {what} must be an int rank in group "
                f"{self.name!r}, got {type(r).__name__}"
            )
        if not 0 <= r < self.size:
            raise InvalidArgumentError(
                f"lowband.{op} on rank {self.world_rank}: {what}={r} is not a rank of group "
                f"{self.name!r} (size {self.size})"
            )
        return r
