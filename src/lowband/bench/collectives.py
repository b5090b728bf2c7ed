"""``lowband bench --collectives``: time communication primitives side by side on the emulated links.

Every collective runs in the same rank processes, alternated size by size and round by round (op A,
op B, op C, A, B, C, ...), so machine drift hits every op alike. A sample is one blocking op: the
slowest rank's time from a common barrier to the op's completion. Per (op, size) the report gives the
median and range of the samples, the bytes that crossed each rank's link (kernel counters), and the
ratio to the first op (normally ``allreduce``).

Ops are specs like strategies: ``allreduce``, ``neighbor_allreduce:topology=ring``,
``neighbor_allreduce:topology=exp2``, ``neighbor_allreduce:topology=dynamic-exp2`` (one peer per
step, the paper's dynamic exponential-2), ``hierarchical_neighbor_allreduce``; each op is registered in
:data:`COLLECTIVES` with its options' schema (:mod:`lowband.options`), checked before anything starts.
Argument checks are off (``Group.unchecked``, ``check_topology=False``): this measures the transport,
not the checks.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import lowband
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.options import Options
from lowband.registry import Registry
from lowband.topology import DynamicTopology
from lowband.topology.names import MACHINE_TOPOLOGIES, topology_option

OpFn = Callable[[torch.Tensor, int], None]
#: ``factory(group, **options) -> op``
OpFactory = Callable[..., OpFn]

#: every op of ``lowband bench --collectives``
COLLECTIVES: Registry[OpFactory] = Registry("collective")


def register_collective(
    name: str, description: str, options: Options | None = None
) -> Callable[[OpFactory], OpFactory]:
    """Decorator: ``factory(group, **options) -> op``; ``options`` declares its keyword-only parameters."""
    return COLLECTIVES.registering(name, description, options)


def collective_names() -> list[str]:
    return COLLECTIVES.names()


def _topology(name: str, size: int, step: int) -> Any:
    from lowband.topology.names import build_topology

    t = build_topology("lowband bench", name, MACHINE_TOPOLOGIES, size, 1)
    return t.at(step) if isinstance(t, DynamicTopology) else t


@register_collective("allreduce", "ring allreduce (average) over all ranks")
def _allreduce(group: Group) -> OpFn:
    def run(buf: torch.Tensor, step: int) -> None:
        lowband.allreduce(buf, inplace=True, group=group)

    return run


@register_collective(
    "neighbor_allreduce",
    "partial averaging with the topology's neighbors (BlueFog)",
    Options({"topology": topology_option(MACHINE_TOPOLOGIES, dynamic=False)}),
)
def _neighbor_allreduce(group: Group, *, topology: str = "exp2") -> OpFn:
    from lowband.decentral.neighbor import neighbor_allreduce

    name = topology
    cache: dict[int, Any] = {}

    def run(buf: torch.Tensor, step: int) -> None:
        key = step if name == "dynamic-exp2" else 0
        if key not in cache:
            cache.clear()
            cache[key] = _topology(name, group.size, step)
        neighbor_allreduce(buf, topology=cache[key], check_topology=False, inplace=True, group=group)

    return run


@register_collective(
    "hierarchical_neighbor_allreduce", "machine average, then neighbor averaging between machines"
)
def _hierarchical(group: Group) -> OpFn:
    from lowband.decentral.neighbor import hierarchical_neighbor_allreduce

    def run(buf: torch.Tensor, step: int) -> None:
        buf.copy_(hierarchical_neighbor_allreduce(buf, check_topology=False))

    return run


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"16MB"`` -> 16_000_000, ``"4MiB"`` -> 4_194_304, ``"1024"`` -> 1024 (bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise InvalidArgumentError(f"lowband bench: bad message size {text!r} (e.g. 1MB, 4MiB, 65536)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 4:
        raise InvalidArgumentError(f"lowband bench: message size {text!r} is below one float32")
    return n


def check_collective(spec: str, where: str = "lowband bench") -> tuple[str, dict[str, Any]]:
    """``(name, options)`` of an op spec, the name registered and the options checked by its schema."""
    return COLLECTIVES.check_spec(spec, where)


def build_ops(specs: list[str], group: Group) -> list[tuple[str, OpFn]]:
    ops = []
    for spec in specs:
        name, options = check_collective(spec)
        ops.append((spec, COLLECTIVES.get(name)(group, **options)))
    return ops


def run_collectives(
    specs: list[str],
    sizes: list[int],
    *,
    rounds: int,
    reps: int,
    iface_bytes: Callable[[], tuple[int, int]],
    progress: Callable[[int, int, str], None],
) -> dict[str, Any]:
    """Run on every rank; returns (on every rank) per op and size the samples and link bytes."""
    group = lowband.world().unchecked()
    ops = build_ops(specs, group)
    n = group.size
    results: dict[str, dict[str, Any]] = {spec: {} for spec, _ in ops}
    total, done = len(sizes) * rounds * len(ops), 0
    step = 0
    for size in sizes:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32)
        for _spec, fn in ops:  # untimed warm-up: connections, allocations
            fn(buf, step)
            step += 1
        for _rnd in range(rounds):
            for spec, fn in ops:
                times: list[float] = []
                lowband.barrier(group=group)
                tx0, rx0 = iface_bytes()
                for _ in range(reps):
                    lowband.barrier(group=group)
                    t0 = time.perf_counter()
                    fn(buf, step)
                    times.append(time.perf_counter() - t0)
                    step += 1
                lowband.barrier(group=group)
                tx1, rx1 = iface_bytes()
                table = lowband.allgather(torch.tensor([times], dtype=torch.float64), group=group)
                wire = lowband.allgather(
                    torch.tensor([[float(tx1 - tx0), float(rx1 - rx0)]], dtype=torch.float64), group=group
                )
                slowest = table.max(dim=0).values.tolist()
                rec = results[spec].setdefault(str(size), {"samples": [], "tx_per_op": [], "rx_per_op": []})
                rec["samples"] += slowest
                rec["tx_per_op"].append([w[0] / reps for w in wire.tolist()])
                rec["rx_per_op"].append([w[1] / reps for w in wire.tolist()])
                done += 1
                progress(done, total, f"{spec} {size} B")
    return {"ops": [s for s, _ in ops], "sizes": sizes, "world_size": n, "results": results}


def summarize_collectives(raw: dict[str, Any]) -> dict[str, Any]:
    """Median, range and link bytes per (op, size); time ratio to the first op at each size."""
    ops, sizes = raw["ops"], raw["sizes"]
    rows: dict[str, dict[str, Any]] = {}
    for op in ops:
        rows[op] = {}
        for size in sizes:
            rec = raw["results"][op][str(size)]
            s = rec["samples"]
            tx = max(statistics.fmean(r[k] for r in rec["tx_per_op"]) for k in range(raw["world_size"]))
            rows[op][str(size)] = {
                "median_s": statistics.median(s),
                "min_s": min(s),
                "max_s": max(s),
                "samples": len(s),
                "max_rank_bytes_sent_per_op": tx,
            }
    base = ops[0]
    for op in ops:
        for size in sizes:
            r = rows[op][str(size)]
            r["ratio_to_" + base] = r["median_s"] / rows[base][str(size)]["median_s"]
    return {"baseline": base, "rows": rows}


def _fmt_size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def collectives_table(summary: dict[str, Any], sizes: list[int]) -> str:
    base = summary["baseline"]
    head = (
        ["op"]
        + [f"{_fmt_size(s)}: ms median [min-max]" for s in sizes]
        + [f"{_fmt_size(s)}: / {base}" for s in sizes]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op, by_size in summary["rows"].items():
        cells = [op]
        for s in sizes:
            r = by_size[str(s)]
            cells.append(f"{r['median_s'] * 1e3:.1f} [{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}]")
        cells += [f"{by_size[str(s)]['ratio_to_' + base]:.2f}x" for s in sizes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_collectives(summary: dict[str, Any], sizes: list[int], path: Any, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [s / 1e6 for s in sizes]
    for op, by_size in summary["rows"].items():
        med = [by_size[str(s)]["median_s"] * 1e3 for s in sizes]
        lo = [m - by_size[str(s)]["min_s"] * 1e3 for m, s in zip(med, sizes)]
        hi = [by_size[str(s)]["max_s"] * 1e3 - m for m, s in zip(med, sizes)]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=op)
    ax.set_xlabel("message size (MB)")
    ax.set_ylabel("time per op (ms, slowest rank; median, min-max)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# the embedding-gradient ops (emb_allgather, emb_alltoall, emb_ps) register themselves
from lowband.bench import embedding_ops as _embedding_ops  # noqa: E402, F401
