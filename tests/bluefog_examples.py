"""Running the BlueFog-style programs of examples/bluefog/ on thread-ranks: each rank executes the whole
file as ``__main__`` (as ``torchrun`` would start it), with the given command line."""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from lowband.testing import run_threads

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "bluefog"

#: the only lines that differ from the program a BlueFog user writes: compat import -> BlueFog import
IMPORTS = {
    "import lowband.compat.bluefog.torch as bf": "import bluefog.torch as bf",
    "from lowband.compat.bluefog.common import topology_util": "from bluefog.common import topology_util",
}


def run_example(
    monkeypatch: pytest.MonkeyPatch, name: str, argv: Sequence[str], n: int, keys: Sequence[str]
) -> list[dict[str, Any]]:
    """Run examples/bluefog/<name> on ``n`` thread-ranks; returns each rank's values of ``keys`` (the
    program's module-level variables when it ends)."""
    path = EXAMPLES / name
    monkeypatch.setattr(sys, "argv", [str(path), *argv])

    def fn() -> dict[str, Any]:
        env = runpy.run_path(str(path), run_name="__main__")
        return {k: env[k] for k in keys}

    # run_path swaps sys.modules["__main__"] for the program and puts back what it found; ranks running
    # concurrently put back each other's program, which would stay as this process's __main__ (and be
    # re-imported by every process spawned later). Restore the real one.
    main = sys.modules["__main__"]
    try:
        return run_threads(fn, n, timeout=120)
    finally:
        sys.modules["__main__"] = main
