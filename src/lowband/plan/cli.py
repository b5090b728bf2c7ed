"""``lowband plan``: predict every strategy's iteration time on a workload and links, rank them."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from lowband.errors import InvalidArgumentError

DEFAULT_WORLD = 4
#: the other ranks of a --measure job wait this long beyond the time limit for rank 0's plan
MEASURE_SLACK_S = 120.0
LAUNCH_HINT = (
    "run it on every rank of a launched job, e.g. `lowband run -n 4 --rate 100mbit -m lowband plan "
    "--measure ...` or `torchrun --nproc-per-node 4 -m lowband plan --measure ...`"
)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "plan",
        help="predict each strategy's iteration time on your model and links, and recommend one",
        description="Profiles the workload once on this machine (per-layer forward/backward, optimizer "
        "step, compressors) and predicts, for every strategy spec, the iteration time over the links "
        "given (--rate/--rates as lowband bench, or --measure: the links between the ranks of a job "
        "launched with lowband run or torchrun). Writes plan.json, plan.md and plan.png to --out.",
    )
    p.add_argument("-w", "--workload", default="fmnist-cnn", help="a registered workload or module:factory")
    p.add_argument(
        "-s", "--strategies", default=None,
        help="specs separated by '+' (default: every registered strategy over a grid of its settings)",
    )  # fmt: skip
    p.add_argument(
        "-n", "--world-size", type=int, default=None,
        help="ranks (default 4; with --measure: the launched job's, which -n must equal if given)",
    )  # fmt: skip
    p.add_argument(
        "--world-sizes", default=None,
        help="predict at each of these world sizes instead (e.g. 8,64,256,1024; the same per-link rate "
        "and delay): writes scale.json, scale.md and scale.png",
    )  # fmt: skip
    p.add_argument("--rate", default=None, help="per-rank link rate, e.g. 100mbit (or --rates)")
    p.add_argument("--rates", default=None, help="heterogeneous: one rate per machine, comma separated")
    p.add_argument("--ranks-per-machine", type=int, default=1, help="two-tier layout: ranks per machine")
    p.add_argument("--intra-rate", default=None, help="rate inside a machine (two-tier; default unshaped)")
    p.add_argument("--delay-ms", type=float, default=None, help="one-way delay per machine link (default 0)")
    p.add_argument(
        "--measure", action="store_true",
        help="measure the links instead (timed allreduces between the ranks): run it on every rank of a "
        "job, e.g. lowband run -n 4 --rate 100mbit -m lowband plan --measure",
    )  # fmt: skip
    p.add_argument(
        "--time-limit", type=float, default=60.0,
        help="refuse a plan whose profile may take longer than this many seconds (default 60)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=None, help="batch per rank (default: the workload's)")
    p.add_argument(
        "--shared-cores", type=int, default=0,
        help="the ranks share this many cores of this machine (lowband's testbed: the machine's cores): "
        "computation predicted max(1, ranks / cores) times slower (default 0: a machine per rank)",
    )  # fmt: skip
    p.add_argument(
        "--max-local-steps", type=int, default=None, help="recommend nothing with more local steps"
    )
    p.add_argument("--max-compression", type=float, default=None, help="recommend nothing compressing more")
    p.add_argument("--max-staleness", type=int, default=None, help="recommend nothing staler (steps)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and batch (default 0)")
    p.add_argument("--out", default=None, help="output folder (default results/plan-<time>)")


def _layout(ns: argparse.Namespace, world: int | None = None) -> Any:
    from lowband.run_cli import rate_arg
    from lowband.testbed.links import build_layout

    if ns.rate is not None and ns.rates is not None:
        raise InvalidArgumentError("lowband plan: give the links once: --rate or --rates, not both")
    if ns.rate is None and ns.rates is None:
        raise InvalidArgumentError("lowband plan: give the links' rate: --rate (e.g. 100mbit) or --rates")
    try:
        rate = rate_arg(ns.rate) if ns.rate is not None else None
        rates = [rate_arg(r) for r in ns.rates.split(",")] if ns.rates is not None else None
        intra = rate_arg(ns.intra_rate) if ns.intra_rate is not None else None
    except argparse.ArgumentTypeError as e:
        raise InvalidArgumentError(f"lowband plan: {e}") from e
    return build_layout(
        world or ns.world_size or DEFAULT_WORLD, rate=rate, rates=rates, ranks_per_machine=ns.ranks_per_machine,
        intra_rate=intra, delay_ms=ns.delay_ms or 0.0, where="lowband plan",
    )  # fmt: skip


def _check_numbers(ns: argparse.Namespace) -> None:
    for what, v, lo in (
        ("--batch-size", ns.batch_size, 1),
        ("--shared-cores", ns.shared_cores, 0),
        ("--max-local-steps", ns.max_local_steps, 1),
        ("--max-staleness", ns.max_staleness, 0),
    ):
        if v is not None and v < lo:
            raise InvalidArgumentError(f"lowband plan: {what} must be >= {lo}, got {v}")
    if not ns.time_limit > 0:
        raise InvalidArgumentError(f"lowband plan: --time-limit must be > 0 seconds, got {ns.time_limit}")
    if ns.max_compression is not None and not ns.max_compression >= 1:
        raise InvalidArgumentError(f"lowband plan: --max-compression must be >= 1, got {ns.max_compression}")


def _world_sizes(ns: argparse.Namespace) -> list[int] | None:
    """``--world-sizes`` parsed (None: one size, ``-n``); what cannot go with it refused."""
    from lowband.plan.scale import parse_world_sizes

    if ns.world_sizes is None:
        return None
    for flag, given in (("-n", ns.world_size is not None), ("--rates", ns.rates is not None),
                        ("--shared-cores", bool(ns.shared_cores)), ("--measure", ns.measure)):  # fmt: skip
        if given:
            raise InvalidArgumentError(
                f"lowband plan: {flag} describes one world size; not with --world-sizes (a machine per rank "
                "at every size, --rate per link)"
            )
    return parse_world_sizes(ns.world_sizes)


def main(ns: argparse.Namespace) -> int:
    from lowband.bench.cli import _user_errors

    return _user_errors("plan", _plan, ns)


def _measure_world(ns: argparse.Namespace) -> int:
    """The launched job's world size for ``--measure`` (refusing links given twice, -n that differs,
    or no launched job)."""
    from lowband.plan.measure import launched_world

    given = [f for f, v in (("--rate", ns.rate), ("--rates", ns.rates), ("--intra-rate", ns.intra_rate),
                            ("--delay-ms", ns.delay_ms)) if v is not None]  # fmt: skip
    if ns.shared_cores:
        raise InvalidArgumentError(
            "lowband plan --measure: every rank profiles at once, so cores shared by the ranks are "
            "measured; --shared-cores is for a plan from the configured rates"
        )
    if given:
        raise InvalidArgumentError(
            f"lowband plan: give the links once: --measure measures them, so not {' '.join(given)} "
            "too (give the rate to the launcher: lowband run --rate ...)"
        )
    world = launched_world()
    if world is None:
        raise InvalidArgumentError(
            f"lowband plan --measure: no launched job (RANK/WORLD_SIZE unset): {LAUNCH_HINT}"
        )
    if ns.world_size is not None and ns.world_size != world:
        raise InvalidArgumentError(
            f"lowband plan --measure: -n {ns.world_size} but the job was launched with {world} ranks "
            "(leave -n out, or launch as many ranks)"
        )
    if world % ns.ranks_per_machine:
        raise InvalidArgumentError(
            f"lowband plan: --ranks-per-machine {ns.ranks_per_machine} must divide the world size {world}"
        )
    return world


def _plan(ns: argparse.Namespace) -> int:
    from lowband.bench.validate import check_workload
    from lowband.plan import planner
    from lowband.plan.budget import check_time_limit
    from lowband.plan.links import links_from_layout

    # every argument checked before anything runs
    _check_numbers(ns)
    check_workload(ns.workload, "lowband plan")
    specs = ns.strategies.split("+") if ns.strategies else planner.default_specs()
    planner.check_specs(specs)
    sizes = _world_sizes(ns)
    if sizes is not None:
        from lowband.plan.cli_scale import run_scale

        check_time_limit(ns.workload, specs, ns.time_limit, batch_size=ns.batch_size, seed=ns.seed)
        return run_scale(ns, specs, sizes, {n: links_from_layout(_layout(ns, n)) for n in sizes})
    if ns.measure:
        world = _measure_world(ns)
    else:
        links = links_from_layout(_layout(ns))
        world = links.world
    check_time_limit(ns.workload, specs, ns.time_limit, batch_size=ns.batch_size, seed=ns.seed)
    if not ns.measure:
        return _write_plan(ns, specs, world, links, {})
    from lowband.group import Group
    from lowband.plan.measure import Probe, run_measured

    def work(p: Probe, group: Group, lead: bool) -> int:
        # every rank profiles and predicts at once (its cores shared as in training); rank 0 writes
        return _write_plan(ns, specs, world, p.links, p.to_json(), group, write=lead)

    return run_measured(work, wait_s=ns.time_limit + MEASURE_SLACK_S)


def _write_plan(
    ns: argparse.Namespace,
    specs: list[str],
    world: int,
    links: Any,
    measured: dict[str, Any],
    group: Any = None,
    write: bool = True,
) -> int:
    """Profile the workload, predict every spec on ``links``, write and print the plan (``write``
    False: the profile and predictions only, beside the rank that writes)."""
    import torch
    from tqdm import tqdm

    from lowband.plan import planner, report
    from lowband.plan.profile import measure_profile

    accept = planner.Acceptance(ns.max_local_steps, ns.max_compression, ns.max_staleness)
    scale = max(1.0, world / ns.shared_cores) if ns.shared_cores else 1.0
    out = Path(ns.out or Path("results") / f"plan-{time.strftime('%Y%m%d-%H%M%S')}")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each bench rank computes
    started = time.perf_counter()
    bar = tqdm(total=4 + len(specs), desc="lowband plan", unit="step", file=sys.stderr, disable=not write)
    try:

        def say(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update(1)

        profile = measure_profile(
            ns.workload,
            batch_size=ns.batch_size,
            seed=ns.seed,
            compute_scale=scale,
            progress=say,
            group=group,
        )
        entries = []
        for spec in specs:
            bar.set_postfix_str(spec)
            entries.append(planner.Entry(spec, planner.predict_spec(spec, profile, links)))
            bar.update(1)
        ranked = planner.make_plan_from(entries)
        bar.set_postfix_str("done")
        bar.update(1)
    finally:
        bar.close()
        torch.set_num_threads(threads)
    if not write:
        return 0
    recommended = planner.recommend(ranked, accept)
    plan = {
        "workload": ns.workload,
        "world_size": world,
        "links": {
            "label": links.label,
            "bandwidth_bytes_s": links.bandwidth,
            "latency_s": links.latency,
            "ranks_per_machine": ns.ranks_per_machine,
            **measured,
        },
        "profile": profile.to_json(),
        "acceptance": {k: v for k, v in vars(accept).items()},
        "recommended": recommended,
        "strategies": [e.to_json() for e in ranked],
        "plan_seconds": time.perf_counter() - started,
    }
    paths = report.write(out, plan, ranked)
    print(report.terminal_table(ranked, recommended))
    print(f"recommended: {recommended or 'none (no modelled strategy is accepted)'}")
    print("written: " + "  ".join(str(p) for p in paths))
    return 0
