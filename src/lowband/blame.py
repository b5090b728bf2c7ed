"""Which rank caused a failed launch, in one line per distinct cause: the ranks' own reports, their
processes' states and exit codes, one ordering.

When one rank fails, the others fail after it with follow-on errors (a connection closed by the dead
peer, a timeout waiting for a silent one). The causes are named first, earliest first:

- a rank killed by a signal (SIGKILL, SIGSEGV, the OOM killer): it wrote no report, its exit status
  says it;
- a rank that stopped answering: alive but stopped (SIGSTOP, a suspended job, a debugger; state ``T``
  in ``/proc``), so its peers time out. Nothing exits, so no exit status says it: a survivor that
  times out looks at its peers' processes (:func:`~lowband.rank_main.stopped_ranks`, from the pid
  files the ranks write at start) and names the stopped ones in its report, and the launcher, which
  sees its children, does the same (:func:`proc_state`);
- a Python error that is not a follow-on, or an exit without a report (``os._exit``, a crash).

The same error on several ranks (a typo in a strategy's name raised on every rank) is one line naming
the ranks; the follow-on errors are one line after the causes (or the causes themselves when nothing
else failed); ranks the launcher stopped once the others had failed are one line. The tracebacks stay
in the ranks' log files, whose folder the last line names.

Reports are small JSON files a rank writes *before* its own shutdown (the launcher may stop it once
its peers fail): ``RANK.json``, ``RANK.pid`` (:mod:`lowband.rank_main` writes them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
from dataclasses import dataclass
from typing import Any

from lowband.rank_main import (
    LOG_DIR_ENV,
    REPORT_DIR_ENV,
    log_path,
    proc_state,
    rank_pids,
    stopped_ranks,
    write_pid,
    write_report,
)

__all__ = [
    "LaunchFolders",
    "RankEnd",
    "child_ranks",
    "ends_of_codes",
    "ends_of_failures",
    "failure_report",
    "parent_of",
    "proc_state",
    "rank_pids",
    "read_reports",
    "stopped_ranks",
    "summary",
    "write_pid",
    "write_report",
]

_GUARD = 'if __name__ == "__main__":'
#: distinct errors named on the terminal; more are counted in one line (the logs have them all)
MAX_CAUSES = 5
#: an error's text is cut to this many characters on the terminal (the log has it whole)
MAX_TEXT = 400
_HINTS = {
    "SIGKILL": "kill -9, or the kernel's out-of-memory killer: see `dmesg`",
    "SIGSEGV": "a crash in native code (its log has the Python stack of every thread)",
    "SIGBUS": "a crash in native code (its log has the Python stack of every thread)",
    "SIGILL": "a crash in native code (its log has the Python stack of every thread)",
    "SIGFPE": "a crash in native code (its log has the Python stack of every thread)",
    "SIGABRT": "an abort in native code (its log has the Python stack of every thread)",
    "SIGTERM": "stopped from outside",
    "SIGINT": "interrupted",
}


class LaunchFolders:
    """Where one launch's ranks leave their reports (a temporary folder, removed by :meth:`close`) and
    their logs: ``log_dir`` (created), or a new temporary folder ``PREFIX-logs-*``, removed by
    :meth:`close` when no rank failed and kept (the summary names it) when one did."""

    def __init__(self, log_dir: str | None, prefix: str) -> None:
        self.reports = tempfile.mkdtemp(prefix=f"{prefix}-reports-")
        self.own_logs = log_dir is None
        self.logs = (
            tempfile.mkdtemp(prefix=f"{prefix}-logs-") if log_dir is None else os.path.abspath(log_dir)
        )
        os.makedirs(self.logs, exist_ok=True)

    def env(self) -> dict[str, str]:
        """The ranks' environment variables naming the folders (:mod:`lowband.rank_main` reads them)."""
        return {REPORT_DIR_ENV: self.reports, LOG_DIR_ENV: self.logs}

    def close(self, ends: dict[int, RankEnd] | None = None) -> None:
        """Remove the reports (and the temporary logs unless a rank failed, ``ends`` non-empty); a rank
        killed by a signal gets a last line in its log saying so."""
        shutil.rmtree(self.reports, ignore_errors=True)
        if self.own_logs and not ends:
            shutil.rmtree(self.logs, ignore_errors=True)
            return
        for r, end in (ends or {}).items():
            if end.code < 0:
                name = _signal_text(end.code)[0]
                how = "stopped by the launcher" if end.by_launcher else "killed"
                try:
                    with open(log_path(self.logs, r), "a", encoding="utf-8") as f:
                        f.write(f"lowband: rank {r} {how} (signal {name}, exit code {end.code})\n")
                except OSError:
                    pass


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


