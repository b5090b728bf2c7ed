"""The ``lowband`` command: run, bench, demo, plan, testbed, version."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    from lowband.bench.cli import add_parsers
    from lowband.plan.cli import add_parser as add_plan
    from lowband.run_cli import OneLineParser
    from lowband.testbed.cli import add_parser as add_testbed

    p = OneLineParser(prog="lowband", description="Training PyTorch models over slow links.")
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser(
        "run",
        help="run your script on N ranks: torchrun underneath, or on emulated links with --rate "
        "(lowband run --help)",
        add_help=False,
    )
    run.add_argument("rest", nargs=argparse.REMAINDER, help="see lowband run --help")
    add_parsers(sub)
    add_plan(sub)
    add_testbed(sub)
    sub.add_parser("version", help="print the version")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["run"]:
        from lowband.run_cli import main as run_main

        return run_main(args[1:])
    from lowband.run_cli import UsageError

    try:
        ns = _parser().parse_args(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    if ns.cmd == "version":
        import lowband

        print(lowband.__version__)
        return 0
    from lowband.bench.cli import main_bench, main_demo
    from lowband.plan.cli import main as plan_main
    from lowband.testbed.cli import main as testbed_main

    commands = {"bench": main_bench, "demo": main_demo, "plan": plan_main, "testbed": testbed_main}
    return commands[ns.cmd](ns)


if __name__ == "__main__":
    sys.exit(main())
