"""Link layouts for the testbed: rates, per-rank links and the two-tier machine layout (pure).

Nothing here touches the system. A :class:`Layout` says how many emulated machines there are, each
machine's :class:`LinkSpec` (uplink and downlink rate to the shared bridge, one-way delay on its
receive path), how many ranks share a machine, and the rate of the machine-internal link. Rates are
bits per second (``None`` = unshaped), parsed as tc reads them (:mod:`lowband.testbed.rates`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lowband.errors import InvalidArgumentError
from lowband.testbed.rates import RateLike, format_rate, parse_rate

__all__ = [
    "DEFAULT_MTU",
    "Layout",
    "LinkSpec",
    "RateLike",
    "build_layout",
    "check_mtu",
    "format_rate",
    "parse_rate",
]

#: default MTU of the emulated links: jumbo frames, as in data-center networks. At 1500 the kernel's
#: per-packet work for 4 ranks at 100 Mbit/s (veth, bridge, tbf's throttling timer) took 30-40% of this
#: 2-core machine's CPU, stolen from training; at 9000 about 5% (measured, docs/ARCHITECTURE.md).
DEFAULT_MTU = 9000
MTU_RANGE = (576, 65000)


def check_mtu(where: str, mtu: object) -> int:
    """``mtu`` if it is an int in :data:`MTU_RANGE`, else an error naming ``where``."""
    lo, hi = MTU_RANGE
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not lo <= mtu <= hi:
        raise InvalidArgumentError(f"{where}: mtu must be in {lo}..{hi}, got {mtu!r}")
    return mtu


def _check_delay(delay_ms: float) -> float:
    if isinstance(delay_ms, bool) or not isinstance(delay_ms, int | float):
        raise InvalidArgumentError(f"testbed delay_ms: expected a number of milliseconds, got {delay_ms!r}")
    if not math.isfinite(delay_ms) or delay_ms < 0:
        raise InvalidArgumentError(f"testbed delay_ms: must be a finite number >= 0, got {delay_ms!r}")
    return float(delay_ms)


@dataclass(frozen=True)
class LinkSpec:
    """One rank's (or one machine's) link to the bridge: uplink, downlink (bits/s) and one-way delay."""

    up: float | None
    down: float | None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("up", "down"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise InvalidArgumentError(
                    f"testbed LinkSpec.{name}: must be None or a finite rate in bits/s > 0, got {value!r}"
                )
        _check_delay(self.delay_ms)

    @staticmethod
    def of(
        rate: RateLike = None, *, up: RateLike = None, down: RateLike = None, delay_ms: float = 0.0
    ) -> LinkSpec:
        """A link of ``rate`` both ways, or with ``up``/``down`` given apart (they override ``rate``)."""
        base = parse_rate(rate)
        return LinkSpec(
            up=parse_rate(up) if up is not None else base,
            down=parse_rate(down) if down is not None else base,
            delay_ms=_check_delay(delay_ms),
        )

    @property
    def shaped(self) -> bool:
        return self.up is not None or self.down is not None or self.delay_ms > 0

    def label(self) -> str:
        """``"100 Mbit/s"``, ``"up 100 Mbit/s / down 1 Gbit/s"``, with ``" + 20 ms"`` when delayed."""
        if self.up == self.down:
            text = format_rate(self.up)
        else:
            text = f"up {format_rate(self.up)} / down {format_rate(self.down)}"
        if self.delay_ms > 0:
            text += f" + {self.delay_ms:g} ms"
        return text


@dataclass(frozen=True)
class Layout:
    """Emulated machines (one network namespace each) and the ranks that live on them.

    Rank ``r`` lives on machine ``r // ranks_per_machine``. With ``ranks_per_machine > 1`` (two-tier)
    ranks of one machine share its link to the bridge and talk to each other over the machine's
    loopback, shaped to ``intra`` bits/s when given.
    """

    machines: tuple[LinkSpec, ...]
    ranks_per_machine: int = 1
    intra: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.machines, tuple) or not all(isinstance(m, LinkSpec) for m in self.machines):
            raise InvalidArgumentError("testbed Layout.machines: expected a tuple of LinkSpec")
        if len(self.machines) < 1:
            raise InvalidArgumentError("testbed Layout: needs at least 1 machine, got 0")
        if isinstance(self.ranks_per_machine, bool) or not isinstance(self.ranks_per_machine, int):
            raise InvalidArgumentError(
                f"testbed Layout.ranks_per_machine: expected an int, got {self.ranks_per_machine!r}"
            )
        if self.ranks_per_machine < 1:
            raise InvalidArgumentError(
                f"testbed Layout.ranks_per_machine: must be >= 1, got {self.ranks_per_machine}"
            )
        if self.intra is not None and (
            isinstance(self.intra, bool)
            or not isinstance(self.intra, int | float)
            or not math.isfinite(self.intra)
            or self.intra <= 0
        ):
            raise InvalidArgumentError(
                f"testbed Layout.intra: must be None or a rate in bits/s > 0, got {self.intra!r}"
            )

    @property
    def world_size(self) -> int:
        return len(self.machines) * self.ranks_per_machine

    @property
    def n_machines(self) -> int:
        return len(self.machines)

    def machine_of(self, rank: int) -> int:
        """The machine (namespace index) rank ``rank`` lives on."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise InvalidArgumentError(
                f"testbed Layout: rank must be an int in [0, {self.world_size}), got {rank!r}"
            )
        return rank // self.ranks_per_machine

    @property
    def shaped(self) -> bool:
        return self.intra is not None or any(m.shaped for m in self.machines)

    @staticmethod
    def flat(
        n: int, rate: RateLike, *, up: RateLike = None, down: RateLike = None, delay_ms: float = 0.0
    ) -> Layout:
        """``n`` ranks, one per machine, every one with the same link."""
        _check_count("Layout.flat: n", n)
        spec = LinkSpec.of(rate, up=up, down=down, delay_ms=delay_ms)
        return Layout(machines=(spec,) * n)

    @staticmethod
    def heterogeneous(rates: Sequence[RateLike], delay_ms: float = 0.0) -> Layout:
        """One rank per machine, rank ``i`` with rate ``rates[i]`` both ways."""
        if isinstance(rates, str) or not isinstance(rates, Sequence):
            raise InvalidArgumentError(
                f"testbed Layout.heterogeneous: rates must be a sequence of rates, got {rates!r}"
            )
        if len(rates) < 1:
            raise InvalidArgumentError("testbed Layout.heterogeneous: needs at least 1 rate, got none")
        return Layout(machines=tuple(LinkSpec.of(r, delay_ms=delay_ms) for r in rates))

    @staticmethod
    def two_tier(machines: int, ranks_per_machine: int, inter: RateLike, intra: RateLike = None) -> Layout:
        """``machines`` machines of ``ranks_per_machine`` ranks: ``inter`` between machines, ``intra`` inside."""
        _check_count("Layout.two_tier: machines", machines)
        _check_count("Layout.two_tier: ranks_per_machine", ranks_per_machine)
        return Layout(
            machines=(LinkSpec.of(inter),) * machines,
            ranks_per_machine=ranks_per_machine,
            intra=parse_rate(intra),
        )

    def describe(self) -> str:
        """One line: ``"4 ranks, 100 Mbit/s per rank"``, per-rank rates when they differ, two-tier form."""
        n = self.world_size
        labels = [m.label() for m in self.machines]
        if self.ranks_per_machine == 1:
            links = f"{labels[0]} per rank" if len(set(labels)) == 1 else "ranks at " + ", ".join(labels)
            return f"{n} rank{'s' if n != 1 else ''}, {links}"
        links = f"{labels[0]} per machine" if len(set(labels)) == 1 else "machines at " + ", ".join(labels)
        return (
            f"{n} ranks on {self.n_machines} machines x {self.ranks_per_machine}, {links}, "
            f"{format_rate(self.intra)} inside a machine"
        )

    def bottleneck(self) -> float | None:
        """The slowest rate (bits/s) of any inter-machine link, either direction; ``None`` if all unshaped.

        With one rank per machine this is the slowest rank's rate. In a two-tier layout it is the
        machine link's rate, which the ranks of that machine share.
        """
        rates = [r for m in self.machines for r in (m.up, m.down) if r is not None]
        return min(rates) if rates else None


