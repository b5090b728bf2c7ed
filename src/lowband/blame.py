"""Which rank caused a failed launch: the ranks' own reports, their processes' states, one ordering.

When one rank fails, the others fail after it with follow-on errors (a connection closed by the dead
peer, a timeout waiting for a silent one). The cause is named first, and it outranks every follow-on
error when it is:

- a rank killed by a signal (SIGKILL, SIGSEGV, the OOM killer): it wrote no report, its exit status
  says it;
- a rank that stopped answering: alive but stopped (SIGSTOP, a suspended job, a debugger; state ``T``
  in ``/proc``), so its peers time out. Nothing exits, so no exit status says it: a survivor that
  times out looks at its peers' processes (:func:`stopped_ranks`, from the pid files the ranks write
  at start, :func:`write_pid`) and names the stopped ones in its report, and the launcher, which sees
  its children, does the same (:func:`proc_state`);
- a Python error that is not a follow-on, or an exit without a report (``os._exit``, a crash), the
  earliest first.

Reports are small JSON files a rank writes *before* its own shutdown (the launcher may stop it once
its peers fail): ``RANK.json`` with the error, its traceback, its time, whether it is a follow-on and
the stopped ranks it saw; ``RANK.pid`` holds the rank's process id.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any

_GUARD = 'if __name__ == "__main__":'


def proc_state(pid: int) -> str | None:
    """The one-letter state of process ``pid`` from ``/proc`` (``T``: stopped), or None if it is gone
    (or there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0] if fields else None


def parent_of(pid: int) -> int | None:
    """The parent process id of ``pid`` (from ``/proc``), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
        return int(stat[stat.rfind(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def child_ranks(parent: int) -> dict[int, int]:
    """Rank -> process id of ``parent``'s children that carry ``RANK`` in their environment (the
    workers torchrun's agent starts as subprocesses)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit() or parent_of(int(name)) != parent:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        rank = next((v[5:] for v in env if v.startswith(b"RANK=")), b"")
        if rank.isdigit():
            out[int(rank)] = int(name)
    return out


def signal_cause(failures: dict[int, Any], seen_stopped: dict[int, float]) -> str | None:
    """For a launch without the ranks' reports (torchrun's): the cause when it is a rank that stopped
    answering or was killed by a signal (earliest first), in one line; None otherwise."""
    if seen_stopped:
        r = min(seen_stopped, key=lambda k: (seen_stopped[k], k))
        return (
            f"rank {r} stopped answering first (its process was stopped, state T: SIGSTOP, a suspended "
            "job, a debugger; killed once another rank ended); the other ranks' errors follow from it"
        )
    deaths = [r for r, f in failures.items() if f.exitcode < 0]
    if not deaths:
        return None
    r = min(deaths, key=lambda k: (float(failures[k].timestamp), k))
    return (
        f"rank {r} was killed by {failures[r].signal_name()} (exit code {failures[r].exitcode}) first; "
        "the other ranks' errors follow from it"
    )


def write_pid(report_dir: str, rank: int) -> None:
    """Record this rank's process id for its peers' :func:`stopped_ranks`."""
    tmp = os.path.join(report_dir, f".{rank}.pid")
    with open(tmp, "w", encoding="ascii") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(report_dir, f"{rank}.pid"))


def rank_pids(report_dir: str) -> dict[int, int]:
    """Rank -> process id, from the pid files the ranks wrote."""
    out: dict[int, int] = {}
    for name in os.listdir(report_dir):
        stem, _, ext = name.partition(".")
        if ext == "pid" and stem.isdigit():
            try:
                with open(os.path.join(report_dir, name), encoding="ascii") as f:
                    out[int(stem)] = int(f.read())
            except (OSError, ValueError):
                continue
    return out


def stopped_ranks(report_dir: str) -> list[int]:
    """The ranks whose processes are stopped now (state ``T``), of those that wrote a pid file here."""
    return sorted(r for r, pid in rank_pids(report_dir).items() if proc_state(pid) == "T")


