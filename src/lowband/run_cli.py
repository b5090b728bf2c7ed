"""``lowband run``: a user's script on N ranks.

Without a link option it is torchrun with lowband's defaults (:func:`lowband.torchrun.run_command`:
one machine with its store on 127.0.0.1, or torchrun's multi-host rendezvous). With one (``--rate``,
``--rates``, ``--ranks-per-machine``, ``--intra-rate``, ``--delay-ms``, ``--mode``) the ranks run inside
the testbed's emulated links (:func:`lowband.testbed.run.run_script`), as ``lowband bench`` runs its
ranks, and the bytes each link carried are printed at the end.

Either way, before anything starts: each rank computes with ``cores // ranks`` threads
(``OMP_NUM_THREADS``, as the bench and torchrun limit them; a value in the environment wins, with a
warning), and ranks this machine cannot hold are refused (the bench's check, ``--force`` overrides).
A failed run ends with one line per distinct cause; every rank's output and traceback are in
``--log-dir``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from lowband.errors import InvalidArgumentError, LowbandError
from lowband.testbed.links import DEFAULT_MTU, Layout, build_layout, check_mtu, parse_rate
from lowband.testbed.schedule import add_rate_change_option, check_spec

LINK_OPTIONS = ("rate", "rates", "ranks_per_machine", "intra_rate", "delay_ms", "mtu", "mode", "rate_change")
#: torchrun's options that only make sense without the testbed (it emulates every machine here)
HOST_OPTIONS = (
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "rdzv_backend",
    "rdzv_id",
    "local_addr",
    "master_addr",
    "master_port",
)

DESCRIPTION = """\
Run SCRIPT on N ranks; the script calls lowband.init() (or torch.distributed.init_process_group).

  lowband run -n 4 train.py --lr 0.1                  torchrun underneath, one machine
  lowband run -n 4 --rate 100mbit train.py            every rank behind its own 100 Mbit/s link
  lowband run -n 8 --ranks-per-machine 4 --rate 1gbit --intra-rate 10gbit train.py
  lowband run -n 4 --nnodes 2 --rdzv-endpoint HOST:29400 train.py    on each of 2 hosts
  lowband run -n 4 --rate 100mbit --keep-going train.py  a lost rank does not stop the others

A link option (--rate, --rates, --ranks-per-machine, --intra-rate, --delay-ms, --mtu, --mode) runs the ranks
in the testbed: network namespaces joined by rate-limited links, as `lowband bench` uses (needs root;
otherwise plain loopback, labelled UNSHAPED). At the end it prints the bytes each rank (each machine,
when ranks share one) sent and received: the kernel's counters of its link, so everything the script
sent counts, framing and rendezvous included. Ctrl-C, a failed rank or an error remove every rank and
namespace."""

EPILOG = """\
Other torchrun options (--rdzv-conf, --monitor-interval, ...) are passed to torchrun as given, without a
link option. With --rdzv-endpoint and no --rdzv-backend the rendezvous is torchrun's c10d."""


class UsageError(Exception):
    """A wrong command line: one line for stderr; the command exits with status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one :class:`UsageError` line naming ``--help`` (the command
    prints it on stderr and exits with status 2), never a usage block."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def rate_arg(value: str) -> str | None:
    """A link-rate option's value (``lowband run`` and ``lowband bench``): checked as tc would read it
    (:func:`~lowband.testbed.rates.parse_rate`), ``none``/``0`` for unshaped."""
    if value.strip().lower() in ("none", "unshaped", "unlimited", "inf", "0"):
        return None
    try:
        parse_rate(value)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("testbed rate: ")) from exc
    return value


def count_arg(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of ranks >= 1, got {value!r}")
    return int(value)


def seconds_arg(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = float("nan")
    if not s > 0 or s == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return s


def add_timeout(p: argparse.ArgumentParser | Any, default: float | None) -> None:
    """The communication timeout option shared by ``lowband run`` and ``lowband bench``."""
    said = "lowband's default, 120 s, or LOWBAND_TIMEOUT" if default is None else f"{default:g} s"
    p.add_argument(
        "--timeout", type=seconds_arg, default=default, metavar="SECONDS",
        help="communication timeout: a rank waiting longer than this on another (a stopped or dead "
        f"rank) fails with a lowband error, and the run ends (default: {said})",
    )  # fmt: skip


def add_link_options(links: Any) -> None:
    """The testbed's link options, shared by ``lowband run`` and ``lowband testbed up``."""
    links.add_argument(
        "--rate", type=rate_arg, help="link rate of every emulated machine, e.g. 100mbit, 1gbit"
    )
    links.add_argument(
        "--rates", help="one rate per machine, comma separated, e.g. 1gbit,100mbit (heterogeneous)"
    )
    links.add_argument(
        "--ranks-per-machine", type=count_arg, metavar="K",
        help="K ranks share each emulated machine and its link (two-tier; default 1)",
    )  # fmt: skip
    links.add_argument(
        "--intra-rate", type=rate_arg, help="rate between ranks of one machine (default unshaped)"
    )
    links.add_argument(
        "--delay-ms", "--delay", type=float, metavar="MS",
        help="one-way delay added to every machine's link, in ms (needs iptables and NetfilterQueue)",
    )  # fmt: skip
    links.add_argument(
        "--mtu", type=int, default=DEFAULT_MTU, help=f"MTU of the emulated links (default {DEFAULT_MTU})"
    )
    links.add_argument(
        "--mode", choices=["auto", "netns", "loopback"],
        help="auto: namespaces when root, else loopback (UNSHAPED); netns: fail without them; loopback: never shape",
    )  # fmt: skip


