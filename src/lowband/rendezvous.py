"""Joining a world from the launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), as torch's ``env://`` does, but with errors that say what went wrong.

torch's ``env://`` rendezvous, when a rank never comes, fails deep inside the first process group's
connection set-up with a raw store error (a C++ stack dump) after its timeout, without saying who is
missing. Here each rank connects to the store, announces itself under a key of its own and waits, bounded,
for every rank's key; a rank that waits in vain raises :class:`CommTimeoutError` naming the ranks that
did not join. A store that cannot be reached is reported with its address and who hosts it.

The store is torch's: under torchrun, ``lowband run`` and :func:`lowband.launch` the launcher hosts it
and every rank is a client (``TORCHELASTIC_USE_AGENT_STORE``); otherwise rank 0 hosts it, as with
``env://``.
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import time
from typing import Any

from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from lowband.errors import CommTimeoutError, InvalidArgumentError

_round = itertools.count()


def _env_int(name: str, low: int) -> int:
    raw = os.environ.get(name, "")
    if not raw.strip().lstrip("-").isdigit() or int(raw) < low:
        raise InvalidArgumentError(
            f"lowband.init: environment variable {name}={raw!r} must be an int >= {low}"
        )
    return int(raw)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _reachable(addr: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to ``addr:port`` opens within ``timeout`` seconds (retrying)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((addr, port), timeout=max(0.05, min(1.0, left))).close()
            return True
        except OSError:
            if left <= 0:
                return False
            time.sleep(min(0.1, max(0.0, left)))


def join_env(timeout: float) -> tuple[Any, int, int]:
    """Connect to the environment's store and wait until every rank has; returns ``(store, rank, size)``."""
    size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if rank >= size:
        raise InvalidArgumentError(f"lowband.init: RANK={rank} is not below WORLD_SIZE={size}")
    addr = os.environ.get("MASTER_ADDR", "")
    if not addr:
        raise InvalidArgumentError("lowband.init: RANK and WORLD_SIZE are set but MASTER_ADDR is not")
    port = _env_int("MASTER_PORT", 1)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    td = datetime.timedelta(seconds=timeout)
    host = "the launcher" if agent else "rank 0"
    hosting = rank == 0 and not agent
    unreachable = (
        f"lowband.init on rank {rank}: cannot reach the rendezvous store at {addr}:{port}, hosted by "
        f"{host}, within {timeout:g} s (was {host} started, and are MASTER_ADDR/MASTER_PORT right?)"
    )
    if not hosting and not _reachable(addr, port, timeout):  # (torch's client would log stack dumps)
        raise CommTimeoutError(unreachable)
    try:
        store = TCPStore(addr, port, is_master=hosting, timeout=td, wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, TimeoutError, ValueError) as exc:
        raise CommTimeoutError(f"{unreachable}: {_first_line(exc)}") from None
    prefix = "lowband/join/{}/{}/{}/".format(
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        next(_round),
    )
    keys = [f"{prefix}{r}" for r in range(size)]
    try:
        store.set(keys[rank], "1")
        store.wait(keys, td)
    except (RuntimeError, TimeoutError) as exc:
        try:
            missing = [r for r in range(size) if not store.check([keys[r]])]
        except (RuntimeError, TimeoutError):
            missing = []
        what = (
            f"rank(s) {missing} of {size} did not join within {timeout:g} s (were they started, and do they "
            "call lowband.init()?)"
            if missing
            else f"the rendezvous store at {addr}:{port} failed: {_first_line(exc)}"
        )
        raise CommTimeoutError(f"lowband.init on rank {rank}: {what}") from None
    # each attempt of an elastic run (torchrun --max-restarts) meets under its own prefix: the store
    # outlives the attempts, and the previous attempt's process-group keys name dead ranks' addresses
    attempt = "lowband/attempt/{}/{}".format(
        os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )
    return PrefixStore(attempt, store), rank, size
