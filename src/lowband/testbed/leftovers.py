"""The testbed's system plumbing: running ``ip``/``tc``, and finding and removing leftovers.

A testbed's namespaces are named ``PREFIX-PID-...`` after the process that owns them, so a later run
(or ``lowband testbed clean``) can tell a crashed run's leftovers (owner dead) from a live testbed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from lowband.errors import InvalidArgumentError, LowbandError

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")
#: per-namespace files ``ip netns exec`` mounts over ``/etc`` (the testbed writes ``hosts`` there)
NETNS_ETC = "/etc/netns"


def run_cmd(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LowbandError(f"lowband.testbed: `{' '.join(cmd)}` could not run: {e}") from e
    if check and res.returncode != 0:
        raise LowbandError(
            f"lowband.testbed: `{' '.join(cmd)}` failed (exit {res.returncode}): {res.stderr.strip()}"
        )
    return res


def have_root() -> bool:
    """True when this process runs as root (needed for namespaces and qdiscs)."""
    return os.geteuid() == 0


@dataclass(frozen=True)
class NamespaceInfo:
    """A testbed namespace found on the machine."""

    name: str
    owner_pid: int
    alive: bool


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def list_testbeds(prefix: str = "lb") -> list[NamespaceInfo]:
    """Every namespace that looks like a testbed's (``PREFIX-PID-...``), with its owner and liveness."""
    check_prefix(prefix)
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-(?:\d+-(?:br|m\d+)|probe)$")
    try:
        names = sorted(os.listdir("/run/netns"))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = pattern.match(name)
        if m:
            pid = int(m.group(1))
            out.append(NamespaceInfo(name, pid, _pid_alive(pid)))
    return out


def _kill_netns_pids(ns: str) -> None:
    res = run_cmd(["ip", "netns", "pids", ns], check=False)
    for tok in res.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def delete_netns(ns: str) -> bool:
    """Kill what still runs in ``ns`` and delete it (its veths go with it) and its files under
    :data:`NETNS_ETC`; True if it is gone."""
    _kill_netns_pids(ns)
    run_cmd(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
    return not os.path.exists(f"/run/netns/{ns}")


def clean(prefix: str = "lb") -> list[str]:
    """Remove testbed namespaces (and their links) whose owner process is dead; returns their names.

    Processes still running inside such a namespace (ranks of a crashed run) are killed first.
    Namespaces of a live owner are never touched.
    """
    dead = [info.name for info in list_testbeds(prefix) if not info.alive]
    if dead and not have_root():
        raise LowbandError(f"lowband testbed clean: removing {', '.join(dead)} needs root")
    # machines before bridges, so no veth outlives its bridge namespace's deletion for long
    dead.sort(key=lambda n: n.endswith("-br"))
    removed = [ns for ns in dead if delete_netns(ns)]
    for name in _orphan_etc(prefix):  # a crash between deleting a namespace and its files
        shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
    return removed


def _orphan_etc(prefix: str) -> list[str]:
    """Folders under :data:`NETNS_ETC` of testbed namespaces that no longer exist, of dead owners."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-\d+-m\d+$")
    try:
        names = os.listdir(NETNS_ETC)
    except OSError:
        return []
    return [
        n
        for n in names
        if (m := pattern.match(n))
        and not _pid_alive(int(m.group(1)))
        and not os.path.exists(f"/run/netns/{n}")
    ]


def check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise InvalidArgumentError(
            f"lowband.testbed: prefix must be 1-10 lowercase letters/digits starting with a letter, got {prefix!r}"
        )