def run_parser(with_script: bool = True) -> argparse.ArgumentParser:
    """The ``lowband run`` parser (its ``--help`` page); ``with_script=False`` leaves the positionals out
    (the options before the script are parsed on their own, see :func:`split_argv`)."""
    p = OneLineParser(
        prog="lowband run",
        allow_abbrev=False,  # an abbreviation could take one of torchrun's options for lowband's
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-n", "--nproc-per-node", "--nproc_per_node", "--nprocs", "--np", dest="nproc", type=count_arg,
        metavar="N", help="ranks on this machine; with a link option, ranks in all (over every emulated machine)",
    )  # fmt: skip
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m SCRIPT)")
    add_timeout(p, None)
    p.add_argument(
        "--log-dir", "--log_dir", metavar="DIR",
        help="each rank's log, DIR/rankR.log: its Python output and, if it fails, its full traceback "
        "(default: a temporary folder, kept and printed when a rank fails)",
    )  # fmt: skip
    p.add_argument(
        "--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=None, metavar="N",
        help="restart every rank up to N times after one fails (torchrun's elastic agent; with a link option "
        "the ranks are restarted in the testbed); the script resumes through lowband.checkpoint.Checkpointer",
    )  # fmt: skip
    p.add_argument(
        "--keep-going", "--keep_going", dest="keep_going", action="store_true",
        help="a rank that fails or dies does not stop the others: a script whose strategy has "
        "on_peer_loss=continue trains on without it (one machine; lowband runs the ranks itself, and hosts "
        "the rendezvous store so that it outlives every rank); the run succeeds if one rank does",
    )  # fmt: skip
    p.add_argument(
        "--replacements", type=int, default=0, metavar="N",
        help="with --keep-going: start a new process in place of a rank that failed, up to N times in all; it "
        "joins the survivors at their next exchange with a live peer's state (on_peer_loss=continue)",
    )  # fmt: skip
    p.add_argument(
        "--force", action="store_true",
        help="start the ranks even where the estimate of their memory or cores exceeds this machine",
    )  # fmt: skip
    links = p.add_argument_group("emulated links (the testbed)")
    add_link_options(links)
    add_rate_change_option(links)
    links.add_argument(
        "--grace", type=seconds_arg, default=10.0, metavar="SECONDS",
        help="after a rank fails, the others get SECONDS to end by themselves before they are stopped (default 10)",
    )  # fmt: skip
    links.add_argument(
        "--time-limit", type=seconds_arg, metavar="SECONDS", help="stop every rank after SECONDS"
    )
    links.add_argument(
        "--report", metavar="PATH", help="also write the byte counters and exit codes as JSON to PATH"
    )
    hosts = p.add_argument_group("several machines (torchrun's, without a link option)")
    hosts.add_argument("--nnodes", help="number of machines (torchrun's MIN[:MAX])")
    hosts.add_argument("--node-rank", "--node_rank", help="this machine's rank (static rendezvous)")
    hosts.add_argument(
        "--rdzv-endpoint", "--rdzv_endpoint", metavar="HOST:PORT",
        help="rendezvous store of the job: one host's address and a free port, the same on every machine",
    )  # fmt: skip
    hosts.add_argument(
        "--rdzv-backend", "--rdzv_backend", help="rendezvous backend (default c10d with --rdzv-endpoint)"
    )
    hosts.add_argument("--rdzv-id", "--rdzv_id", help="job id, the same on every machine")
    hosts.add_argument(
        "--local-addr", "--local_addr", metavar="ADDR",
        help="this machine's address as the others reach it (default: its hostname's)",
    )  # fmt: skip
    hosts.add_argument("--master-addr", "--master_addr", help="static rendezvous: the address of node rank 0")
    hosts.add_argument("--master-port", "--master_port", help="static rendezvous: its port")
    hosts.add_argument(
        "--standalone", action="store_true", help="one machine (the default without the above)"
    )
    if with_script:
        p.add_argument("script", help="the training script (or module, with -m)")
        p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


