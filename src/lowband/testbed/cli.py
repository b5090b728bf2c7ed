"""``lowband testbed up|down|status|clean``.

``up`` builds a testbed and holds it in the foreground (its namespaces are named after this process,
so they live while it does), printing each rank's command line; Ctrl-C, or ``lowband testbed down``
from another terminal, removes everything it made. ``status`` lists testbed namespaces, ``clean``
removes those whose owner died.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lowband.errors import LowbandError
from lowband.testbed.leftovers import _pid_alive
from lowband.testbed.netns import clean, list_testbeds

#: where each ``testbed up`` process leaves its pid, for ``testbed down``
UP_DIR = Path(tempfile.gettempdir()) / "lowband-testbed-up"
_ENV_SHOWN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``testbed`` command (``up``, ``down``, ``status``, ``clean``) to the ``lowband`` parser."""
    from lowband.run_cli import add_link_options, count_arg

    p = sub.add_parser(
        "testbed", help="emulated-link testbed: hold one up for interactive use, list or clean namespaces"
    )
    tsub = p.add_subparsers(dest="testbed_cmd", required=True)
    for name, text in (
        ("clean", "remove namespaces (and links) left by testbeds whose owner process is dead"),
        ("status", "list testbed namespaces, their owner pid and whether it is alive"),
    ):
        q = tsub.add_parser(name, help=text, description=text)
        q.add_argument("--prefix", default="lb", help="namespace name prefix (default: lb)")
    text = "build emulated links and hold them until Ctrl-C or `lowband testbed down` (prints each rank's command)"
    up = tsub.add_parser("up", help=text, description=text)
    up.add_argument("-n", dest="nproc", type=count_arg, required=True, metavar="N", help="ranks in all")
    add_link_options(up)
    text = "remove the testbeds that `lowband testbed up` holds (stops those processes)"
    tsub.add_parser("down", help=text, description=text)


def main(ns: argparse.Namespace) -> int:
    """Run ``lowband testbed ...``; returns the exit status."""
    from lowband.run_cli import UsageError

    try:
        if ns.testbed_cmd == "up":
            return _up(ns)
        if ns.testbed_cmd == "down":
            return _down()
        if ns.testbed_cmd == "clean":
            removed = clean(ns.prefix)
            for name in removed:
                print(f"removed {name}")
            print(f"{len(removed)} namespace{'s' if len(removed) != 1 else ''} removed")
            return 0
        infos = list_testbeds(ns.prefix)
        if not infos:
            print("no testbed namespaces")
        for info in infos:
            print(
                f"{info.name}  owner pid {info.owner_pid}  {'alive' if info.alive else 'DEAD (clean removes it)'}"
            )
        return 0
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except LowbandError as e:
        print(f"lowband testbed {ns.testbed_cmd}: {e}", file=sys.stderr)
        return 1


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _up(ns: argparse.Namespace) -> int:
    from lowband.run_cli import OneLineParser, layout_from_args
    from lowband.testbed.netns import Testbed

    layout = layout_from_args(ns, OneLineParser(prog="lowband testbed up"))
    prev = signal.signal(signal.SIGTERM, _stop)  # `testbed down`: tear down as Ctrl-C does
    pidfile = UP_DIR / str(os.getpid())
    try:
        with Testbed(layout, mode=ns.mode or "auto", mtu=ns.mtu) as tb:
            UP_DIR.mkdir(parents=True, exist_ok=True)
            pidfile.write_text(tb.base)
            print(f"lowband testbed up: {tb.label()}")
            for m, name in enumerate(tb.namespaces()[:-1]):
                print(f"  machine {m}: namespace {name}, address {tb.address(m)}, interface {tb.ifname(0)}")
            print("run rank R of your script (as root) with:")
            for r in range(layout.world_size):
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in tb.rank_env(r).items() if k in _ENV_SHOWN)
                env += f" GLOO_SOCKET_IFNAME={tb.ifname(r)}"
                where = f"ip netns exec {tb.machine_ns(layout.machine_of(r))} " if tb.shaped else ""
                print(f"  {where}env {env} python train.py")
            print("(or `lowband run` with the same options, which starts them for you)")
            print("Ctrl-C or `lowband testbed down` removes the testbed.", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("lowband testbed up: removed", flush=True)
        return 0
    finally:
        pidfile.unlink(missing_ok=True)
        signal.signal(signal.SIGTERM, prev)


def _down(wait_s: float = 20.0) -> int:
    """SIGTERM every live ``testbed up`` process and wait until it has removed its testbed."""
    pids = [int(p.name) for p in UP_DIR.glob("*") if p.name.isdigit()] if UP_DIR.exists() else []
    live = [pid for pid in pids if _pid_alive(pid)]
    for pid in set(pids) - set(live):
        (UP_DIR / str(pid)).unlink(missing_ok=True)
    for pid in live:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while any(_pid_alive(pid) for pid in live) and time.monotonic() < deadline:
        time.sleep(0.1)
    stuck = [pid for pid in live if _pid_alive(pid)]
    if stuck:
        raise LowbandError(f"`testbed up` processes {stuck} still run {wait_s:g} s after SIGTERM")
    print(f"{len(live)} testbed{'s' if len(live) != 1 else ''} removed")
    return 0
