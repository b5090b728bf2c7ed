"""Link drift: a schedule of rate changes the testbed applies while the ranks run (``--rate-change``).

``--rate-change 30s:m1=10mbit,90s:m1=100mbit`` (``lowband run`` and ``lowband bench``, one parser,
:func:`parse_rate_changes`): 30 s after the ranks were started, machine 1's link is re-shaped to
10 Mbit/s both ways (its uplink ``veth0`` and its downlink, the bridge's port ``vmM``: the same two tbf
qdiscs the testbed made, replaced in place by ``tc qdisc replace``, so the queue and the connections
stay); at 90 s back to 100 Mbit/s.

- **Time** is counted from the launch of the ranks (the moment the testbed's parent process started
  them; under ``lowband run --max-restarts`` the first launch, not reset by a restart), not from
  anything the ranks signal: the ranks' start-up (torch's import, the rendezvous) lies inside it. The
  bench records, with each change, where it fell on the ranks' own time axis (``at_bench_s``: seconds
  after the bench's epoch, the axis of its step ``starts``/``ends``), so a round can be placed before
  or after it.
- **Checks** before anything starts (:func:`check_rate_changes`, one line, exit status 2): the syntax,
  the rate (:func:`~lowband.testbed.rates.parse_rate`; ``none`` is refused: a change goes from one
  shaped rate to another), the machine (``mM``, ``M`` < the number of machines), times that never
  decrease (changes at one time must name different machines), and a machine whose link is shaped both
  ways (``--rate``/``--rates``; the unshaped loopback fallback is refused as well). Delay changes are
  not supported: ``m1=20ms`` is refused (the delay stays ``--delay-ms`` for the whole run).
- **Applied** by a thread of the parent process (:class:`RateSchedule`, none in the ranks); it is
  stopped when the ranks have ended (and on any error), so it never outlives the run. Each applied
  change is logged on stderr and returned as a record (time, machine, old and new rate).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lowband.errors import InvalidArgumentError, LowbandError
from lowband.testbed.links import Layout
from lowband.testbed.rates import format_rate, parse_rate

__all__ = ["RateChange", "RateSchedule", "check_rate_changes", "parse_rate_changes"]

_ITEM_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|sec|m|min)?\s*:\s*m([0-9]+)\s*=\s*(\S+?)\s*$", re.I)
_DELAY_RE = re.compile(r"^[0-9]*\.?[0-9]+\s*(ms|us|s)$", re.I)
_HELP = "TIME:mMACHINE=RATE[,...], e.g. 30s:m1=10mbit,90s:m1=100mbit (seconds after the ranks start)"


@dataclass(frozen=True)
class RateChange:
    """At ``at_s`` seconds after the launch, machine ``machine``'s link becomes ``rate`` bits/s both ways."""

    at_s: float
    machine: int
    rate: float

    def describe(self) -> str:
        return f"{self.at_s:g}s:m{self.machine}={format_rate(self.rate, tc=True)}"


def parse_rate_changes(spec: str, where: str = "--rate-change") -> list[RateChange]:
    """The changes of ``spec`` (see the module docstring), in order; :class:`InvalidArgumentError`
    with one line for a malformed item, a bad rate, a delay, or times that decrease."""
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidArgumentError(f"{where}: expected {_HELP}, got {spec!r}")
    out: list[RateChange] = []
    for item in spec.split(","):
        m = _ITEM_RE.match(item)
        if m is None:
            raise InvalidArgumentError(f"{where}: cannot parse {item.strip()!r}; expected {_HELP}")
        number, unit, machine, rate_text = m.groups()
        at_s = float(number) * (60.0 if unit and unit.lower() in ("m", "min") else 1.0)
        if _DELAY_RE.match(rate_text):
            raise InvalidArgumentError(
                f"{where}: {item.strip()!r}: delay changes are not supported, only rates (the one-way "
                "delay is --delay-ms for the whole run)"
            )
        try:
            rate = parse_rate(rate_text)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(
                f"{where}: {item.strip()!r}: {exc}".replace("testbed rate: ", "")
            ) from exc
        if rate is None:
            raise InvalidArgumentError(
                f"{where}: {item.strip()!r}: a change needs a rate (unshaping a link mid-run is not supported)"
            )
        change = RateChange(at_s=at_s, machine=int(machine), rate=rate)
        if out and at_s < out[-1].at_s:
            raise InvalidArgumentError(
                f"{where}: times must not decrease: {change.describe()} comes after {out[-1].describe()}"
            )
        if any(c.at_s == at_s and c.machine == change.machine for c in out):
            raise InvalidArgumentError(f"{where}: machine {change.machine} changes twice at {at_s:g} s")
        out.append(change)
    return out


def check_rate_changes(changes: list[RateChange], layout: Layout, where: str = "--rate-change") -> None:
    """Refuse changes ``layout`` cannot take: an unknown machine, or a machine whose link is not shaped
    both ways (nothing to re-shape)."""
    n = layout.n_machines
    for c in changes:
        if c.machine >= n:
            machines = "machine m0" if n == 1 else f"machines m0..m{n - 1}"
            raise InvalidArgumentError(
                f"{where}: {c.describe()}: no machine m{c.machine}; this layout has {machines}"
                + (" (--ranks-per-machine: one link per machine)" if layout.ranks_per_machine > 1 else "")
            )
        spec = layout.machines[c.machine]
        if spec.up is None or spec.down is None:
            raise InvalidArgumentError(
                f"{where}: {c.describe()}: machine m{c.machine}'s link is not shaped both ways; give it a "
                "rate first (--rate or --rates)"
            )