def split_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """``(options, [script, *script args])``: the script is the first word that is not an option or an
    option's value (lowband's options and torchrun's)."""
    from torch.distributed.run import get_args_parser

    takes = {
        o
        for p in (parser, get_args_parser())
        for action in p._actions
        for o in action.option_strings
        if action.nargs != 0
    }
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if not a.startswith("-"):
            return list(argv[:i]), list(argv[i:])
        i += 2 if a in takes else 1
    return list(argv), []


def _torchrun_argv(ns: argparse.Namespace, passthrough: list[str], rest: list[str]) -> list[str]:
    out = [] if ns.nproc is None else ["--nproc-per-node", str(ns.nproc)]
    for name in HOST_OPTIONS:
        value = getattr(ns, name)
        if value is not None:
            out += ["--" + name.replace("_", "-"), value]
    if ns.rdzv_endpoint and ns.rdzv_backend is None:
        out += ["--rdzv-backend", "c10d"]
    out += ["--standalone"] if ns.standalone else []
    out += [] if ns.max_restarts is None else ["--max-restarts", str(ns.max_restarts)]
    return out + passthrough + (["-m"] if ns.module else []) + rest


def main(argv: Sequence[str]) -> int:
    """``lowband run ...``; returns the exit status (2 for a wrong command line, before anything starts)."""
    try:
        return _main(argv)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    except LowbandError as exc:  # the launch itself failed (a rendezvous, the testbed): one line
        print(str(exc) if str(exc).startswith("lowband") else f"lowband run: {exc}", file=sys.stderr)
        return 1


def _main(argv: Sequence[str]) -> int:
    parser = run_parser(with_script=False)
    opts, rest = split_argv(argv, parser)
    if not argv or any(o in ("-h", "--help") for o in opts):
        run_parser().print_help()
        return 0 if argv else 2
    ns, passthrough = parser.parse_known_args(opts)
    if not rest:
        parser.error("give the script to run")
    link_flags = {o for a in parser._actions if a.dest in LINK_OPTIONS for o in a.option_strings}
    testbed = any(o.partition("=")[0] in link_flags for o in opts)  # `--rate none` counts
    if ns.timeout is not None:
        os.environ["LOWBAND_TIMEOUT"] = f"{ns.timeout:g}"  # read by lowband.init on every rank
    if ns.max_restarts is not None and ns.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {ns.max_restarts}")
    if ns.nproc is not None:
        from lowband.devices import check_ranks

        try:  # every rank binds one GPU (lowband.devices): too many ranks for the GPUs fail here, once
            check_ranks(ns.nproc, None, None, "lowband run")
        except InvalidArgumentError as exc:
            parser.error(str(exc).removeprefix("lowband run: "))
    if ns.replacements and not ns.keep_going:
        parser.error("--replacements goes with --keep-going (a replacement joins ranks that went on)")
    if ns.replacements < 0:
        parser.error(f"--replacements must be >= 0, got {ns.replacements}")
    if ns.keep_going and ns.max_restarts is not None:
        parser.error("--keep-going and --max-restarts: choose one (survivors go on, or every rank restarts)")
    if ns.keep_going and not testbed:
        hosts = [f"--{k.replace('_', '-')}" for k in HOST_OPTIONS if getattr(ns, k) is not None]
        if hosts or passthrough:
            parser.error(
                f"--keep-going with {' '.join(hosts + passthrough)}: --keep-going runs every rank on this "
                "machine (torchrun's agent, which the other options need, stops every rank once one fails)"
            )
        ns.mode, ns.standalone = (
            "loopback",
            False,
        )  # lowband starts the ranks itself, as the testbed's loopback mode
    if not testbed and not ns.keep_going:
        if ns.report or ns.time_limit:
            parser.error("--report and --time-limit go with a link option (--rate, ...)")
        torchrun_argv = _torchrun_argv(ns, passthrough, rest)
        env = rank_threads(ns.nproc or 1, ns.force)
        from lowband.torchrun import run_command

        try:
            return run_command(torchrun_argv, log_dir=ns.log_dir, env=env)
        except InvalidArgumentError as exc:
            parser.error(str(exc).removeprefix("lowband run: "))
    hosts = [f"--{k.replace('_', '-')}" for k in HOST_OPTIONS if getattr(ns, k) is not None]
    extra = hosts + passthrough + (["--standalone"] if ns.standalone else [])
    if extra:
        parser.error(
            f"{' '.join(extra)}: not with a link option (the testbed emulates every machine on this one; "
            "torchrun's options apply without --rate)"
        )
    if ns.nproc is None:
        parser.error("-n N: give the number of ranks")
    layout = layout_from_args(ns, parser)
    from lowband.testbed.run import run_script

    script = ["-m", *rest] if ns.module else rest
    if not ns.module and not os.path.exists(rest[0]):
        parser.error(f"no script {rest[0]!r}")
    env = rank_threads(ns.nproc, ns.force)
    try:
        return run_script(
            layout, script, mode=ns.mode or "auto", mtu=ns.mtu, time_limit=ns.time_limit, report=ns.report,
            grace=ns.grace, env=env, log_dir=ns.log_dir, max_restarts=ns.max_restarts or 0,
            keep_going=ns.keep_going, replacements=ns.replacements, rate_change=ns.rate_change,
        )  # fmt: skip
    except KeyboardInterrupt:
        print("lowband run: interrupted; every rank stopped and the testbed removed", file=sys.stderr)
        return 130