def _check_count(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"testbed {what}: expected an int, got {value!r}")
    if value < 1:
        raise InvalidArgumentError(f"testbed {what}: must be >= 1, got {value}")


def build_layout(
    world_size: int,
    *,
    rate: RateLike = None,
    rates: Sequence[RateLike] | None = None,
    ranks_per_machine: int = 1,
    intra_rate: RateLike = None,
    delay_ms: float = 0.0,
    where: str = "testbed",
) -> Layout:
    """The layout of the command-line options shared by ``lowband bench`` and ``lowband run``:
    ``world_size`` ranks, ``ranks_per_machine`` per machine, every machine at ``rate`` (or ``rates[m]``,
    one per machine), ``intra_rate`` inside a machine, ``delay_ms`` one-way delay on each machine link."""
    _check_count(f"{where}: world size", world_size)
    _check_count(f"{where}: ranks per machine", ranks_per_machine)
    if world_size % ranks_per_machine:
        raise InvalidArgumentError(
            f"{where}: ranks per machine ({ranks_per_machine}) must divide the world size ({world_size})"
        )
    machines = world_size // ranks_per_machine
    if rates is not None and len(rates) != machines:
        raise InvalidArgumentError(
            f"{where}: --rates has {len(rates)} entries; need one per machine ({machines})"
        )
    per_machine = list(rates) if rates is not None else [rate] * machines
    return Layout(
        machines=tuple(LinkSpec.of(r, delay_ms=delay_ms) for r in per_machine),
        ranks_per_machine=ranks_per_machine,
        intra=parse_rate(intra_rate),
    )
