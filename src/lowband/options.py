"""Option schemas: what every strategy, compressor, memory, transport, scheduler and workload accepts as
options, declared once next to what it configures and read by everything that takes options.

An item registered in a :class:`~lowband.registry.Registry` declares its options with its registration
(``@register_strategy("localsgd", "...", options=Options({"period": Opt(int, min=1, doc="...")}))``).
The registry binds the schema to the item's signature there: every keyword-only parameter is declared
and nothing else, and a default is the signature's (given once, in the signature; a default given in
the :class:`Opt` too must agree). Then:

- :meth:`Options.check` checks and converts what a user gave (``"5"`` -> ``5``, ``2`` -> ``2.0`` for a
  number, ``"true"`` -> ``True``), cross-option :class:`Rule` included, and raises one
  :class:`~lowband.errors.InvalidArgumentError` naming the option, the value, the item (``where``) and
  what is allowed. A nested spec (``compressed:compressor=qsgd:levels=0``) is checked against its own
  registry's schema (``Opt(str, spec=COMPRESSORS)``). ``make_strategy``, the command line's validation
  before anything starts (``lowband bench``), ``make_compressor``, ``make_reducer``, ``make_schedule``
  and ``get_workload`` call it through the registry, so constructors receive checked, typed values and
  check no option themselves;
- :meth:`Options.describe` (``key=default, ...``) and :meth:`Options.help` (one line per option: default,
  what is allowed, the doc) are what ``lowband bench --list`` prints.

None is accepted exactly when it is the option's default (it then means "not given").
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lowband.errors import InvalidArgumentError

if TYPE_CHECKING:
    from lowband.registry import Registry


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: an :class:`Opt` default not given: the registry takes the signature's
UNSET: Any = _Unset()

#: the value types a command line gives (:func:`lowband.registry.parse_value`), and their names
_NOUNS: dict[type, str] = {bool: "true or false", int: "an int", float: "a number", str: "a word"}
_BOOLS = {"true": True, "false": False}


@dataclass(frozen=True)
class Opt:
    """One option: its type and constraints, its default (else the signature's) and a one-line doc.

    ``kind``: ``int``, ``float`` (an int is taken as a float), ``bool`` or ``str``, the forms a command
    line gives (a string of the type is converted), or ``None`` for an option only Python can give
    (``objects``); ``choices``: the values allowed (a callable: computed when checked, e.g. a registry's
    names); ``min``/``max``: inclusive bounds, ``gt``/``lt``: exclusive ones; ``finite``: a float must
    be finite; ``unit``: shown in :meth:`Options.help`; ``words``: strings accepted besides a number
    (``"auto"``); ``objects``: Python objects accepted as they are (a ``Schedule``, a ``Path``);
    ``spec``: the value is a spec ``name:key=value;...`` of that registry, checked whole; ``parse``: a
    parser of the value's contents (``"0.25/0.015"``), raising ``ValueError`` (or
    :class:`InvalidArgumentError`) when it cannot; ``what``: the noun naming the value in messages
    (default: from ``kind``)."""

    kind: type | None
    default: Any = UNSET
    doc: str = ""
    choices: Sequence[Any] | Callable[[], Iterable[Any]] | None = None
    min: float | None = None
    max: float | None = None
    gt: float | None = None
    lt: float | None = None
    finite: bool = True
    unit: str = ""
    words: tuple[str, ...] = ()
    objects: tuple[type, ...] = ()
    spec: Registry[Any] | None = field(default=None, compare=False)
    parse: Callable[[Any], object] | None = field(default=None, compare=False)
    what: str = ""

    def allowed(self) -> str:
        """What this option takes, in words: ``an int >= 1``, ``one of 'a', 'b'``, ``'auto' or ...``."""
        parts: list[str] = [repr(w) for w in self.words]
        if self.spec is not None:
            parts.append(f"a {self.spec.kind} spec (name:key=value;...) of: {', '.join(self.spec.names())}")
        elif self.choices is not None:
            parts.append("one of " + ", ".join(repr(c) for c in self._choices()))
        elif self.kind is not None:
            parts.append((self.what or _NOUNS.get(self.kind, self.kind.__name__)) + self._bounds())
        parts += [self._object_names()] if self.objects else []
        if self.default is None:
            parts.append("None")
        return " or ".join(p for p in parts if p)

    def convert(self, where: str, key: str, value: Any) -> Any:
        """``value`` checked and converted (a string of a number to the number, an int to a float for a
        float option); :class:`InvalidArgumentError` naming ``key``, ``value``, ``where`` and what is
        allowed otherwise."""
        if value is None and self.default is None:
            return None
        if isinstance(value, str) and value in self.words:
            return value
        is_object = bool(self.objects) and isinstance(value, self.objects)
        out = value if is_object else _typed(self.kind, value)
        if out is _REFUSED or not (is_object or self._fits(out)):
            raise InvalidArgumentError(f"{where}: {key} must be {self.allowed()}, got {value!r}")
        if self.parse is not None:
            try:
                self.parse(out)
            except (ValueError, TypeError) as exc:  # InvalidArgumentError is a ValueError
                raise InvalidArgumentError(f"{where}: {key} must be {self.allowed()}, got {value!r}") from exc
        if self.spec is not None and isinstance(out, str):
            try:
                self.spec.check_spec(out)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"{where}: {key}={value!r}: {exc}") from None
        return out

    def _fits(self, v: Any) -> bool:
        if self.choices is not None and v not in self._choices():
            return False
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return True
        if math.isnan(v) or (self.finite and not math.isfinite(v)):
            return False
        lo_ok = (self.min is None or v >= self.min) and (self.gt is None or v > self.gt)
        return lo_ok and (self.max is None or v <= self.max) and (self.lt is None or v < self.lt)

    def _choices(self) -> list[Any]:
        c = self.choices
        return list(c() if callable(c) else c or ())

    def _bounds(self) -> str:
        lo = self.min if self.min is not None else self.gt
        hi = self.max if self.max is not None else self.lt
        if lo is not None and hi is not None:
            left, right = "[" if self.gt is None else "(", "]" if self.lt is None else ")"
            return f" in {left}{_num(lo)}, {_num(hi)}{right}"
        if lo is not None:
            return f" {'>=' if self.gt is None else '>'} {_num(lo)}"
        if hi is not None:
            return f" {'<=' if self.lt is None else '<'} {_num(hi)}"
        return ""

    def _object_names(self) -> str:
        return "a " + " or a ".join(t.__name__ for t in self.objects)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


class _Refused:
    pass


_REFUSED: Any = _Refused()


def _typed(kind: type | None, value: Any) -> Any:
    """``value`` as ``kind`` (int, float, bool, str) when it is one or a string of one; else _REFUSED."""
    if kind is None:
        return _REFUSED
    if kind is bool:
        if isinstance(value, bool):
            return value
        return _BOOLS.get(value.lower(), _REFUSED) if isinstance(value, str) else _REFUSED
    if kind is int or kind is float:
        if isinstance(value, bool):
            return _REFUSED
        if isinstance(value, int) or (kind is float and isinstance(value, float)):
            return kind(value)
        if isinstance(value, str):
            try:
                return kind(value.strip())
            except ValueError:
                return _REFUSED
        return _REFUSED
    return value if isinstance(value, kind) else _REFUSED


@dataclass(frozen=True)
class Rule:
    """A constraint across options: ``holds(values)`` (every option, the given ones and the defaults)
    must be true; ``doc`` says what must hold, and the error names ``keys`` with their values."""

    keys: tuple[str, ...]
    doc: str
    holds: Callable[[Mapping[str, Any]], bool]


class Options:
    """An item's options: ``name -> Opt`` and the :class:`Rule` across them (module docstring)."""

    def __init__(self, opts: Mapping[str, Opt] | None = None, rules: Sequence[Rule] = ()) -> None:
        self.opts: dict[str, Opt] = dict(opts or {})
        self.rules: tuple[Rule, ...] = tuple(rules)
        for rule in self.rules:
            unknown = sorted(set(rule.keys) - set(self.opts))
            if unknown:
                raise InvalidArgumentError(f"Options: rule {rule.doc!r} names undeclared options {unknown}")

    def __or__(self, other: Options) -> Options:
        """These options and ``other``'s (``other`` wins a name both declare)."""
        return Options({**self.opts, **other.opts}, (*self.rules, *other.rules))

    def names(self) -> list[str]:
        return list(self.opts)

    def defaults(self) -> dict[str, Any]:
        return {k: o.default for k, o in self.opts.items() if o.default is not UNSET}

    def bind(self, fn: Callable[..., Any], where: str) -> Options:
        """These options checked against ``fn``'s keyword-only parameters (the same names; an option's
        default the parameter's, which it takes when it declares none; each default allowed by its
        option); raises :class:`InvalidArgumentError` naming ``where`` otherwise."""
        try:
            params = {
                p.name: p for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY
            }
        except (TypeError, ValueError):  # no signature to read (a builtin): the schema stands alone
            params = {}
        missing, extra = sorted(set(params) - set(self.opts)), sorted(set(self.opts) - set(params))
        if params and (missing or extra):
            raise InvalidArgumentError(
                f"{where}: the options declared {sorted(self.opts)} differ from the keyword-only "
                f"parameters {sorted(params)} (undeclared: {missing}, not parameters: {extra})"
            )
        bound: dict[str, Opt] = {}
        for key, opt in self.opts.items():
            p = params.get(key)
            sig = inspect.Parameter.empty if p is None else p.default
            if opt.default is UNSET and sig is not inspect.Parameter.empty:
                opt = replace(opt, default=sig)
            elif opt.default is not UNSET and sig is not inspect.Parameter.empty and opt.default != sig:
                raise InvalidArgumentError(
                    f"{where}: option {key} declares default {opt.default!r}, the signature {sig!r}"
                )
            if opt.default is not UNSET and opt.default is not None:
                opt.convert(f"{where}: the default of", key, opt.default)
            bound[key] = opt
        return Options(bound, self.rules)

    def check(self, where: str, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` (the options given) checked and converted; the rules checked with the defaults of
        the options not given. Raises one :class:`InvalidArgumentError` prefixed by ``where``."""
        unknown = sorted(set(values) - set(self.opts))
        if unknown:
            raise InvalidArgumentError(
                f"{where}: unknown option(s) {unknown}; it takes {self.names() or 'no options'}"
            )
        out = {k: self.opts[k].convert(where, k, v) for k, v in values.items()}
        required = sorted(k for k, o in self.opts.items() if o.default is UNSET and k not in out)
        if required:
            raise InvalidArgumentError(f"{where}: option(s) {required} must be given")
        every = {**self.defaults(), **out}
        for rule in self.rules:
            if not rule.holds(every):
                got = ", ".join(f"{k}={_short(every.get(k))}" for k in rule.keys)
                raise InvalidArgumentError(f"{where}: {rule.doc} (got {got})")
        return out

    def describe(self) -> str:
        """``key=default, ...`` (one line)."""
        return ", ".join(f"{k}={_show(o.default)}" for k, o in self.opts.items())

    def help(self) -> list[str]:
        """One line per option, ``key=default: allowed; doc``, then one per rule."""
        lines = [
            f"{k}={_show(o.default)}: {o.allowed()}"
            + (f" ({o.unit})" if o.unit else "")
            + (f"; {o.doc}" if o.doc else "")
            for k, o in self.opts.items()
        ]
        return lines + [f"({r.doc})" for r in self.rules]

    def __repr__(self) -> str:
        return f"Options({self.describe()})"


def _short(v: Any) -> str:
    """A value in a message: its repr when plain, else its type (a Schedule, a Topology)."""
    plain = v is None or isinstance(v, (bool, int, float, str))
    return repr(v) if plain else f"a {type(v).__name__}"


def _show(v: Any) -> str:
    return "(required)" if v is UNSET else str(v)
