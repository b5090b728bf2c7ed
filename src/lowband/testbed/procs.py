"""Process control for testbed ranks: start one process per rank in its own session, wait with a
bound, kill a whole process group (the rank and anything it started)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lowband.blame import proc_state
from lowband.errors import CommTimeoutError, InvalidArgumentError


def start_procs(
    cmds: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    *,
    stdout: Any = None,
    stderr: Any = None,
    what: str = "lowband.testbed.spawn",
) -> list[subprocess.Popen[bytes]]:
    """Start ``cmds[r]`` with ``envs[r]``, each in a new session; a list/tuple ``stdout``/``stderr``
    gives one per process. If one fails to start, the ones already started are killed."""
    n = len(cmds)
    for name, value in (("stdout", stdout), ("stderr", stderr)):
        if isinstance(value, list | tuple) and len(value) != n:
            raise InvalidArgumentError(f"{what}: {name} has {len(value)} entries, the world has {n} ranks")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, (cmd, env) in enumerate(zip(cmds, envs)):
            procs.append(
                subprocess.Popen(
                    list(cmd),
                    env=dict(env),
                    stdout=stdout[rank] if isinstance(stdout, list | tuple) else stdout,
                    stderr=stderr[rank] if isinstance(stderr, list | tuple) else stderr,
                    start_new_session=True,
                )
            )
    except BaseException:
        for proc in procs:
            kill_group(proc)
        raise
    return procs


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_procs(
    procs: list[subprocess.Popen[bytes]],
    timeout: float,
    *,
    grace: float = 30.0,
    exited: list[int] | None = None,
    stopped: list[int] | None = None,
    killed: list[int] | None = None,
    ended_at: dict[int, float] | None = None,
    keep_going: bool = False,
    replace: Callable[[int, int], subprocess.Popen[bytes] | None] | None = None,
) -> list[int]:
    """:meth:`Testbed.wait` for any processes started with ``start_new_session=True``; ``exited``, when
    given, receives the indices of the processes in the order they were seen to end (of those seen in
    one poll, the ones killed by a signal first: the others' errors follow from a peer's death), and
    ``ended_at`` when each was seen ending (``time.time()``).

    Once one has failed, a process found stopped (state ``T``: SIGSTOP, a suspended job) is the likely
    cause of the others' timeouts and will not end by itself: it is killed at once and its index put
    in ``stopped``; the others get ``grace`` seconds to end, and those still running then are killed
    and put in ``killed``.

    ``keep_going`` (``lowband run --keep-going``): a failed process does not end the others, which
    train on without it. The grace period starts when the first process ends *successfully* (the
    survivors end together); a stopped process is killed (and put in ``stopped``) once every other one
    has ended. ``replace`` (with ``keep_going``): called once with the index and exit code of each
    process that failed while none had ended successfully; a process it returns takes its place in
    ``procs`` (a replacement that joins the survivors), None: it stays lost."""
    if timeout <= 0 or grace < 0:
        raise InvalidArgumentError(
            f"lowband.testbed.wait: need timeout > 0 and grace >= 0, got {timeout}, {grace}"
        )
    deadline = time.monotonic() + timeout
    kill_at: float | None = None
    offered: set[int] = set()  # the failed processes ``replace`` was called for (once each)
    joiners: set[int] = set()  # the indices whose process is a replacement
    while True:
        codes = [p.poll() for p in procs]
        if keep_going and replace is not None:
            for r, c in enumerate(codes):
                if c not in (None, 0) and id(procs[r]) not in offered and not any(x == 0 for x in codes):
                    offered.add(id(procs[r]))
                    joiner = replace(r, c)
                    if joiner is not None:
                        procs[r], codes[r] = joiner, None  # (the caller's list: it sees the replacement)
                        joiners.add(r)
                        if ended_at is not None:
                            ended_at.pop(r, None)
        if ended_at is not None:
            now_wall = time.time()
            for r, c in enumerate(codes):
                if c is not None:
                    ended_at.setdefault(r, now_wall)
        if exited is not None:
            new = [r for r, c in enumerate(codes) if c is not None and r not in exited]
            exited.extend(sorted(new, key=lambda r: (int(codes[r] or 0) >= 0, r)))
        running = [r for r, c in enumerate(codes) if c is None]
        if not running:
            return [int(c) for c in codes if c is not None]
        now = time.monotonic()
        if keep_going:
            others = [c for r, c in enumerate(codes) if r not in joiners]
            if kill_at is None and (any(c == 0 for c in codes) or (joiners and None not in others)):
                kill_at = now + grace  # the survivors end together; or nobody is left for a replacement
            if len(running) < len(procs) and all(proc_state(procs[r].pid) == "T" for r in running):
                for r in running:
                    if stopped is not None:
                        stopped.append(r)
                    kill_group(procs[r])
                continue
        elif kill_at is None and any(c not in (None, 0) for c in codes):
            kill_at = now + grace
            for r in running:
                if proc_state(procs[r].pid) == "T":
                    if stopped is not None:
                        stopped.append(r)
                    kill_group(procs[r])
            continue
        if kill_at is not None and now >= kill_at:
            for r in running:
                if killed is not None:
                    killed.append(r)
                kill_group(procs[r])
            continue
        if now >= deadline:
            for r in running:
                kill_group(procs[r])
            raise CommTimeoutError(
                f"lowband.testbed.wait: ranks {running} still running after {timeout:g} s; killed them "
                f"(exit codes of the others: { {r: c for r, c in enumerate(codes) if c is not None} })"
            )
        time.sleep(0.02)