def read_reports(report_dir: str) -> dict[int, dict[str, Any]]:
    """Rank -> its report (:func:`~lowband.rank_main.write_report`), of the ranks that wrote one."""
    out: dict[int, dict[str, Any]] = {}
    for name in os.listdir(report_dir):
        if name.endswith(".json") and name[:-5].isdigit():
            try:
                with open(os.path.join(report_dir, name), encoding="utf-8") as f:
                    out[int(name[:-5])] = json.load(f)
            except (OSError, ValueError):
                continue
    return out


@dataclass(frozen=True)
class RankEnd:
    """How a failed rank's process ended, as its launcher saw it: the exit code (negative: killed by
    that signal), when (``time.time()``), and whether the launcher stopped it after another failed."""

    code: int
    when: float
    by_launcher: bool = False


def ends_of_failures(failures: dict[int, Any]) -> dict[int, RankEnd]:
    """:class:`RankEnd` of torch's failures (rank -> ``ProcessFailure``). Torch's agent stops the other
    ranks with SIGTERM once one failed: such a death is the launcher's unless nothing else failed."""
    term = -int(signal.SIGTERM)
    other = any(f.exitcode != term for f in failures.values())
    return {
        r: RankEnd(int(f.exitcode), float(f.timestamp), by_launcher=other and f.exitcode == term)
        for r, f in failures.items()
    }


def ends_of_codes(codes: list[int], ended_at: dict[int, float], killed: list[int]) -> dict[int, RankEnd]:
    """:class:`RankEnd` of the failed processes of :func:`lowband.testbed.procs.wait_procs`: exit codes,
    when each was seen ending, the ranks it killed after the grace period."""
    last = max(ended_at.values(), default=0.0)
    return {
        r: RankEnd(c, ended_at.get(r, last), by_launcher=r in killed) for r, c in enumerate(codes) if c != 0
    }


def _stopped_by(
    reports: dict[int, dict[str, Any]], seen_stopped: dict[int, float], launcher: str
) -> dict[int, tuple[float, str]]:
    """Stopped rank -> (when it was first seen stopped, by whom)."""
    out: dict[int, tuple[float, str]] = {r: (t, launcher) for r, t in seen_stopped.items()}
    for r in sorted(reports):
        for s in reports[r].get("stopped", []):
            when = float(reports[r]["time"])
            if int(s) not in out or when < out[int(s)][0]:
                out[int(s)] = (when, f"rank {r} when its op timed out")
    return out


def rank_list(ranks: list[int]) -> str:
    """``[1]`` -> ``"rank 1"``, ``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    runs: list[list[int]] = []
    for r in rs:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{x[0]}-{x[-1]}" if len(x) > 2 else ", ".join(map(str, x)) for x in runs]
    return "ranks " + ", ".join(parts)


def _short(text: str, follow_on: bool) -> str:
    """An error's first line, cut at :data:`MAX_TEXT`; a follow-on's also before torch's own message
    (``...: [../gloo/.../pair.cc:553] Connection closed by peer [127.0.0.1]:9384``)."""
    line = text.strip().splitlines()[0] if text.strip() else text
    if follow_on:
        line = re.split(r": \[|: RuntimeError: ", line, maxsplit=1)[0]
    return line if len(line) <= MAX_TEXT else line[: MAX_TEXT - 3] + "..."


def _key(text: str, rank: int) -> str:
    """An error's text with its own rank's number taken out: the same error on several ranks is one."""
    return re.sub(rf"\brank {rank}\b", "rank #", text)


def _group(
    ranks: list[int], reports: dict[int, dict[str, Any]], follow_on: bool
) -> list[tuple[list[int], str]]:
    """The ranks' errors, one entry per distinct text (and place in the user's code): ``(ranks, text)``,
    a rank's own number written ``each rank`` where several ranks said the same."""
    groups: dict[tuple[str, str | None], list[int]] = {}
    for r in ranks:
        rep = reports[r]
        groups.setdefault((_key(_short(str(rep["error"]), follow_on), r), rep.get("where")), []).append(r)
    out = []
    for (text, where), members in groups.items():
        if len(members) == 1:
            text = _short(str(reports[members[0]]["error"]), follow_on)
        out.append((members, text.replace("rank #", "each rank") + (f" ({where})" if where else "")))
    return out


def _signal_text(code: int) -> tuple[str, str]:
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    return name, _HINTS.get(name, "")