def rank_threads(ranks: int, force: bool) -> dict[str, str]:
    """The environment that gives each of ``ranks`` rank processes on this machine its threads
    (``OMP_NUM_THREADS`` = cores // ranks, at least 1, :func:`~lowband.bench.resources.threads_per_rank`),
    after the bench's resource check (:class:`UsageError` naming ``--force``, unless ``force``). A value
    already in the environment is the user's: kept, with a warning when it differs."""
    from lowband.bench.resources import check_resources, machine, rank_bytes, threads_per_rank

    m = machine()
    ours = threads_per_rank(ranks, m.cores)
    theirs = os.environ.get("OMP_NUM_THREADS", "").strip()
    threads = int(theirs) if theirs.isdigit() and int(theirs) > 0 else ours
    if not force:
        try:  # the script's model is unknown here: torch's own footprint per rank
            check_resources(ranks, threads, rank_bytes(0), m, f"lowband run -n {ranks}", force="--force")
        except InvalidArgumentError as exc:
            raise UsageError(str(exc)) from exc
    if not theirs:
        return {"OMP_NUM_THREADS": str(ours)}
    if theirs != str(ours):
        print(
            f"lowband run: warning: OMP_NUM_THREADS={theirs} from your environment: {ranks} rank(s) x "
            f"{theirs} thread(s) on {m.cores} core(s), where lowband would give each rank {ours} (cores // "
            "ranks); ranks that together want more threads than there are cores preempt each other and "
            "steps measure the scheduler (unset OMP_NUM_THREADS to get lowband's)",
            file=sys.stderr,
        )
    return {}


def layout_from_args(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> Layout:
    """The layout of :func:`add_link_options`' options for ``ns.nproc`` ranks, or a one-line error
    (an unusable delay included: what to install)."""
    try:
        check_mtu("--mtu", ns.mtu)
        layout = build_layout(
            ns.nproc,
            rate=ns.rate,
            rates=ns.rates.split(",") if ns.rates else None,
            ranks_per_machine=ns.ranks_per_machine or 1,
            intra_rate=ns.intra_rate,
            delay_ms=ns.delay_ms or 0.0,
            where="--ranks-per-machine/--rates",
        )
        if layout.machines[0].delay_ms > 0 and (ns.mode or "auto") != "loopback":
            from lowband.testbed.delay import require_delay

            require_delay()
        check_spec(getattr(ns, "rate_change", None), layout, ns.mode or "auto")
    except InvalidArgumentError as exc:
        parser.error(str(exc).replace("testbed rate: ", "--rates: ", 1).removeprefix("testbed "))
    except LowbandError as exc:  # the delay's missing packages: what to install, in one line
        parser.error(str(exc).removeprefix("lowband.testbed: "))
    return layout
