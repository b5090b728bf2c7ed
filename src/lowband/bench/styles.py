"""How the bench's plots name and draw each strategy (pure: no figure is made here).

- Names: a strategy is named as typed (``-s``); when some spec is longer than :data:`LABEL_WIDTH`
  characters, every strategy is numbered (``S1``, ``S2``, ... in the order of the run) and a plot legend
  gives the number and the spec cut after its last whole option that fits (``…``); the bar charts and
  the timeline give the number and the whole spec; ``results.md``'s table has a column with the numbers
  beside the full specs.
- Looks: one colour per strategy (tab10, tab20 beyond ten) and, so that curves that coincide stay
  visible and tab20's paired hues stay apart, a line style and a marker of its own; markers are placed
  at staggered steps (:func:`mark_every`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the longest spec a plot legend shows whole
LABEL_WIDTH = 40

_LINESTYLES: tuple[Any, ...] = ("-", "--", "-.", (0, (5, 1, 1, 1, 1, 1)))
_MARKERS = "osD^vP*Xh<p>"


def _parts(spec: str) -> list[str]:
    """``spec`` cut after each ``,`` ``:`` ``;`` or space (the pieces join back to ``spec``)."""
    parts, cur = [], ""
    for ch in spec:
        cur += ch
        if ch in ",:; ":
            parts.append(cur)
            cur = ""
    parts.append(cur)
    return parts


def wrap_spec(spec: str, width: int = 40) -> str:
    """A strategy spec on lines of at most ``width`` characters where it can, broken after ``,``
    ``:`` ``;`` or a space (a single longer part keeps its own line)."""
    lines = [""]
    for part in _parts(spec):
        if lines[-1] and len(lines[-1]) + len(part.rstrip()) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(line.rstrip() for line in lines if line)


def shorten(spec: str, width: int = LABEL_WIDTH) -> str:
    """``spec`` whole if it fits in ``width`` characters, else cut after its last whole option (or
    part) that fits, followed by ``…``."""
    if len(spec) <= width:
        return spec
    out = ""
    for part in _parts(spec):
        if len(out) + len(part) > width - 1:
            break
        out += part
    return (out or spec[: width - 1]) + "…"


def numbered(keys: list[str], width: int = LABEL_WIDTH) -> bool:
    """Whether the strategies are numbered in the plots (some spec is longer than ``width``)."""
    return any(len(k) > width for k in keys)


def plot_labels(keys: list[str], width: int = LABEL_WIDTH) -> dict[str, str]:
    """Each strategy's name in a plot legend (module docstring): the spec, or ``S<i> <shortened>``."""
    if not numbered(keys, width):
        return {k: k for k in keys}
    return {k: f"S{i + 1} {shorten(k, width)}" for i, k in enumerate(keys)}


def full_labels(keys: list[str], width: int = LABEL_WIDTH) -> dict[str, str]:
    """Each strategy's name where a whole spec fits (bar charts, timeline panels): the spec, preceded
    by its number when the strategies are numbered."""
    if not numbered(keys, width):
        return {k: k for k in keys}
    return {k: f"S{i + 1} {k}" for i, k in enumerate(keys)}


def numbers(keys: list[str], width: int = LABEL_WIDTH) -> dict[str, str] | None:
    """``S1``, ``S2``, ... by key when the strategies are numbered, else None (for results.md)."""
    return {k: f"S{i + 1}" for i, k in enumerate(keys)} if numbered(keys, width) else None


@dataclass(frozen=True)
class Style:
    """How one strategy is drawn: colour (an RGBA tuple), line style, marker, and its index in the run
    (markers are staggered by it)."""

    color: Any
    linestyle: Any
    marker: str
    index: int


def styles(keys: list[str]) -> dict[str, Style]:
    """One :class:`Style` per strategy, the same in every plot of a run."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(keys) <= 10 else "tab20"]
    return {
        k: Style(cmap(i % cmap.N), _LINESTYLES[i % len(_LINESTYLES)], _MARKERS[i % len(_MARKERS)], i)
        for i, k in enumerate(keys)
    }


def colors(keys: list[str]) -> dict[str, Any]:
    """One colour per strategy (tab10, tab20 beyond ten), the same in every plot."""
    return {k: s.color for k, s in styles(keys).items()}


def mark_every(style: Style, count: int, points: int) -> tuple[int, int]:
    """``markevery`` for a curve of ``points`` points among ``count`` curves: a marker every ``step``
    points (at least ``count``, about six per curve), starting at the curve's own offset, so that
    curves lying on one another still show every strategy's markers."""
    step = max(count, points // 6, 1)
    return (style.index % step, step)
