"""A rendezvous store that outlives every rank, for runs whose survivors go on (``lowband run
--keep-going``).

Under a plain ``env://`` start rank 0 hosts the store, so rank 0's death ends it, and with it the
membership agreement of ``on_peer_loss=continue``. Here the launcher hosts it instead and every rank is
a client (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun): in loopback mode in the launcher's own
process on 127.0.0.1 (:func:`lowband.launcher.loopback_store`); with emulated links in a small process
of its own inside the testbed's bridge namespace, on the bridge's address ``SUBNET.254``, so every
machine reaches it over its own link and no rank's link carries the others' store traffic.

``python -m lowband.testbed.store_host ADDR`` is that process: it prints the port it listens on, then
serves until its standard input closes (the launcher ended, whatever the way); each line it reads
there is a death the launcher saw, written to the store (:mod:`lowband.comm.deaths`).
"""

from __future__ import annotations

import contextlib
import datetime
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lowband.comm.deaths import record_death
from lowband.errors import LowbandError
from lowband.testbed.leftovers import run_cmd
from lowband.testbed.namespaces import BRIDGE

if TYPE_CHECKING:
    from lowband.testbed.netns import Testbed

#: the bridge's host part in the testbed's /24 (machines are .1 .. .250)
HOST_PART = 254
_START_S = 30.0


def agent_env(addr: str, port: int) -> dict[str, str]:
    """The environment that makes every rank a client of the store at ``addr:port``."""
    return {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


class HostedStore:
    """The launcher's hold on the store it hosts: the ranks' environment, and the deaths it records
    (:mod:`lowband.comm.deaths`)."""

    def __init__(self, env: dict[str, str], store: Any = None, proc: subprocess.Popen[bytes] | None = None):
        self.env, self._store, self._proc, self._deaths = env, store, proc, 0

    def record_death(self, run: str, rank: int, status: int) -> None:
        """Best effort: a store host already gone is ignored (the survivors still have the heartbeat)."""
        self._deaths += 1
        try:
            if self._store is not None:
                record_death(self._store, run, self._deaths, rank, status)
            elif self._proc is not None and self._proc.stdin is not None:
                self._proc.stdin.write(f"death {run} {self._deaths} {rank} {status}\n".encode())
                self._proc.stdin.flush()
        except (OSError, RuntimeError):
            pass


@contextlib.contextmanager
def launcher_store(tb: Testbed) -> Iterator[HostedStore]:
    """Host a store for ``tb``'s ranks while the block runs."""
    if not tb.shaped:
        from lowband.launcher import loopback_store

        store, port = loopback_store()
        try:
            yield HostedStore(agent_env("127.0.0.1", port), store=store)
        finally:
            del store
        return
    addr = f"{tb.subnet}.{HOST_PART}"
    run_cmd(["ip", "-n", tb.bridge_ns, "addr", "add", f"{addr}/24", "dev", BRIDGE])
    run_cmd(["ip", "-n", tb.bridge_ns, "link", "set", "lo", "up"])  # the store dials its own address
    proc = subprocess.Popen(
        ["ip", "netns", "exec", tb.bridge_ns, sys.executable, "-m", "lowband.testbed.store_host", addr],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        yield HostedStore(agent_env(addr, _read_port(proc, addr)), proc=proc)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_port(proc: subprocess.Popen[bytes], addr: str) -> int:
    assert proc.stdout is not None
    deadline = time.monotonic() + _START_S
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], max(left, 0.0))
        chunk = proc.stdout.read1(64) if ready else b""  # type: ignore[attr-defined]
        if not chunk:
            proc.kill()
            proc.wait()
            raise LowbandError(
                f"lowband.testbed: the rendezvous store on {addr} did not start within {_START_S:g} s "
                f"(exit status {proc.returncode})"
            )
        line += chunk
    return int(line.decode().strip())


def main(argv: list[str]) -> int:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore(
        argv[0], 0, is_master=True, timeout=datetime.timedelta(seconds=600), wait_for_workers=False,
        multi_tenant=True,
    )  # fmt: skip
    print(store.port, flush=True)
    for line in sys.stdin.buffer:  # until the launcher closes it (or dies): the deaths it saw
        _, run, n, rank, status = line.decode().split()
        record_death(store, run, int(n), int(rank), int(status))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
