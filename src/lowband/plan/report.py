"""A plan's outputs: the terminal table, ``plan.json``, ``plan.md`` and ``plan.png``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowband.plan.planner import Entry

COLUMNS = ("strategy", "predicted ms", "compute ms", "compress ms", "comm ms", "bytes/rank/step", "flags")


def _bytes(n: float) -> str:
    for unit, k in (("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n:.0f} B"


def _flags(flags: dict[str, float]) -> str:
    names = {"local_steps": "H", "compression": "x", "staleness": "stale"}
    return " ".join(f"{names[k]}={v:g}" for k, v in flags.items()) or "-"


def rows(entries: Sequence[Entry], recommended: str | None) -> list[list[str]]:
    out = []
    for e in entries:
        spec = e.spec + (" *" if e.spec == recommended else "")
        p = e.prediction
        if p is None:
            out.append([spec, "no model", "", "", "", "", ""])
            continue
        out.append(
            [
                spec,
                f"{p.iteration_s * 1e3:.1f}",
                f"{p.compute_s * 1e3:.1f}",
                f"{p.compress_s * 1e3:.1f}",
                f"{p.comm_s * 1e3:.1f}",
                _bytes(p.bytes_per_step),
                _flags(p.flags),
            ]
        )
    return out


def terminal_table(entries: Sequence[Entry], recommended: str | None) -> str:
    table = [list(COLUMNS), *rows(entries, recommended)]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in table
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def markdown(plan: dict[str, Any], entries: Sequence[Entry]) -> str:
    head = [
        f"# lowband plan: {plan['workload']} on {plan['links']['label']}",
        "",
        f"Predicted per training step; compute-only {plan['profile']['compute_ms']:.1f} ms "
        f"(forward, backward, optimizer step measured on this machine, batch {plan['profile']['batch_size']} "
        f"per rank, x{plan['profile']['compute_scale']:g} for ranks sharing its cores). "
        f"Recommended: `{plan['recommended']}` (marked *). Flags: H = local steps between "
        "synchronisations, x = compression ratio, stale = steps of staleness.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(COLUMNS))) + "|",
    ]
    body = [
        "| " + " | ".join(f"`{r[0]}`" if i == 0 else r[i] for i in range(len(r))) + " |"
        for r in rows(entries, plan["recommended"])
    ]
    return "\n".join(head + body) + "\n"


def plot(path: Path, entries: Sequence[Entry], compute_ms: float, title: str) -> None:
    """Horizontal stacked bars (compute, compression, communication) per modelled spec, fastest on top,
    with the compute-only line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = [e for e in entries if e.prediction is not None]
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.32 * max(1, len(ms))))
    labels = [e.spec for e in ms][::-1]
    parts = [
        ("compute", "#4c72b0", [e.prediction.compute_s for e in ms]),  # type: ignore[union-attr]
        ("compression", "#dd8452", [e.prediction.compress_s for e in ms]),  # type: ignore[union-attr]
        ("communication not overlapped", "#c44e52", [e.prediction.comm_s for e in ms]),  # type: ignore[union-attr]
    ]
    left = [0.0] * len(ms)
    for name, color, vals in parts:
        v = [x * 1e3 for x in vals][::-1]
        ax.barh(labels, v, left=left, color=color, label=name, height=0.7)
        left = [a + b for a, b in zip(left, v)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.0f}", va="center", fontsize=8)
    ax.axvline(
        compute_ms, color="black", linestyle="--", linewidth=1, label=f"compute only ({compute_ms:.0f} ms)"
    )
    ax.set_xlabel("predicted iteration time (ms)")
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlim(0, max(left or [1.0]) * 1.12)
    ax.legend(fontsize=8, loc="upper right")
    none = [e.spec for e in entries if e.prediction is None]
    if none:
        fig.text(0.01, 0.005, "no model: " + ", ".join(none), fontsize=6, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, plan: dict[str, Any], entries: Sequence[Entry]) -> list[Path]:
    """``plan.json``, ``plan.md`` and ``plan.png`` in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "plan.json", out / "plan.md", out / "plan.png"]
    paths[0].write_text(json.dumps(plan, indent=1) + "\n")
    paths[1].write_text(markdown(plan, entries))
    title = f"lowband plan: {plan['workload']}, {plan['links']['label']}"
    plot(paths[2], entries, plan["profile"]["compute_ms"], title)
    return paths
