"""``lowband testbed clean`` and ``lowband testbed status``."""

from __future__ import annotations

import argparse

from lowband.errors import LowbandError
from lowband.testbed.netns import clean, list_testbeds


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``testbed`` command (with ``clean`` and ``status``) to the ``lowband`` parser."""
    p = sub.add_parser("testbed", help="emulated-link testbed: list or clean its network namespaces")
    tsub = p.add_subparsers(dest="testbed_cmd", required=True)
    for name, text in (
        ("clean", "remove namespaces (and links) left by testbeds whose owner process is dead"),
        ("status", "list testbed namespaces, their owner pid and whether it is alive"),
    ):
        q = tsub.add_parser(name, help=text, description=text)
        q.add_argument("--prefix", default="lb", help="namespace name prefix (default: lb)")


def main(ns: argparse.Namespace) -> int:
    """Run ``lowband testbed clean|status``; returns the exit status."""
    try:
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
    except LowbandError as e:
        print(f"lowband testbed {ns.testbed_cmd}: {e}")
        return 1