def _process_causes(
    ends: dict[int, RankEnd],
    ranks: list[int],
    stopped: dict[int, tuple[float, str]],
    who: str,
) -> list[tuple[float, list[int], str]]:
    """``(when, ranks, what)`` of the causes no report tells: stopped ranks, signal deaths, exits
    without a report (``ranks``: those without a report, not stopped by the launcher)."""
    causes: list[tuple[float, list[int], str]] = []
    if stopped:
        st = sorted(stopped, key=lambda k: (stopped[k][0], k))
        seen = (
            f"seen by {stopped[st[0]][1]}"
            if len(st) == 1
            else "; ".join(f"{rank_list([r])} seen by {stopped[r][1]}" for r in st)
        )
        whose = "its process was" if len(st) == 1 else "their processes were"
        causes.append((
            stopped[st[0]][0], st,
            f"stopped answering ({whose} stopped, state T: SIGSTOP, Ctrl-Z, a debugger; {seen}; killed): "
            "the other ranks' timeouts follow from it; find what stopped it",
        ))  # fmt: skip
    signals: dict[int, list[int]] = {}
    exits: dict[int, list[int]] = {}
    for r in ranks:
        (signals if ends[r].code < 0 else exits).setdefault(ends[r].code, []).append(r)
    for code, rs in signals.items():
        name, hint = _signal_text(code)
        causes.append((
            min(ends[r].when for r in rs), rs,
            f"{'was' if len(rs) == 1 else 'were'} killed by {name} (exit code {code}"
            + (f": {hint})" if hint else ")"),
        ))  # fmt: skip
    guard = f"; is the launching code under `{_GUARD}`?" if who == "lowband.launch" else ""
    for code, rs in exits.items():
        causes.append((
            min(ends[r].when for r in rs), rs,
            f"exited with code {code} before reporting a Python error (os._exit, a crash, or a failure "
            f"while the rank started{guard})",
        ))  # fmt: skip
    return causes


def summary(
    ends: dict[int, RankEnd],
    reports: dict[int, dict[str, Any]],
    seen_stopped: dict[int, float] | None = None,
    who: str = "lowband.launch",
    log_dir: str | None = None,
    launcher: str = "the launcher",
) -> list[str]:
    """The terminal's account of a failed launch: one line per distinct cause, earliest first (see the
    module docstring), each starting ``WHO: ``; the last names ``log_dir`` when given.

    ``ends`` are the failed processes (:func:`ends_of_failures`, :func:`ends_of_codes`); ``reports`` the
    ranks' own (:func:`read_reports`); ``seen_stopped`` the ranks the launcher saw stopped (rank ->
    time); ``launcher`` names who stopped ranks (``"torchrun's agent"``)."""
    stopped = _stopped_by(reports, seen_stopped or {}, launcher)
    others = [r for r in sorted(set(ends) | set(reports)) if r not in stopped]
    errors = [r for r in others if r in reports and not reports[r].get("follow_on")]
    follow_ons = [r for r in others if r in reports and reports[r].get("follow_on")]
    by_launcher = [r for r in others if r not in reports and ends[r].by_launcher]
    silent = [r for r in others if r not in reports and not ends[r].by_launcher]
    causes = _process_causes(ends, silent, stopped, who)
    for rs, text in _group(errors, reports, follow_on=False):
        causes.append((min(float(reports[r]["time"]) for r in rs), rs, f"failed: {text}"))
    if not causes:  # nothing but follow-ons: they are the causes
        for rs, text in _group(follow_ons, reports, follow_on=True):
            causes.append((min(float(reports[r]["time"]) for r in rs), rs, f"failed: {text}"))
        follow_ons = []
    causes.sort(key=lambda c: (c[0], c[1]))
    lines = [f"{who}: {rank_list(rs)} {what}" for _, rs, what in causes[:MAX_CAUSES]]
    if stopped and lines[0].startswith(f"{who}: {rank_list(list(stopped))} stopped answering ("):
        lines[0] = lines[0].replace(" stopped answering (", " stopped answering first (", 1)
    if len(causes) > MAX_CAUSES:
        lines.append(f"{who}: ... and {len(causes) - MAX_CAUSES} more distinct errors (in the logs)")
    if follow_ons:
        first = min(follow_ons, key=lambda r: float(reports[r]["time"]))
        lines.append(
            f"{who}: then {rank_list(follow_ons)} failed because of {'it' if len(causes) == 1 else 'them'} "
            f"(follow-on errors; the first: {_short(str(reports[first]['error']), True)})"
        )
    if by_launcher:
        lines.append(f"{who}: {rank_list(by_launcher)} stopped by {launcher} once another rank had failed")
    if log_dir is not None:
        lines.append(f"{who}: every rank's output and traceback: {os.path.join(log_dir, 'rank*.log')}")
    return lines


def failure_report(
    failures: dict[int, Any],
    reports: dict[int, dict[str, Any]],
    seen_stopped: dict[int, float] | None = None,
    who: str = "lowband.launch",
    log_dir: str | None = None,
) -> str:
    """:func:`summary` of a launch through torch's agent (``failures``: rank -> ``ProcessFailure``), as
    one text."""
    return "\n".join(summary(ends_of_failures(failures), reports, seen_stopped, who, log_dir))
