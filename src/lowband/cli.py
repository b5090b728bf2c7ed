"""The ``lowband`` command: ``lowband run`` (launch a script on N ranks) and ``lowband demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowband", description="Training PyTorch models over slow links.")
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser(
        "run",
        help="run a script on N ranks (torchrun underneath)",
        description="lowband run -n N [torchrun options] script.py [script args]: the script calls lowband.init().",
        add_help=False,
    )
    run.add_argument("rest", nargs=argparse.REMAINDER)
    demo = sub.add_parser("demo", help="the main job: a real small multi-rank run, checked against an oracle")
    demo.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    demo.add_argument("--steps", type=int, default=30, help="rounds of ring averaging (default 30)")
    demo.add_argument("--numel", type=int, default=1 << 16, help="elements per rank (default 65536)")
    sub.add_parser("version", help="print the version")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["run"]:
        rest = args[1:]
        if not rest or rest[0] in ("-h", "--help"):
            print("usage: lowband run -n N [torchrun options] script.py [script args]")
            return 0 if rest else 2
        from lowband.launcher import run_command

        return run_command(rest)
    ns = _parser().parse_args(args)
    if ns.cmd == "demo":
        from lowband.demo import main as demo_main

        return demo_main(ns.nprocs, ns.steps, ns.numel)
    if ns.cmd == "version":
        import lowband

        print(lowband.__version__)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
