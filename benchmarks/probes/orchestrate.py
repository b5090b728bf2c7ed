"""Launching the probes: each batch of cases is one ``lowband run`` (lowband's launcher) of
:mod:`.rank`, watched from here: a case running past the per-probe bound is a HANG (the launch is
killed), a batch that stops after a case (an error the ranks may not have agreed on, a death) is
relaunched from the next case, and a case that hung, aborted or crashed after others in its launch is
rerun alone (its own launch) before it is reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.probes.classify import LaunchEnd, classify, classify_signal
from benchmarks.probes.common import CRASH, GLOO_ABORT, HANG, ROOT, Case

RANK_SCRIPT = ROOT / "benchmarks" / "probes" / "rank.py"
#: seconds for the ranks to start (import torch, meet) before the first case counts as hung
STARTUP_S = 180.0


@dataclass
class Probe:
    case: Case
    outcome: str
    detail: str
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        c = self.case
        return {"family": c["family"], "case": c["id"], "ranks": c["ranks"], "outcome": self.outcome,
                "seconds": round(self.seconds, 3), "detail": self.detail, **self.extra}  # fmt: skip


@dataclass
class Settings:
    work: Path
    comm_timeout: float
    bound: float
    done: Callable[[Probe], None] = lambda p: None
    launches: int = 0


def _gone(pid: int) -> bool:
    from lowband.rank_main import proc_state

    return proc_state(pid) in (None, "Z", "X")


def _kill(proc: subprocess.Popen[bytes], d: Path, ranks: int) -> None:
    for pid in [proc.pid, *(_pid(d, r) for r in range(ranks))]:
        if pid is None:
            continue
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _pid(d: Path, r: int) -> int | None:
    try:
        return int((d / f"pid{r}").read_text())
    except (OSError, ValueError):
        return None


def launch(d: Path, cases: list[Case], st: Settings, comm_timeout: float) -> tuple[LaunchEnd, int]:
    """One ``lowband run`` of ``cases``; returns how it ended and the index of the last case started."""
    ranks = cases[0]["ranks"]
    d.mkdir(parents=True)
    (d / "spec.json").write_text(json.dumps({"dir": str(d), "cases": cases, "bound": st.bound}))
    cmd = [sys.executable, "-m", "lowband.cli", "run", "-n", str(ranks), "--timeout", f"{comm_timeout:g}",
           "--log-dir", str(d / "logs"), str(RANK_SCRIPT), str(d / "spec.json")]  # fmt: skip
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    st.launches += 1
    with open(d / "stdout.txt", "wb") as out, open(d / "stderr.txt", "wb") as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": path}, cwd=ROOT)  # fmt: skip
        cur, started, hung = -1, t0, False
        gone: dict[int, float] = {}
        while proc.poll() is None:
            time.sleep(0.02)
            while cur + 1 < len(cases) and any((d / f"c{cur + 1}.start{r}").exists() for r in range(ranks)):
                cur, started = cur + 1, time.monotonic()
            for r in range(ranks):
                pid = _pid(d, r)
                if pid is not None and r not in gone and _gone(pid):
                    gone[r] = time.time()
            limit = STARTUP_S if cur < 0 else st.bound
            if time.monotonic() - started > limit:
                hung = True
                _kill(proc, d, ranks)
                proc.wait()
        seconds = time.monotonic() - t0
    while cur + 1 < len(cases) and any((d / f"c{cur + 1}.start{r}").exists() for r in range(ranks)):
        cur += 1
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((d / "logs").glob("rank*.log")))
    delays = {}
    for r in range(ranks):
        raised = d / f"raised{r}"
        stamp = raised.read_text().split("\n", 1)[0] if raised.exists() else ""
        if stamp and r in gone:
            delays[r] = gone[r] - float(stamp)
    end = LaunchEnd(
        proc.returncode, (d / "stderr.txt").read_text(errors="replace"), logs, hung, seconds, delays
    )
    return end, max(cur, 0)


def _reports(d: Path, i: int, ranks: int) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for r in range(ranks):
        f = d / f"c{i}.r{r}.json"
        out.append(json.loads(f.read_text()) if f.exists() else None)
    return out


def run_batch(cases: list[Case], st: Settings, isolated: bool = False) -> list[Probe]:
    """Every case of ``cases`` (one rank count), in as few launches as the cases allow."""
    probes: list[Probe] = []
    start = 0
    while start < len(cases):
        d = st.work / f"launch{st.launches:03d}"
        batch = cases[start:]
        end, last = launch(d, batch, st, st.comm_timeout)
        consumed = 0
        for i, case in enumerate(batch[: last + 1]):
            consumed = i + 1
            reports = _reports(d, i, case["ranks"])
            outcome, detail = classify(case, reports, end)
            seconds = max((r.get("seconds", 0.0) for r in reports if r is not None), default=end.seconds)
            probe = Probe(case, outcome, detail, seconds)
            broken = any(r is None for r in reports)
            if broken and outcome in (HANG, GLOO_ABORT, CRASH) and i > 0 and not isolated:
                probe = run_batch([case], st, isolated=True)[0]  # not the leftovers of an earlier case
                probe.extra["in_batch"] = f"{outcome}: {detail[:300]}"
            else:
                probe.extra["launch"] = d.name
                st.done(probe)
            probes.append(probe)
            if broken:
                break
        start += max(consumed, 1)
    return probes


def run_signal(case: Case, st: Settings, comm_timeout: float) -> Probe:
    """Family 6: one launch; the victim signals itself."""
    d = st.work / f"launch{st.launches:03d}"
    end, _ = launch(d, [case], st, comm_timeout)
    outcome, detail = classify_signal(case, end)
    extra: dict[str, Any] = {"exit_delays": {str(r): round(v, 3) for r, v in sorted(end.exit_delays.items())}}
    extra["blame"] = [ln for ln in end.stderr.splitlines() if ln.startswith("lowband run: ")][:3]
    probe = Probe(case, outcome, detail, end.seconds, extra)
    st.done(probe)
    return probe