def write_report(report_dir: str, rank: int, exc: BaseException) -> None:
    """Write this rank's error (see the module docstring); called before shutdown, from an ``except``."""
    from lowband.errors import CommFailedError, CommTimeoutError

    follow_on = isinstance(exc, (CommFailedError, CommTimeoutError))
    report = {
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": traceback.format_exc(),
        "time": time.time(),
        "follow_on": follow_on,
        "stopped": [r for r in stopped_ranks(report_dir) if r != rank] if follow_on else [],
    }
    tmp = os.path.join(report_dir, f".{rank}.json")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f)
    os.replace(tmp, os.path.join(report_dir, f"{rank}.json"))


def read_reports(report_dir: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for name in os.listdir(report_dir):
        if name.endswith(".json") and name[:-5].isdigit():
            try:
                with open(os.path.join(report_dir, name), encoding="utf-8") as f:
                    out[int(name[:-5])] = json.load(f)
            except (OSError, ValueError):
                continue
    return out


def _exit_text(failure: Any) -> str:
    if failure is None:
        return "stopped by the launcher"
    if failure.exitcode < 0:
        return f"exit code {failure.exitcode}: signal {failure.signal_name()}"
    return f"exit code {failure.exitcode}"


def _stopped_by(
    reports: dict[int, dict[str, Any]], seen_stopped: dict[int, float]
) -> dict[int, tuple[float, str]]:
    """Stopped rank -> (when it was first seen stopped, by whom)."""
    out: dict[int, tuple[float, str]] = {r: (t, "the launcher") for r, t in seen_stopped.items()}
    for r in sorted(reports):
        for s in reports[r].get("stopped", []):
            when = float(reports[r]["time"])
            if int(s) not in out or when < out[int(s)][0]:
                out[int(s)] = (when, f"rank {r} when its op timed out")
    return out


def failure_report(
    failures: dict[int, Any],
    reports: dict[int, dict[str, Any]],
    seen_stopped: dict[int, float] | None = None,
    who: str = "lowband.launch",
) -> str:
    """The launch error: the cause first (with its traceback when it raised), then every other failed
    rank in one line each.

    ``failures`` are torch's (rank -> ``ProcessFailure``: the ranks the agent saw fail); ``reports`` are
    the ranks' own (:func:`write_report`); ``seen_stopped`` are ranks the launcher saw stopped (rank ->
    time). The cause is, earliest first, a rank killed by a signal, a rank that stopped answering, a
    Python error that is not a follow-on, or an exit without a report; only when there is none, the
    earliest follow-on error (a lowband communication failure caused by another rank)."""
    stopped = _stopped_by(reports, seen_stopped or {})
    ranks = sorted(set(failures) | set(reports) | set(stopped))

    def text(r: int) -> str:
        if r in stopped:
            return (
                f"stopped answering: its process was stopped (state T: SIGSTOP, a suspended job, a "
                f"debugger), seen by {stopped[r][1]}; the other ranks' timeouts follow from it"
            )
        if r in reports:
            return str(reports[r]["error"])
        f = failures[r]
        if f.exitcode < 0:
            return f"stopped by signal {f.signal_name()}"
        return (
            f"exited with code {f.exitcode} before reporting a Python error (os._exit, a crash, or a "
            f"failure while the rank started: is the launching code under `{_GUARD}`?)"
        )

    def root_key(r: int) -> tuple[int, float, int]:
        if r in stopped:
            return (0, stopped[r][0], r)
        if r in reports:
            return (1 if reports[r]["follow_on"] else 0, float(reports[r]["time"]), r)
        # torch's failure time is in whole seconds (earlier than the death or equal): a signal death
        # comes before the follow-on errors of that second
        return (0, float(failures[r].timestamp), r)

    root = min(ranks, key=root_key)
    if root in stopped:
        out = f"{who}: rank {root} {text(root)}"
    else:
        out = f"{who}: rank {root} failed ({_exit_text(failures.get(root))}): {text(root)}"
        if root in reports:
            out += "\n" + str(reports[root]["traceback"]).rstrip()
    others = [r for r in ranks if r != root]
    if others:
        out += "\nthen: " + "; ".join(f"rank {r} ({_exit_text(failures.get(r))}): {text(r)}" for r in others)
    return out
