"""``lowband plan --world-sizes 8,64,256,1024``: every spec predicted at each world size on one profile
(measured once) and the same per-link bandwidth and latency (:meth:`lowband.plan.links.Links.at`: the
layout built at each size, so a two-tier layout must divide it); ``scale.json``, ``scale.md`` and
``scale.png`` (predicted iteration time against world size, log x, one line per modelled spec)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowband.errors import InvalidArgumentError
from lowband.plan.planner import Entry

MAX_SIZES = 12  # sizes in one plan
MAX_WORLD = 1 << 20  # ranks at one size


def parse_world_sizes(text: str, where: str = "lowband plan") -> list[int]:
    """``"8,64,256"`` as sorted distinct ints in ``[1, MAX_WORLD]``, at most ``MAX_SIZES`` of them."""
    parts = [p.strip() for p in text.split(",")]
    sizes = []
    for p in parts:
        try:
            n = int(p)
        except ValueError:
            raise InvalidArgumentError(
                f"{where}: --world-sizes takes integers separated by commas, got {p!r} in {text!r}"
            ) from None
        if not 1 <= n <= MAX_WORLD:
            raise InvalidArgumentError(
                f"{where}: --world-sizes: each size must be in [1, {MAX_WORLD}], got {n}"
            )
        sizes.append(n)
    if len(sizes) != len(set(sizes)):
        raise InvalidArgumentError(f"{where}: --world-sizes repeats a size: {text!r}")
    if len(sizes) > MAX_SIZES:
        raise InvalidArgumentError(f"{where}: --world-sizes: at most {MAX_SIZES} sizes, got {len(sizes)}")
    return sorted(sizes)


def table(sizes: Sequence[int], rows: dict[str, list[Entry]]) -> list[list[str]]:
    """Header then one row per spec: predicted ms at each size (``-``: no model)."""
    out = [["strategy", *(f"n={n} ms" for n in sizes)]]
    for spec, entries in rows.items():
        cells = [f"{e.prediction.iteration_s * 1e3:.1f}" if e.prediction else "no model" for e in entries]
        out.append([spec, *cells])
    return out


def terminal(t: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in t) for i in range(len(t[0]))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in t
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def markdown(doc: dict[str, Any], t: list[list[str]]) -> str:
    head = [
        f"# lowband plan at scale: {doc['workload']}, {doc['links']['per_link']}",
        "",
        f"Predicted iteration ms at each world size, compute-only {doc['profile']['compute_ms']:.1f} ms "
        f"(measured once on this machine, batch {doc['profile']['batch_size']} per rank, a machine per "
        "rank). Same per-link bandwidth and latency at every size.",
        "",
        "| " + " | ".join(t[0]) + " |",
        "|---" + "|---:" * (len(t[0]) - 1) + "|",
    ]
    return "\n".join(head + ["| " + " | ".join([f"`{r[0]}`", *r[1:]]) + " |" for r in t[1:]]) + "\n"


def plot(
    path: Path, sizes: Sequence[int], rows: dict[str, list[Entry]], compute_ms: float, title: str
) -> None:
    """Predicted iteration ms against world size (log-log), one line per modelled spec, the compute-only
    line; the legend outside the axes, right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modelled = {s: es for s, es in rows.items() if all(e.prediction for e in es)}
    fig, ax = plt.subplots(figsize=(11, 6))
    cmap = plt.get_cmap("tab10")
    styles = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))  # a line style and marker per ten specs
    for i, (spec, es) in enumerate(modelled.items()):
        ms = [e.prediction.iteration_s * 1e3 for e in es]  # type: ignore[union-attr]
        style, marker = styles[(i // 10) % len(styles)]
        ax.plot(sizes, ms, style, marker=marker, markersize=4, color=cmap(i % 10), label=spec, linewidth=1.4)
    ax.axhline(compute_ms, color="black", linewidth=1.5, label=f"compute only ({compute_ms:.0f} ms)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(sizes), [str(n) for n in sizes])
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("predicted iteration time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 + len(modelled) // 30)
    partial = [s for s, es in rows.items() if s not in modelled]
    if partial:
        fig.text(0.01, 0.005, "no model: " + ", ".join(partial), fontsize=6, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def document(
    workload: str,
    sizes: Sequence[int],
    links: dict[int, Any],
    profile: dict[str, Any],
    rows: dict[str, list[Entry]],
) -> dict[str, Any]:
    """``scale.json``: per spec, per size, the prediction (or ``model: false``)."""
    first = links[sizes[0]]
    return {
        "workload": workload,
        "world_sizes": list(sizes),
        "links": {
            "per_link": first.label.split(", ", 1)[-1],
            "bandwidth_bytes_s": first.bandwidth,
            "latency_s": first.latency,
            "labels": {str(n): links[n].label for n in sizes},
        },
        "profile": profile,
        "strategies": {spec: {str(n): e.to_json() for n, e in zip(sizes, es)} for spec, es in rows.items()},
    }


def write(out: Path, doc: dict[str, Any], rows: dict[str, list[Entry]]) -> list[Path]:
    """``scale.json``, ``scale.md`` and ``scale.png`` in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "scale.json", out / "scale.md", out / "scale.png"]
    sizes = doc["world_sizes"]
    t = table(sizes, rows)
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    paths[1].write_text(markdown(doc, t))
    title = f"lowband plan: {doc['workload']}, {doc['links']['per_link']}, predicted per world size"
    plot(paths[2], sizes, rows, doc["profile"]["compute_ms"], title)
    return paths
