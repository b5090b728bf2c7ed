"""``lowband bench`` and ``lowband demo`` argument parsing."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowband.bench.config import TIME_LIMIT_S, BenchConfig
from lowband.errors import InvalidArgumentError, LowbandError
from lowband.registry import Registry
from lowband.run_cli import add_timeout, rate_arg, seconds_arg
from lowband.testbed.schedule import add_rate_change_option


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = sub.add_parser(
        "bench",
        help="train several strategies side by side on emulated slow links and compare them",
        description="Strategies alternate in rounds inside one set of rank processes; results as JSON, "
        "PNG plots and a Markdown table.",
    )
    _common(b, BenchConfig())
    b.add_argument(
        "--sweep-rates", default=None, help="comma list of link rates for a sweep, e.g. 10mbit,100mbit,1gbit"
    )
    b.add_argument(
        "--sweep-world-sizes", default=None, help="comma list of world sizes for a sweep, e.g. 2,3,4"
    )
    b.add_argument(
        "--collectives", default=None,
        help="time these communication ops instead of training, separated by '+', e.g. "
        "allreduce+neighbor_allreduce:topology=ring+neighbor_allreduce:topology=dynamic-exp2",
    )  # fmt: skip
    b.add_argument("--sizes", default="1MB,4MB,16MB", help="message sizes for --collectives (1MB, 4MiB, ...)")
    b.add_argument("--reps", type=int, default=5, help="timed ops per op, size and round for --collectives")
    b.add_argument("--list", action="store_true", help="list workloads, strategies and collectives and exit")
    b.add_argument(
        "--replot", metavar="DIR", default=None,
        help="redraw the plots and results.md of the finished run in DIR from DIR/results.json and exit",
    )  # fmt: skip
    d = sub.add_parser(
        "demo",
        help="the main job: every strategy on one rank per core (2-4 ranks) over 100 Mbit/s links (~2-3 min)",
    )
    _common(d, demo_config())


def _common(p: argparse.ArgumentParser, dflt: BenchConfig) -> None:
    p.add_argument(
        "-w", "--workload", default=dflt.workload,
        help=f"a registered workload (--list) or your own: module:factory or path/to/file.py:factory "
        f"(examples/my_workload.py; default {dflt.workload})",
    )  # fmt: skip
    p.add_argument(
        "-s", "--strategies", default="+".join(dflt.strategies) if dflt.strategies else None,
        help="strategies separated by '+', each name[:key=value,...] (default: "
        + ("every registered strategy" if not dflt.strategies else "+".join(dflt.strategies)) + ")",
    )  # fmt: skip
    p.add_argument(
        "-n", "--world-size", type=int, default=dflt.world_size, help=f"ranks (default {dflt.world_size})"
    )
    p.add_argument(
        "--rate", type=rate_arg, default=dflt.rate, help="per-rank link rate, e.g. 100mbit; 'none' = unshaped"
    )
    p.add_argument("--rates", default=None, help="heterogeneous: one rate per machine, comma separated")
    p.add_argument(
        "--ranks-per-machine", type=int, default=1, help="two-tier layout: ranks sharing a fast machine link"
    )
    p.add_argument("--intra-rate", type=rate_arg, default=None, help="rate inside a machine (two-tier)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per rank (NFQUEUE delayer)")
    add_rate_change_option(p)
    p.add_argument(
        "--mtu",
        type=int,
        default=dflt.mtu,
        help=f"MTU of the emulated links (default {dflt.mtu}, jumbo frames)",
    )
    p.add_argument(
        "--mode", choices=["auto", "netns", "loopback"], default="auto",
        help="auto: namespaces when root, else loopback (UNSHAPED); netns: fail without them; loopback: never shape",
    )  # fmt: skip
    p.add_argument(
        "--rounds", type=int, default=dflt.rounds,
        help=f"rounds; in each, every strategy trains --steps-per-round steps in turn (default {dflt.rounds})",
    )  # fmt: skip
    p.add_argument(
        "--steps-per-round", type=int, default=dflt.steps_per_round,
        help=f"steps of one strategy per round (default {dflt.steps_per_round})",
    )  # fmt: skip
    p.add_argument(
        "--warmup-rounds", type=int, default=dflt.warmup_rounds,
        help=f"first rounds left out of the timings (default {dflt.warmup_rounds})",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=None, help="batch per rank (default: the workload's)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the workload's)")
    p.add_argument(
        "--target-loss", type=float, default=None,
        help="time-to-target loss (default: chosen from the runs, see results.md)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of models and data (default 0)")
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default=dflt.device,
        help="where each rank computes: cuda = cuda:LOCAL_RANK (an error where CUDA is missing), auto = cuda "
        f"when available, else cpu (default {dflt.device}); models, the compute-only copy and batches go there",
    )  # fmt: skip
    p.add_argument(
        "--precision", choices=["fp32", "bf16", "fp16"], default=dflt.precision,
        help="fp32, or bf16 / fp16 autocast of forward and loss with float32 parameters (gradients and "
        "strategy state stay float32); fp16 adds a GradScaler, gradients unscaled before compression and "
        "clipping, overflowed steps skipped on every rank; strategies that cannot do that are refused "
        f"(default {dflt.precision})",
    )  # fmt: skip
    add_timeout(p, dflt.comm_timeout)
    p.add_argument(
        "--eval-items", type=int, default=dflt.eval_items,
        help=f"held-out items evaluated after each round (default {dflt.eval_items}; 0 = the whole test set)",
    )  # fmt: skip
    p.add_argument("--out", default=None, help="output folder (default results/<command>-<time>)")
    p.add_argument(
        "--log-dir", default=None, metavar="DIR",
        help="each rank's log, DIR/rankR.log: its output and, if it fails, its full traceback (default "
        "OUT/logs; a failed run prints one line per distinct cause and this folder)",
    )  # fmt: skip
    p.add_argument(
        "--time-limit", type=seconds_arg, default=TIME_LIMIT_S, metavar="SECONDS",
        help="wall-clock cap on the whole bench, a backstop behind the communication --timeout: the ranks "
        f"are killed when it passes and nothing is saved (default {TIME_LIMIT_S:g} s)",
    )  # fmt: skip
    p.add_argument(
        "--force", action="store_true",
        help="start the ranks even where the estimate of their memory or cores exceeds this machine",
    )  # fmt: skip


def config_from_args(ns: argparse.Namespace, cmd: str) -> BenchConfig:
    from lowband.strategies import strategy_names

    strategies = ns.strategies.split("+") if ns.strategies else strategy_names()
    collectives = getattr(ns, "collectives", None)
    extra: dict[str, object] = {}
    if collectives:
        from lowband.bench.collectives import parse_size

        extra = {
            "collectives": collectives.split("+"),
            "sizes": [parse_size(x) for x in ns.sizes.split(",")],
            "reps": ns.reps,
        }
    out = ns.out or str(Path("results") / f"{cmd}-{time.strftime('%Y%m%d-%H%M%S')}")
    return BenchConfig(
        workload=ns.workload,
        strategies=strategies,
        world_size=ns.world_size,
        rate=ns.rate,
        rates=ns.rates.split(",") if ns.rates else None,
        ranks_per_machine=ns.ranks_per_machine,
        intra_rate=ns.intra_rate,
        delay_ms=ns.delay_ms,
        mtu=ns.mtu,
        mode=ns.mode,
        rounds=ns.rounds,
        steps_per_round=ns.steps_per_round,
        warmup_rounds=ns.warmup_rounds,
        batch_size=ns.batch_size,
        lr=ns.lr,
        target_loss=ns.target_loss,
        seed=ns.seed,
        eval_items=ns.eval_items,
        device=ns.device,
        precision=ns.precision,
        comm_timeout=ns.timeout,
        out_dir=out,
        rate_change=ns.rate_change,
        **extra,  # type: ignore[arg-type]
    )


DEMO_STRATEGIES = ["ddp", "powersgd", "localsgd:period=5", "dreamddp:period=5", "atc:topology=dynamic-exp2"]


def demo_ranks(cores: int) -> int:
    """The demo's ranks on a machine of ``cores`` cores: one per core, 2 to 4. Ranks sharing a core
    compete with each other's communication threads, so communication overlapped with computation (what
    DreamDDP schedules) slows down several-fold there (the profile's measured sigma: 0.4-14 over ten demo
    runs of 4 ranks on 2 cores, 0.0 with 2 ranks); ``-n 4`` runs 4 anyway."""
    return min(4, max(2, cores))


def demo_config() -> BenchConfig:
    """The demo: the image workload, one rank per core (2-4) on 100 Mbit/s, the baselines and one
    strategy of each implemented system (``-s`` picks others; ``lowband bench --list`` lists them all)."""
    from lowband.bench.resources import machine

    return BenchConfig(
        workload="fmnist-cnn",
        strategies=list(DEMO_STRATEGIES),
        world_size=demo_ranks(machine().cores),
        rate="100mbit",
        rounds=4,
        steps_per_round=20,
    )


def _print_results(res: dict[str, object]) -> None:
    print()
    print(res.get("terminal", res["markdown"]))
    out = Path(str(res["config"]["out_dir"]))  # type: ignore[index]
    print(f"results: {out / 'results.json'}  table: {out / 'results.md'}")
    print("plots:   " + "  ".join(str(p) for p in res["plots"]))  # type: ignore[attr-defined]


def _user_errors(cmd: str, main: Callable[[argparse.Namespace], int], ns: argparse.Namespace) -> int:
    """A wrong argument or a refused run (too many ranks for the machine): its message, exit code 2
    (before anything starts); a failed run: its message, exit code 1."""
    try:
        return main(ns)
    except InvalidArgumentError as e:
        msg = str(e)
        print(msg if msg.startswith("lowband ") else f"lowband {cmd}: {msg}", file=sys.stderr)
        return 2
    except LowbandError as e:
        msg = str(e)
        print(msg if msg.startswith("lowband ") else f"lowband {cmd}: {msg}", file=sys.stderr)
        return 1


def main_bench(ns: argparse.Namespace) -> int:
    return _user_errors("bench", _bench, ns)


def main_demo(ns: argparse.Namespace) -> int:
    return _user_errors("demo", _demo, ns)


def _bench(ns: argparse.Namespace) -> int:
    if ns.replot is not None:  # nothing runs: no testbed, no ranks
        from lowband.bench.report import replot

        print("written: " + "  ".join(str(p) for p in replot(Path(ns.replot))))
        return 0
    from lowband.bench.runner import run_bench, run_sweep
    from lowband.bench.workloads import WORKLOADS
    from lowband.strategies.registry import COMMON_OPTIONS, STRATEGIES

    if ns.list:
        print("workloads (-w NAME, or a user's module:factory / file.py:factory):")
        _list(WORKLOADS)
        print("strategies (-s NAME:key=value,...; every strategy also takes the common options):")
        _list(STRATEGIES)
        print("  common options:")
        for line in COMMON_OPTIONS.help():
            print(f"      {line}")
        _list_compression()
        from lowband.bench.collectives import COLLECTIVES

        print("collectives (--collectives NAME[:key=value,...]):")
        _list(COLLECTIVES)
        return 0
    cfg = config_from_args(ns, "bench")
    if ns.sweep_rates or ns.sweep_world_sizes:
        if cfg.rate_change:
            raise InvalidArgumentError(
                "--rate-change goes with one bench, not with --sweep-rates/--sweep-world-sizes"
            )
        try:
            rates = [rate_arg(r) for r in ns.sweep_rates.split(",")] if ns.sweep_rates else [cfg.rate]
        except argparse.ArgumentTypeError as e:
            raise InvalidArgumentError(f"--sweep-rates: {e}") from e
        try:
            sizes = (
                [int(s) for s in ns.sweep_world_sizes.split(",")]
                if ns.sweep_world_sizes
                else [cfg.world_size]
            )
        except ValueError as e:
            raise InvalidArgumentError(f"--sweep-world-sizes: expected ints, e.g. 2,3,4 ({e})") from e
        res = run_sweep(cfg, rates, sizes, timeout=ns.time_limit, force=ns.force, log_dir=ns.log_dir)
        print(res["table"])
        print(f"sweep results: {Path(cfg.out_dir) / 'sweep.json'}")
        return 0
    _print_results(run_bench(cfg, timeout=ns.time_limit, force=ns.force, log_dir=ns.log_dir))
    return 0


def _list(registry: Registry[Any], skip: tuple[str, ...] = ()) -> None:
    """Each item of ``registry``: its name and description, then one line per option (its default,
    what it takes, its doc: the schema every check uses, :mod:`lowband.options`)."""
    from lowband.bench.validate import help_options

    for k, v in registry.descriptions().items():
        print(f"  {k:12s} {v}")
        for line in help_options(registry, k):
            if not line.startswith(skip):
                print(f"      {line}")


def _list_compression() -> None:
    """What the ``compressed`` strategy can be given: compressors, memories, transports."""
    from lowband.compress import COMPRESSORS, MEMORIES, TRANSPORTS

    print("    e.g. -s \"ddp+compressed:compressor=fp16,reducer=allreduce\" (nested options with ';': "
          "compressor=NAME:key=v;key=v)")  # fmt: skip
    print("compressors (compressed:compressor=NAME[:key=value;...]):")
    _list(COMPRESSORS)
    print("memories (compressed:memory=NAME[:key=value;...]):")
    _list(MEMORIES)
    print(
        "transports (compressed:reducer=NAME[:key=value;...]; auto = allreduce if the format sums on the "
        "wire, else allgather):"
    )
    _list(TRANSPORTS, skip=("seed=",))


def _demo(ns: argparse.Namespace) -> int:
    from lowband.bench.runner import run_bench

    cfg = config_from_args(ns, "demo")
    print(
        f"lowband demo: {cfg.workload} on {cfg.world_size} ranks, links {cfg.rate or 'unshaped'} per rank; "
        f"strategies: {', '.join(cfg.strategies)}; {cfg.rounds} rounds x {cfg.steps_per_round} steps each, alternated"
    )
    _print_results(run_bench(cfg, timeout=ns.time_limit, force=ns.force, log_dir=ns.log_dir))
    return 0
