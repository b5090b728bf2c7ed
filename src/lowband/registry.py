"""Registries: names to items (strategy factories, schedulers, workloads, compressors), so that the
bench and the CLI never switch on strings, and an unknown name is one clear error listing the known.
Each item carries its options' schema (:mod:`lowband.options`), declared with its registration."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from lowband.errors import InvalidArgumentError
from lowband.options import Options

T = TypeVar("T")


class Registry(Generic[T]):
    """Named items of one ``kind`` ("strategy", "scheduler", ...), each with a one-line description.

    Iterating yields the names (sorted); ``name in registry`` tests one.
    """

    def __init__(self, kind: str, items: Mapping[str, T] | None = None) -> None:
        self.kind = kind
        self._items: dict[str, tuple[T, str, Options]] = {}
        for name, item in (items or {}).items():
            self.register(name, item)

    def register(self, name: str, item: T, description: str = "", options: Options | None = None) -> T:
        """Add ``item`` as ``name`` (a name is registered once) with its ``options``' schema, bound to
        its keyword-only parameters (:meth:`lowband.options.Options.bind`: every one declared, defaults
        from the signature); returns ``item``."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(
                f"register {self.kind}: the name must be a non-empty str, got {name!r}"
            )
        if name in self._items:
            raise InvalidArgumentError(f"register {self.kind}: {name!r} is already registered")
        schema = (options or Options()).bind(item, f"register {self.kind} {name!r}")  # type: ignore[arg-type]
        self._items[name] = (item, description, schema)
        return item

    def registering(
        self, name: str, description: str = "", options: Options | None = None
    ) -> Callable[[T], T]:
        """Decorator form of :meth:`register`."""

        def deco(item: T) -> T:
            return self.register(name, item, description, options)

        return deco

    def get(self, name: object, where: str | None = None) -> T:
        """The item registered as ``name``, or :class:`InvalidArgumentError` listing the known names
        (prefixed by ``where``, the caller's label)."""
        return self._entry(name, where)[0]

    def _entry(self, name: object, where: str | None) -> tuple[T, str, Options]:
        entry = self._items.get(name) if isinstance(name, str) else None
        if entry is None:
            at = f"{where}: " if where else ""
            raise InvalidArgumentError(
                f"{at}unknown {self.kind} {name!r}; known: {', '.join(self.names()) or 'none'}"
            )
        return entry

    def names(self) -> list[str]:
        return sorted(self._items)

    def descriptions(self) -> dict[str, str]:
        """``name -> description``, sorted by name."""
        return {k: self._items[k][1] for k in self.names()}

    def options(self, name: str, where: str | None = None) -> Options:
        """The options' schema of the item registered as ``name``."""
        return self._entry(name, where)[2]

    def check_options(
        self, name: str, options: Mapping[str, Any], where: str | None = None
    ) -> dict[str, Any]:
        """``options`` checked and converted by the item's schema (unknown names, types, ranges, choices,
        nested specs, rules); errors are prefixed by ``where`` (default ``"<kind> '<name>'"``)."""
        schema = self.options(name, where)
        return schema.check(where or f"{self.kind} {name!r}", options)

    def check_spec(self, spec: str, where: str | None = None) -> tuple[str, dict[str, Any]]:
        """A spec ``"name:key=value;key=value"`` (``,`` or ``;`` between options) -> ``(name, options)``,
        the name registered and the options checked and converted (:meth:`check_options`)."""
        name, options = parse_spec(spec, self.kind, semicolons=True)
        schema = self.options(name, where)
        at = f"{where}: " if where else ""
        return name, schema.check(f"{at}{self.kind} {name!r}", options)

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"


def parse_spec(spec: str, what: str, *, semicolons: bool = False) -> tuple[str, dict[str, Any]]:
    """``"name:key=value,key=value"`` -> ``(name, {key: value})``, values parsed as int, float (``inf``
    too), bool (``true``/``false``) or str. With ``semicolons``, ``;`` separates options as ``,`` does
    (a compressor spec nested in a strategy's option: ``compressor=qsgd:levels=16;bucket=512``)."""
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"{what} spec must be a str, got {type(spec).__name__}")
    name, _, rest = spec.partition(":")
    if semicolons:
        rest = rest.replace(";", ",")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise InvalidArgumentError(f"{what} spec {spec!r}: expected name:key=value,key=value")
        options[key.strip()] = parse_value(value.strip())
    return name.strip(), options


def parse_value(v: str) -> Any:
    """A spec's option value: int, float (``inf`` included), bool or, failing those, the string."""
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)