def check_spec(
    spec: str | None, layout: Layout, mode: str, where: str = "--rate-change", *, probe: bool = True
) -> None:
    """A ``--rate-change`` spec against the run's layout and testbed mode, before anything starts:
    :func:`parse_rate_changes`, :func:`check_rate_changes`, and links that will be shaped (not the
    ``loopback`` mode, nor, with ``probe``, ``auto`` where shaping is unavailable here)."""
    if not spec:
        return
    check_rate_changes(parse_rate_changes(spec, where), layout, where)
    if mode == "loopback":
        raise InvalidArgumentError(f"{where}: needs shaped links, and --mode loopback never shapes")
    if not probe:
        return
    from lowband.testbed.namespaces import shaping_available

    ok, why = shaping_available()
    if not ok:
        raise InvalidArgumentError(f"{where}: needs shaped links, unavailable here ({why})")


def changes_arg(value: str) -> str:
    """The ``--rate-change`` option's value, checked for syntax (the layout is checked later)."""
    import argparse

    try:
        parse_rate_changes(value)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--rate-change: ")) from exc
    return value


def add_rate_change_option(p: Any) -> None:
    """``--rate-change SPEC``, the same for ``lowband run`` and ``lowband bench``."""
    p.add_argument(
        "--rate-change", type=changes_arg, default=None, metavar="SPEC",
        help="re-shape machine links while the ranks run: TIME:mMACHINE=RATE[,...], e.g. "
        "30s:m1=10mbit,90s:m1=100mbit (seconds after the ranks are started; both directions; rates only)",
    )  # fmt: skip


Apply = Callable[[int, float], None]


class RateSchedule:
    """Applies ``changes`` to a running testbed from a thread of this (the parent) process.

    ``start()`` takes the launch time; each change is applied by ``apply(machine, bits_per_s)`` (by
    default :meth:`lowband.testbed.netns.Testbed.set_rate`) at its time; ``stop()`` ends the thread
    (changes not yet due are dropped) and returns :attr:`applied`. A context manager: leaving it stops.
    """

    def __init__(
        self, changes: list[RateChange], layout: Layout, apply: Apply, *, who: str = "lowband.testbed"
    ) -> None:
        check_rate_changes(changes, layout)
        self.changes = list(changes)
        self.who = who
        self._apply = apply
        self._rates = [m.up for m in layout.machines]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = 0.0
        self.t0_wall = 0.0
        #: one record per change applied (or attempted: ``error`` says why it failed)
        self.applied: list[dict[str, Any]] = []

    def start(self) -> RateSchedule:
        # perf_counter is CLOCK_MONOTONIC on Linux, system-wide: the ranks' perf_counter reads the same
        self.t0, self.t0_wall = time.perf_counter(), time.time()
        if self.changes and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="lowband-rate-change", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        for c in self.changes:
            if self._stop.wait(max(0.0, self.t0 + c.at_s - time.perf_counter())):
                return
            old = self._rates[c.machine]
            record: dict[str, Any] = {
                "at_s": c.at_s, "machine": c.machine, "old": format_rate(old), "new": format_rate(c.rate),
                "old_bits": old, "new_bits": c.rate,
            }  # fmt: skip
            try:
                self._apply(c.machine, c.rate)
            except (LowbandError, OSError) as exc:
                record["error"] = str(exc)
            now = time.perf_counter()
            record.update(applied_s=round(now - self.t0, 3), monotonic=now, wall=time.time())
            if "error" not in record:
                self._rates[c.machine] = c.rate
            self.applied.append(record)
            said = (
                f"could not re-shape machine m{c.machine}: {record['error']}"
                if "error" in record
                else f"machine m{c.machine}'s link {record['old']} -> {record['new']} (both ways)"
            )
            print(
                f"{self.who}: rate change at {record['applied_s']:.1f} s: {said}", file=sys.stderr, flush=True
            )

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)  # at most one tc call in flight (run_cmd's own limit: 60 s)
        return list(self.applied)

    def __enter__(self) -> RateSchedule:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def schedule_for(tb: Any, spec: str | None, who: str) -> RateSchedule | None:
    """The schedule of ``spec`` on testbed ``tb`` (not started), or None without a spec. A testbed that
    fell back to loopback (no link to re-shape) is refused with :class:`InvalidArgumentError`."""
    if not spec:
        return None
    changes = parse_rate_changes(spec)
    if not tb.shaped:
        raise InvalidArgumentError(f"{who}: --rate-change needs shaped links, and this run is {tb.label()}")
    return RateSchedule(changes, tb.layout, tb.set_rate, who=who)


def place_changes(applied: list[dict[str, Any]], epoch0: float | None) -> list[dict[str, Any]]:
    """``applied`` with ``at_bench_s``: each change's time on the bench's axis (seconds after its
    ``epoch0``, rank 0's ``perf_counter`` at the bench's start, the axis of the step ``starts``/``ends``;
    negative: before the first step), when the ranks gave ``epoch0``."""
    if epoch0 is None:
        return applied
    return [{**c, "at_bench_s": round(c["monotonic"] - epoch0, 3)} for c in applied]
