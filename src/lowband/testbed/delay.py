"""Optional one-way delay on a namespace's receive path: an NFQUEUE rule plus a userspace delayer.

The kernel here has no ``netem``. Instead, an iptables rule on the INPUT chain of the receiving
namespace (``-i <veth> -j NFQUEUE``) hands every incoming packet to a small process in that
namespace, which gives the ACCEPT verdict ``delay_ms`` after the packet arrived. Faithful at
100 Mbit/s; CPU-bound near 1 Gbit/s.

Needs the ``iptables`` command and the PyPI package ``NetfilterQueue`` (built against Debian's
``libnetfilter-queue-dev``); both are imported/looked up lazily, so the rest of the testbed works
without them. The delayer runs as ``python .../delay.py --queue Q --delay-ms D`` inside the namespace;
run as a script it imports only the standard library and NetfilterQueue (not torch, which costs
seconds), so lowband's own imports below are made where they are needed.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

INSTALL_HINT = (
    "apt-get install -y libnetfilter-queue-dev iptables && pip install NetfilterQueue "
    "(the delayer also needs root)"
)


def delay_available() -> tuple[bool, str]:
    """(ok, reason): can this machine add one-way delay? ``reason`` says what is missing."""
    missing = []
    if shutil.which("iptables") is None:
        missing.append("the iptables command")
    if importlib.util.find_spec("netfilterqueue") is None:
        missing.append("the Python module netfilterqueue")
    if os.geteuid() != 0:
        missing.append("root")
    if missing:
        return False, f"one-way delay needs {' and '.join(missing)}: {INSTALL_HINT}"
    return True, ""


def require_delay() -> None:
    """Raise :class:`LowbandError` saying what to install when delay is unavailable."""
    from lowband.errors import LowbandError

    ok, reason = delay_available()
    if not ok:
        raise LowbandError(f"lowband.testbed: {reason}")


class Delayer:
    """Delays every packet that enters namespace ``netns`` through ``ifname`` by ``delay_ms``."""

    def __init__(self, netns: str, ifname: str, delay_ms: float, queue_num: int = 0) -> None:
        from lowband.errors import InvalidArgumentError

        if not delay_ms > 0:
            raise InvalidArgumentError(f"lowband.testbed Delayer: delay_ms must be > 0, got {delay_ms!r}")
        if not 0 <= queue_num < 65536:
            raise InvalidArgumentError(
                f"lowband.testbed Delayer: queue_num must be in [0, 65536), got {queue_num}"
            )
        self.netns = netns
        self.ifname = ifname
        self.delay_ms = float(delay_ms)
        self.queue_num = queue_num
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout: float = 15.0) -> None:
        """Start the delayer process in the namespace, wait until it listens, then add the rule."""
        from lowband.errors import LowbandError

        require_delay()
        cmd = ["ip", "netns", "exec", self.netns, sys.executable, os.path.abspath(__file__)]
        cmd += ["--queue", str(self.queue_num), "--delay-ms", repr(self.delay_ms)]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        assert self.proc.stdout is not None
        # poll, not select: select() fails for descriptors >= 1024 (a long-lived test process has many)
        poller = select.poll()
        poller.register(self.proc.stdout, select.POLLIN)
        ready = poller.poll(ready_timeout * 1000)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.stop()
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            raise LowbandError(
                f"lowband.testbed: the delayer in namespace {self.netns} did not start within "
                f"{ready_timeout:g} s: {err.strip() or 'no output'}"
            )
        rule = ["-i", self.ifname, "-j", "NFQUEUE", "--queue-num", str(self.queue_num)]
        res = subprocess.run(
            ["ip", "netns", "exec", self.netns, "iptables", "-w", "-A", "INPUT", *rule],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            self.stop()
            raise LowbandError(
                f"lowband.testbed: adding the NFQUEUE rule in namespace {self.netns} failed: "
                f"{res.stderr.strip()} ({INSTALL_HINT})"
            )

    def stop(self) -> None:
        """Kill the delayer (idempotent). The rule goes with the namespace."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_delayer(queue_num: int, delay_ms: float) -> None:
    """The delayer's loop: accept each queued packet ``delay_ms`` after it was queued (FIFO)."""
    from netfilterqueue import COPY_META, NetfilterQueue

    delay = delay_ms / 1000.0
    pending: collections.deque[tuple[float, Any]] = collections.deque()

    def on_packet(pkt: Any) -> None:
        pending.append((time.monotonic() + delay, pkt))

    nfq = NetfilterQueue()
    nfq.bind(queue_num, on_packet, max_len=65536, mode=COPY_META, sock_len=64 * 1024 * 1024)
    fd = nfq.get_fd()
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            pending.popleft()[1].accept()
        wait = pending[0][0] - now if pending else 1.0
        readable, _, _ = select.select([fd], [], [], max(wait, 0.0))
        if readable:
            nfq.run(block=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="delay.py", description=__doc__)
    parser.add_argument("--queue", type=int, default=0, help="NFQUEUE number to serve")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay in milliseconds")
    ns = parser.parse_args(argv)
    run_delayer(ns.queue, ns.delay_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
