"""Link rates as ``tc`` reads them: the one parser of ``lowband run``, ``lowband bench`` and the testbed.

``tc`` reads ``bit`` (and a bare number) as bits per second and ``bps`` as *bytes* per second:
``100mbps`` is 100 megabytes/s = 800 Mbit/s to tc, where most people mean 100 megabits. So the
spellings whose meaning people disagree on are refused with what tc would make of them:

- accepted: a number of bits/s (``1e8``), ``100mbit``, ``1gbit``, ``500kbit``, ``100Mbit/s``,
  ``10mibit`` (IEC, 2**20), and bytes written out: ``12.5MB/s`` (capital B and ``/s``),
  ``12.5MByte/s``;
- refused: ``bps``/``kbps``/``mbps``/``gbps``/``tbps`` in any case (bytes to tc, bits to most
  people), and ``Mb``/``MB``/``mb/s`` (bits or bytes?).

Units are decimal (1 Mbit = 1e6 bits) as in tc; ``ki``/``mi``/``gi``/``ti`` are powers of 1024.
"""

from __future__ import annotations

import math
import re

from lowband.errors import InvalidArgumentError

RateLike = str | float | int | None

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_IEC = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_RATE_RE = re.compile(rf"^\s*{_NUMBER}\s*(\S*)\s*$")
_BITS_RE = re.compile(r"^(|[kmgt]i?)(?:bit|bits)(?:/s)?$", re.I)
_BYTES_RE = re.compile(r"^(|[kKmMgGtT]i?)(?:B|[Bb]ytes?)/s$")  # capital B, or "byte", and "/s"
_TC_BYTES_RE = re.compile(r"^(|[kmgt]i?)bps$", re.I)  # tc's bytes/s, read as bits by most people
_AMBIGUOUS_RE = re.compile(r"^(|[kmgt]i?)b(?:/s)?$", re.I)  # Mb, MB, mb/s: bits or bytes?
_WORD = {"": "", "k": "kilo", "m": "mega", "g": "giga", "t": "tera"} | {
    "ki": "kibi",
    "mi": "mebi",
    "gi": "gibi",
    "ti": "tebi",
}
_UNSHAPED = ("none", "unlimited", "inf", "unshaped")
_EXAMPLES = "100mbit, 1gbit, 100Mbit/s, 500kbit, 12.5MB/s (bytes) or a number of bits per second"


def _scale(prefix: str) -> float:
    p = prefix.lower()
    return _IEC[p] if p in _IEC else _PREFIX[p]


def _symbol(prefix: str) -> str:
    """``"m"`` -> ``"M"``, ``"ki"`` -> ``"Ki"``: the prefix as written before ``bit``/``B`` in a label."""
    p = prefix.lower()
    return "k" if p == "k" else p[:1].upper() + p[1:]


def _refusal(rate: str, number: str, unit: str, prefix: str) -> str:
    """The message for an ambiguous unit: what tc would read, and the spellings that say it."""
    bits, word = f"{number}{prefix.lower()}bit", _WORD[prefix.lower()]
    as_bits = float(number) * _scale(prefix)
    as_bytes = as_bits * 8
    if _TC_BYTES_RE.match(unit):
        return (
            f"testbed rate: {rate!r} is ambiguous: tc reads {unit.lower()!r} as {word}bytes per second, so "
            f"{number}{unit} is {format_rate(as_bytes)} to tc; write {bits} for {format_rate(as_bits)}, "
            f"or {format_rate(as_bytes, tc=True)} (= {number}{_symbol(prefix)}B/s) for what tc would read"
        )
    return (
        f"testbed rate: {rate!r} is ambiguous (bits or bytes?); write {bits} for {format_rate(as_bits)}, "
        f"or {number}{_symbol(prefix)}B/s for {number} {word}bytes per second "
        f"({format_rate(as_bytes)})"
    )


def parse_rate(rate: RateLike) -> float | None:
    """A rate in bits per second, as ``tc`` would read it, from a string (see the module docstring) or a
    number of bits per second. ``None`` and the strings ``"none"``, ``"unlimited"``, ``"inf"``,
    ``"unshaped"`` mean unshaped and give ``None``. A zero, negative, malformed or ambiguous rate
    raises :class:`InvalidArgumentError` saying what to write."""
    if rate is None:
        return None
    if isinstance(rate, bool):
        raise InvalidArgumentError(f"testbed rate: expected a rate such as '100mbit' or bits/s, got {rate!r}")
    if isinstance(rate, int | float):
        value = float(rate)
    elif isinstance(rate, str):
        if rate.strip().lower() in _UNSHAPED:
            return None
        m = _RATE_RE.match(rate)
        if m is None:
            raise InvalidArgumentError(f"testbed rate: cannot parse {rate!r}; use e.g. {_EXAMPLES}")
        number, unit = m.group(1), m.group(2)
        value = float(number)
        if not unit:
            pass  # a bare number: bits per second, as tc
        elif bits := _BITS_RE.match(unit):
            value *= _scale(bits.group(1))
        elif nbytes := _BYTES_RE.match(unit):
            value *= _scale(nbytes.group(1)) * 8
        elif (tcb := _TC_BYTES_RE.match(unit)) or (tcb := _AMBIGUOUS_RE.match(unit)):
            raise InvalidArgumentError(_refusal(rate.strip(), number, unit, tcb.group(1)))
        else:
            raise InvalidArgumentError(f"testbed rate: cannot parse {rate!r}; use e.g. {_EXAMPLES}")
    else:
        raise InvalidArgumentError(
            f"testbed rate: expected a str, a number of bits/s or None, got {type(rate).__name__}"
        )
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"testbed rate: must be a finite number of bits/s > 0, got {rate!r}")
    return value


def format_rate(bits_per_s: float | None, *, tc: bool = False) -> str:
    """``1e8`` -> ``"100 Mbit/s"`` (``tc=True``: ``"100mbit"``, a spelling tc and :func:`parse_rate`
    read alike); ``None`` -> ``"unshaped"``."""
    if bits_per_s is None:
        return "unshaped"
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            value = f"{bits_per_s / scale:g}"
            return f"{value}{unit.lower()}" if tc else f"{value} {unit}/s"
    return f"{bits_per_s:g}bit" if tc else f"{bits_per_s:g} bit/s"
