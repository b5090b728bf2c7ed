"""The script every rank runs under ``lowband run``: ``rank.py SPEC.json``.

SPEC: ``{"dir": ..., "cases": [...], "bound": seconds}``. The ranks meet on pid files before
``lowband.init`` (a short ``--timeout`` is not spent on ranks still importing torch), then run the cases
in order. Per case and rank: ``c{i}.start{rank}`` when it starts, ``c{i}.r{rank}.json`` (the report, or
the error's type and text) when it ends. After each case the ranks meet on those files, and stop the
batch (the orchestrator relaunches from the next case) unless every rank ended alike, either normally
or with an error the ranks agree on before anything is left in flight. A family 6 case (kind
``signal``) is alone in its launch and raises, as a training script would.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks, tests

import lowband
from benchmarks.probes.common import AGREED_ERRORS
from benchmarks.probes.rank_cases import KINDS, signalled


def _meet(paths: list[Path], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _clean(reports: list[dict[str, Any]]) -> bool:
    kinds = {r.get("etype") for r in reports}
    return len(kinds) == 1 and (kinds <= {None} or kinds <= AGREED_ERRORS)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    d, bound = Path(spec["dir"]), float(spec["bound"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (d / f"pid{rank}").write_text(str(os.getpid()))
    _meet([d / f"pid{r}" for r in range(world)], 300)
    lowband.init()
    for i, case in enumerate(spec["cases"]):
        (d / f"c{i}.start{rank}").write_text(repr(time.time()))
        if case["kind"] == "signal":
            signalled(case, d)
            continue
        t0 = time.monotonic()
        report: dict[str, Any] = {}
        try:
            KINDS[case["kind"]](case, report)
        except Exception as exc:
            report.update(etype=type(exc).__name__, error=str(exc), traceback=traceback.format_exc())
        report["seconds"] = time.monotonic() - t0
        _write(d / f"c{i}.r{rank}.json", report)
        files = [d / f"c{i}.r{r}.json" for r in range(world)]
        if not _meet(files, bound) or not _clean([json.loads(f.read_text()) for f in files]):
            break
    lowband.shutdown()


if __name__ == "__main__":
    main()
