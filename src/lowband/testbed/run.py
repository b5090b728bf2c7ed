"""A user's own script on emulated links (``lowband run --rate ...``): one process per rank inside the
testbed's namespaces, the same processes and clean-up as ``lowband bench`` (:class:`Testbed`), then
the bytes each machine's link carried.

Bytes are the kernel's interface counters of each machine's link to the bridge (``veth0`` in its
namespace), read before the ranks start and after the last one ends. They count everything the
script sent, whether through lowband, torch.distributed directly (DDP, gloo) or anything else, with
TCP/IP/Ethernet framing and the rendezvous included; lowband's own op counters
(:func:`lowband.tracing.counters`) would see only the payload of ops that go through lowband. With
several ranks on a machine the link is shared, so the figures are per machine, and the traffic
between the machine's own ranks (its loopback) is given apart.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from lowband.blame import LaunchFolders, RankEnd, ends_of_codes, rank_list, read_reports, summary
from lowband.errors import CommTimeoutError
from lowband.rank_main import RANK_MAIN
from lowband.testbed.links import Layout
from lowband.testbed.netns import Testbed
from lowband.testbed.procs import wait_procs
from lowband.testbed.schedule import schedule_for
from lowband.testbed.store_host import launcher_store

#: seconds the other ranks get to finish (and print their own errors) after one rank failed (default)
GRACE_S = 10.0


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def byte_lines(layout: Layout, before: list[dict[str, int]], after: list[dict[str, int]]) -> list[str]:
    """The per-rank (or per-machine, when ranks share one) byte report, one line each."""
    k = layout.ranks_per_machine
    lines = []
    for m, (b, a) in enumerate(zip(before, after)):
        who = f"rank {m}" if k == 1 else f"machine {m} (ranks {m * k}-{m * k + k - 1})"
        line = f"  {who:<24s} sent {_mb(a['tx'] - b['tx']):>11s}  received {_mb(a['rx'] - b['rx']):>11s}"
        if k > 1:
            line += f"  inside the machine {_mb(a['local'] - b['local'])}"
        lines.append(line)
    return lines


def run_script(
    layout: Layout,
    argv: Sequence[str],
    *,
    mode: str = "auto",
    mtu: int,
    env: dict[str, str] | None = None,
    time_limit: float | None = None,
    report: str | None = None,
    grace: float = GRACE_S,
    out: IO[str] | None = None,
    log_dir: str | None = None,
    max_restarts: int = 0,
    keep_going: bool = False,
    replacements: int = 0,
    rate_change: str | None = None,
) -> int:
    """Run ``python ARGV`` on every rank of ``layout`` in the testbed (through :mod:`lowband.rank_main`:
    ``ARGV`` is ``SCRIPT ARGS`` or ``-m MODULE ARGS``); print the link bytes; returns the exit status
    (0, or 1 when a rank failed or the time limit passed, after one line per distinct cause on stderr:
    :func:`lowband.blame.summary`). Each rank's Python output and traceback go to ``log_dir/rankR.log``
    too (default: a temporary folder, kept and named when a rank failed). Everything the testbed made is
    removed on return, on an exception and on SIGINT/SIGTERM. ``max_restarts``: after a rank fails, every
    rank is stopped and all are started again, at most that many times, in the same testbed (as
    torchrun's agent does: ``TORCHELASTIC_RESTART_COUNT`` tells the script the attempt, and a script
    written with :class:`lowband.checkpoint.Checkpointer` resumes from its newest complete set).

    ``keep_going``: a rank that fails or dies does not stop the others (a script whose strategy has
    ``on_peer_loss="continue"`` trains on without it). The launcher hosts the rendezvous store
    (:func:`~lowband.testbed.store_host.launcher_store`: it outlives every rank, rank 0 included), and
    the run succeeds (0) when at least one rank ended successfully; the lost ranks are named on stderr,
    one line per distinct cause. ``replacements`` (with ``keep_going``): a rank that fails is started
    again, at most that many times in all, with ``LOWBAND_JOIN=1``: it joins the survivors at their next
    exchange and takes its state from a live peer (:mod:`lowband.strategies.peer_join`).

    ``rate_change``: a ``--rate-change`` schedule (:mod:`lowband.testbed.schedule`), its times counted
    from the first launch of the ranks; each change applied is logged and goes in ``report``."""
    out = out or sys.stdout
    limit = math.inf if time_limit is None else time_limit
    folders = LaunchFolders(log_dir, "lowband-run")
    ends: dict[int, RankEnd] = {}
    replaced: list[tuple[int, int]] = []  # (rank, exit status) of each rank replaced
    try:
        with Testbed(layout, mode=mode, mtu=mtu) as tb, contextlib.ExitStack() as stack:
            print(f"lowband run: {tb.label()}", file=sys.stderr, flush=True)
            hosted = stack.enter_context(launcher_store(tb)) if keep_going else None
            if hosted is not None:
                tb.store_env = hosted.env
            sched = schedule_for(tb, rate_change, "lowband run")
            if sched is not None:
                stack.callback(sched.stop)  # before the testbed goes down, whatever happens
            before = tb.link_bytes()
            run_id = f"lowband-run-{os.getpid()}-{int(time.time())}"
            attempt, started = 0, time.monotonic()
            while True:
                rank_env = {
                    "PYTHONUNBUFFERED": "1", **folders.env(), **(env or {}),
                    "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_RUN_ID": run_id,
                    "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
                }  # fmt: skip
                procs = tb.spawn([sys.executable, RANK_MAIN, *argv], env=rank_env)
                if sched is not None and attempt == 0:
                    sched.start()  # the schedule's time 0: the first launch
                timed_out, stopped, killed, ended_at = "", list[int](), list[int](), dict[int, float]()

                def replace(r: int, code: int, rank_env: dict[str, str] = rank_env) -> Any:
                    if hosted is not None:  # the survivors waiting on it learn it now (lowband.comm.deaths)
                        hosted.record_death(run_id, r, code)
                    if len(replaced) >= replacements:
                        return None
                    replaced.append((r, code))
                    print(
                        f"lowband run: rank {r} ended with status {code}; a replacement joins the others at "
                        f"their next exchange ({len(replaced)} of {replacements})", file=sys.stderr, flush=True,
                    )  # fmt: skip
                    joiner_env = {**rank_env, "LOWBAND_JOIN": "1"}
                    return tb.spawn([sys.executable, RANK_MAIN, *argv], env=joiner_env, ranks=[r])[0]

                try:
                    left = limit - (time.monotonic() - started)
                    codes = wait_procs(
                        procs, left, grace=grace, stopped=stopped, killed=killed, ended_at=ended_at,
                        keep_going=keep_going, replace=replace if keep_going else None,
                    )  # fmt: skip
                except CommTimeoutError as exc:
                    timed_out = str(exc).replace("lowband.testbed.wait: ", "--time-limit: ")
                    codes = [p.returncode if p.returncode is not None else -9 for p in procs]
                failed = ends_of_codes(codes, ended_at, killed)
                if not failed or timed_out or attempt >= max_restarts:
                    break
                first = min(failed, key=lambda r: ended_at.get(r, math.inf))
                print(
                    f"lowband run: rank {first} ended with status {codes[first]}; restarting every rank "
                    f"(restart {attempt + 1} of {max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
                attempt += 1
            after = tb.link_bytes()
            changes = sched.stop() if sched is not None else []
            label, shaped = tb.label(), tb.shaped
        _print_bytes(layout, label, shaped, before, after, out)
        ends = ends_of_codes(codes, ended_at, killed)
        if timed_out:
            print(f"lowband run: {timed_out}", file=sys.stderr)
        elif ends:
            seen = {r: ended_at.get(r, time.time()) for r in stopped}
            lines = summary(
                ends, read_reports(folders.reports), seen, "lowband run", folders.logs, "lowband run"
            )
            went_on = [r for r, c in enumerate(codes) if c == 0] if keep_going else []
            for r, code in replaced:
                lines.append(
                    f"lowband run: rank {r} ended with status {code}; a replacement was started in its place"
                )
            if went_on:
                lines.insert(0, f"lowband run: --keep-going: {rank_list(went_on)} trained on and ended "
                             f"successfully; lost: {rank_list(list(ends))}")  # fmt: skip
            print("\n".join(lines), file=sys.stderr)
        if report:
            _write_report(Path(report), label, shaped, layout, codes, before, after, changes)
        if replaced and not ends:
            print(f"lowband run: replaced {', '.join(f'rank {r} (status {c})' for r, c in replaced)}; every rank "
                  "ended successfully", file=sys.stderr)  # fmt: skip
        if keep_going and not timed_out and any(c == 0 for c in codes):
            return 0  # (the lost ranks' logs are kept and named above)
        return 1 if ends or timed_out else 0
    finally:
        folders.close(ends)


def _print_bytes(
    layout: Layout,
    label: str,
    shaped: bool,
    before: list[dict[str, int]],
    after: list[dict[str, int]],
    out: IO[str],
) -> None:
    if shaped:
        print(f"lowband run: bytes on the emulated links ({label}; kernel interface counters):", file=out)
        for line in byte_lines(layout, before, after):
            print(line, file=out)
    else:
        print(
            f"lowband run: {label}; bytes not measured (every rank shares this machine's loopback)",
            file=out,
        )


def _write_report(
    path: Path,
    label: str,
    shaped: bool,
    layout: Layout,
    codes: list[int],
    before: list[dict[str, int]],
    after: list[dict[str, int]],
    changes: list[dict[str, Any]],
) -> None:
    machines: list[dict[str, Any]] = []
    k = layout.ranks_per_machine
    for m, (b, a) in enumerate(zip(before, after)):
        delta = {key: a[key] - b[key] for key in ("tx", "rx", "local")}
        machines.append({"machine": m, "ranks": list(range(m * k, m * k + k)), **delta})
    data = {
        "testbed": label, "shaped": shaped, "exit_codes": codes, "machines": machines, "rate_changes": changes,
    }  # fmt: skip
    path.write_text(json.dumps(data, indent=1))
