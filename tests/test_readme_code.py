"""README.md's Python blocks are run, so they cannot rot.

The convention (README.md): the line right above every ```` ```python ```` fence is an HTML comment
(invisible when the README is rendered) that says what this test does with the block:

- ``<!-- readme-test: ranks=N -->``: the block is a complete program, run as it stands on N ranks (each a
  process started by :func:`lowband.testing.run_processes`, where ``lowband.init()`` returns the rank's
  context), in a fresh temporary working directory shared by the ranks (files it writes, such as a
  checkpoint folder, land there); it must finish without an error on every rank;
- ``<!-- readme-test: skip (REASON) -->``: the block is a sketch (placeholders such as ``model`` or ``t``,
  or a launcher's program) and is not run; the reason is required.

A Python block without either marker fails the test, naming its line: a new block is run or explicitly
not run.
"""

from __future__ import annotations

import os
import re
import runpy
from pathlib import Path

import pytest

from lowband.testing import run_processes

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = re.compile(r"<!-- readme-test: (?:ranks=(\d+)|skip \((.+)\)) -->")


def python_blocks(text: str) -> list[tuple[int, str, str]]:
    """``(line of the fence, the marker line, the code)`` of every ```` ```python ```` block."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            out.append((i + 1, lines[i - 1] if i else "", "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return out


BLOCKS = python_blocks(README.read_text())


def test_every_python_block_is_marked() -> None:
    assert len(BLOCKS) >= 10
    unmarked = [line for line, marker, _ in BLOCKS if not MARKER.fullmatch(marker.strip())]
    assert not unmarked, (
        f"README.md: the python blocks at lines {unmarked} have no '<!-- readme-test: ranks=N -->' or "
        "'<!-- readme-test: skip (reason) -->' line above them (tests/test_readme_code.py)"
    )
    assert sum(1 for _, m, _ in BLOCKS if "ranks=" in m) >= 3


def _run_block(path: str, folder: str) -> None:
    os.chdir(folder)
    runpy.run_path(path, run_name="__readme__")


RUNNABLE = [
    (line, int(m.group(1)), code)
    for line, marker, code in BLOCKS
    if (m := MARKER.fullmatch(marker.strip())) and m.group(1)
]


@pytest.mark.parametrize(("line", "ranks", "code"), RUNNABLE, ids=[f"line{x[0]}" for x in RUNNABLE])
def test_readme_block_runs(line: int, ranks: int, code: str, tmp_path: Path) -> None:
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code)
    work = tmp_path / "work"
    work.mkdir()
    run_processes(_run_block, ranks, str(script), str(work), timeout=240)
