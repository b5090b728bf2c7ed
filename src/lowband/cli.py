"""The ``lowband`` command: run, bench, demo, testbed, version."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    from lowband.bench.cli import add_parsers
    from lowband.testbed.cli import add_parser as add_testbed

    p = argparse.ArgumentParser(prog="lowband", description="Training PyTorch models over slow links.")
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser(
        "run",
        help="run a script on N ranks (torchrun underneath)",
        description="lowband run -n N [torchrun options] script.py [script args]: the script calls lowband.init().",
        add_help=False,
    )
    run.add_argument("rest", nargs=argparse.REMAINDER)
    add_parsers(sub)
    add_testbed(sub)
    sub.add_parser("version", help="print the version")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["run"]:
        rest = args[1:]
        if not rest or rest[0] in ("-h", "--help"):
            print("usage: lowband run -n N [torchrun options] script.py [script args]")
            return 0 if rest else 2
        from lowband.errors import InvalidArgumentError
        from lowband.launcher import run_command

        try:
            return run_command(rest)
        except InvalidArgumentError as exc:
            print(
                f"{exc}\nusage: lowband run -n N [torchrun options] script.py [script args]", file=sys.stderr
            )
            return 2
    ns = _parser().parse_args(args)
    if ns.cmd == "version":
        import lowband

        print(lowband.__version__)
        return 0
    from lowband.bench.cli import main_bench, main_demo
    from lowband.testbed.cli import main as testbed_main

    commands = {"bench": main_bench, "demo": main_demo, "testbed": testbed_main}
    return commands[ns.cmd](ns)


if __name__ == "__main__":
    sys.exit(main())
