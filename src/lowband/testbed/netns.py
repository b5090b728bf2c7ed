"""Emulated links: one network namespace per machine, veth pairs to a bridge, tbf rate limits.

Layout of one testbed owned by process ``PID`` (``SEQ`` counts the testbeds that process made)::

    namespace PREFIX-PID-SEQ-br    bridge br0, ports vm0 .. vm{N-1}  (tbf on vmI: machine I's downlink)
    namespace PREFIX-PID-SEQ-mI    veth0 = 10.213.K.(I+1)/24         (tbf on veth0: machine I's uplink)
                                   lo (tbf when the layout has an intra-machine rate)

Every interface lives in a namespace the testbed created; the root namespace's interfaces, routes and
firewall are never touched. The owner pid in the names lets :func:`clean` recognise leftovers of a
crashed run and leave a live owner's testbed alone. Without root (or ``ip``/``tc``/tbf) the testbed
falls back to plain loopback and says ``UNSHAPED`` wherever it is labelled.

Building the namespaces and links is :mod:`lowband.testbed.namespaces`; this module names them, owns
their life cycle (up, down, signals, exit) and spawns the ranks into them.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from lowband.errors import InvalidArgumentError, LowbandError
from lowband.testbed.leftovers import (
    NamespaceInfo,
    check_prefix,
    clean,
    delete_netns,
    have_root,
    list_testbeds,
)
from lowband.testbed.links import DEFAULT_MTU, Layout, check_mtu
from lowband.testbed.namespaces import (
    RANK_IF,
    build_links,
    netns_iface_bytes,
    read_iface_bytes,
    reshape_link,
    shaping_available,
)
from lowband.testbed.procs import kill_group, start_procs, wait_procs

__all__ = [
    "NamespaceInfo",
    "Testbed",
    "clean",
    "have_root",
    "list_testbeds",
    "read_iface_bytes",
    "shaping_available",
    "wait_procs",
]

DEFAULT_PORT = 29500


_seq_lock = threading.Lock()
_seq = 0


def _next_seq() -> int:
    global _seq
    with _seq_lock:
        _seq += 1
        return _seq


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nccl_env(ifname: str) -> dict[str, str]:
    """NCCL's settings for ranks on emulated links: its traffic must cross the shaped interface like
    gloo's, so its same-host shortcuts (CUDA peer-to-peer, shared memory) and InfiniBand are off and its
    sockets bind to the rank's interface."""
    return {
        "NCCL_SOCKET_IFNAME": ifname,
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
    }


class Testbed:
    """N ranks on emulated links; a context manager that removes everything it made on exit.

    ``mode``: ``"auto"`` (namespaces when :func:`shaping_available`, else loopback with a warning on
    stderr), ``"netns"`` (raise if unavailable) or ``"loopback"`` (never shape).
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        layout: Layout,
        *,
        mode: str = "auto",
        prefix: str = "lb",
        port: int | None = None,
        mtu: int = DEFAULT_MTU,
    ) -> None:
        if not isinstance(layout, Layout):
            raise InvalidArgumentError(
                f"lowband.testbed.Testbed: layout must be a Layout, got {type(layout).__name__}"
            )
        if mode not in ("auto", "netns", "loopback"):
            raise InvalidArgumentError(
                f"lowband.testbed.Testbed: mode must be 'auto', 'netns' or 'loopback', got {mode!r}"
            )
        check_prefix(prefix)
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise InvalidArgumentError(f"lowband.testbed.Testbed: port must be in 1..65535, got {port!r}")
        self.mtu = check_mtu("lowband.testbed.Testbed", mtu)
        if layout.n_machines > 250:
            raise InvalidArgumentError(
                f"lowband.testbed.Testbed: at most 250 machines per testbed, got {layout.n_machines}"
            )
        self.layout = layout
        self.prefix = prefix
        if mode == "loopback":
            ok, reason = False, "loopback requested"
        else:
            ok, reason = shaping_available()
        if not ok and mode == "netns":
            raise LowbandError(
                f"lowband.testbed: cannot emulate links ({reason}); use mode='loopback' to run unshaped"
            )
        self.mode = "netns" if ok else "loopback"
        self.shaped = ok
        self.reason = reason
        if not ok and mode == "auto":
            print(
                f"lowband.testbed: link shaping unavailable ({reason}); running on plain loopback, UNSHAPED",
                file=sys.stderr,
            )
        self.seq = _next_seq()
        self.base = f"{prefix}-{os.getpid()}-{self.seq}"
        self.subnet = f"10.213.{(os.getpid() + self.seq) % 256}"
        self.port = port if port is not None else (DEFAULT_PORT if ok else _free_port())
        self.procs: list[subprocess.Popen[bytes]] = []
        self._delayers: list[Any] = []
        self._up = False
        self._prev_handlers: dict[int, Any] = {}
        #: overrides of every rank's store address (:func:`lowband.testbed.store_host.launcher_store`)
        self.store_env: dict[str, str] = {}

    # names and addresses -------------------------------------------------------------------------

    @property
    def bridge_ns(self) -> str:
        return f"{self.base}-br"

    def machine_ns(self, machine: int) -> str:
        return f"{self.base}-m{machine}"

    def namespaces(self) -> list[str]:
        """The namespaces this testbed creates (empty in loopback mode)."""
        if not self.shaped:
            return []
        return [self.machine_ns(m) for m in range(self.layout.n_machines)] + [self.bridge_ns]

    def address(self, machine: int) -> str:
        return f"{self.subnet}.{machine + 1}" if self.shaped else "127.0.0.1"

    def label(self) -> str:
        if self.shaped:
            return f"netns+tbf: {self.layout.describe()}, MTU {self.mtu}"
        return f"loopback (UNSHAPED: {self.reason}): {self.layout.world_size} ranks"

    def master_addr(self) -> str:
        return self.address(0)

    def ifname(self, rank: int) -> str:
        self.layout.machine_of(rank)
        return RANK_IF if self.shaped else "lo"

    def rank_env(self, rank: int) -> dict[str, str]:
        machine = self.layout.machine_of(rank)
        rpm = self.layout.ranks_per_machine
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.layout.world_size),
            "LOCAL_RANK": str(rank - machine * rpm),
            "LOCAL_WORLD_SIZE": str(rpm),
            "LOWBAND_LOCAL_SIZE": str(rpm),
            "MASTER_ADDR": self.master_addr(),
            "MASTER_PORT": str(self.port),
            "GLOO_SOCKET_IFNAME": self.ifname(rank),
            "LOWBAND_TESTBED_IFNAME": self.ifname(rank),
            "LOWBAND_TESTBED_SHAPED": "1" if self.shaped else "0",
            # the emulated machines share this host's GPUs: rank r computes on GPU r (lowband.devices)
            "LOWBAND_CUDA_INDEX": str(rank),
            **nccl_env(self.ifname(rank)),
            **self.store_env,
        }

    # life cycle ----------------------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.down()
        except LowbandError as e:
            if exc_type is None:
                raise
            print(f"lowband.testbed: tear-down after an error also failed: {e}", file=sys.stderr)

    def up(self) -> None:
        """Create the namespaces, links and qdiscs (idempotent); removes dead owners' leftovers first."""
        if self._up:
            return
        self._up = True
        self._install_handlers()
        try:
            if self.shaped:
                clean(self.prefix)
                self._build()
        except BaseException:
            self.down()
            raise

    def _build(self) -> None:
        self._delayers.extend(
            build_links(self.layout, self.bridge_ns, self.machine_ns, self.address, self.mtu)
        )

    def down(self) -> None:
        """Kill this testbed's processes and remove every namespace, link and rule it made (idempotent)."""
        if not self._up:
            return
        self._up = False
        try:
            for proc in self.procs:
                kill_group(proc)
            for delayer in self._delayers:
                delayer.stop()
            self._delayers.clear()
            left = [
                ns
                for ns in sorted(self.namespaces(), key=lambda n: n.endswith("-br"))
                if not delete_netns(ns)
            ]
            if left:
                raise LowbandError(f"lowband.testbed: could not remove namespaces {', '.join(left)}")
        finally:
            self._restore_handlers()

    def _install_handlers(self) -> None:
        atexit.register(self.down)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._prev_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        atexit.unregister(self.down)
        for sig, prev in self._prev_handlers.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev)
        self._prev_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        self.down()
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # ranks ---------------------------------------------------------------------------------------

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        stdout: Any = None,
        stderr: Any = None,
        ranks: Sequence[int] | None = None,
    ) -> list[subprocess.Popen[bytes]]:
        """Start one process per rank running ``argv`` in its machine's namespace (own session each).

        The environment is ``os.environ`` + ``env`` + :meth:`rank_env`. ``stdout``/``stderr`` are
        passed to :class:`subprocess.Popen`; a list or tuple gives one per rank. ``ranks``: only these
        (a replacement of a lost rank), default every rank.
        """
        if not self._up:
            raise LowbandError(
                "lowband.testbed.spawn: the testbed is not up; use `with Testbed(...)` or up()"
            )
        if isinstance(argv, str) or not argv:
            raise InvalidArgumentError(
                f"lowband.testbed.spawn: argv must be a non-empty list of strings, got {argv!r}"
            )
        n = self.layout.world_size
        cmds, envs = [], []
        for rank in range(n) if ranks is None else ranks:
            ns = self.machine_ns(self.layout.machine_of(rank))
            cmds.append(["ip", "netns", "exec", ns, *argv] if self.shaped else list(argv))
            envs.append({**os.environ, **(env or {}), **self.rank_env(rank)})
        procs = start_procs(cmds, envs, stdout=stdout, stderr=stderr, what="lowband.testbed.spawn")
        self.procs.extend(procs)
        return procs

    def machine_env(self, machine: int) -> dict[str, str]:
        """The environment of a process standing for a whole machine (a launcher agent started by
        :meth:`spawn_machines`): its interface names and the machine's address, no rank."""
        if (
            isinstance(machine, bool)
            or not isinstance(machine, int)
            or not 0 <= machine < self.layout.n_machines
        ):
            raise InvalidArgumentError(
                f"lowband.testbed: machine must be an int in [0, {self.layout.n_machines}), got {machine!r}"
            )
        ifname = RANK_IF if self.shaped else "lo"
        return {
            **nccl_env(ifname),
            "GLOO_SOCKET_IFNAME": ifname,
            "LOWBAND_TESTBED_IFNAME": ifname,
            "LOWBAND_TESTBED_SHAPED": "1" if self.shaped else "0",
            "LOWBAND_TESTBED_ADDR": self.address(machine),
        }

    def spawn_machines(
        self,
        argvs: Sequence[Sequence[str]],
        env: Mapping[str, str] | None = None,
        stdout: Any = None,
        stderr: Any = None,
    ) -> list[subprocess.Popen[bytes]]:
        """Start ``argvs[m]`` once in each machine's namespace (a launcher agent per machine, as on a
        real cluster), with ``os.environ`` + ``env`` + :meth:`machine_env`; killed on tear-down."""
        if not self._up:
            raise LowbandError("lowband.testbed.spawn_machines: the testbed is not up")
        if len(argvs) != self.layout.n_machines or any(isinstance(a, str) or not a for a in argvs):
            raise InvalidArgumentError(
                f"lowband.testbed.spawn_machines: need one non-empty argv per machine "
                f"({self.layout.n_machines}), got {argvs!r}"
            )
        cmds = [
            ["ip", "netns", "exec", self.machine_ns(m), *a] if self.shaped else list(a)
            for m, a in enumerate(argvs)
        ]
        envs = [{**os.environ, **(env or {}), **self.machine_env(m)} for m in range(len(argvs))]
        procs = start_procs(cmds, envs, stdout=stdout, stderr=stderr, what="lowband.testbed.spawn_machines")
        self.procs.extend(procs)
        return procs

    def set_rate(self, machine: int, rate: float) -> None:
        """Re-shape machine ``machine``'s link to ``rate`` bits/s both ways, ranks running (link drift)."""
        if not self.shaped or not self._up:
            raise LowbandError("lowband.testbed.set_rate: no shaped testbed is up")
        reshape_link(self.bridge_ns, self.machine_ns(machine), machine, rate, self.mtu)

    def link_bytes(self) -> list[dict[str, int]]:
        """Per machine, the kernel's byte counters now: ``tx``/``rx`` of its link to the bridge and
        ``local`` (bytes over its loopback: traffic between ranks of one machine). Empty in loopback
        mode, where every rank shares this machine's ``lo``."""
        out = []
        for m in range(self.layout.n_machines if self.shaped else 0):
            tx, rx = netns_iface_bytes(self.machine_ns(m), RANK_IF)
            out.append({"tx": tx, "rx": rx, "local": netns_iface_bytes(self.machine_ns(m), "lo")[0]})
        return out

    def wait(
        self,
        procs: Sequence[subprocess.Popen[bytes]],
        timeout: float,
        *,
        grace: float = 30.0,
        exited: list[int] | None = None,
    ) -> list[int]:
        """Wait for every process; returns their exit codes in order (a killed one reads -9).

        Once one exits non-zero the others get ``grace`` seconds, then are killed. Past ``timeout``
        everything left is killed and :class:`CommTimeoutError` names the ranks still running.
        ``exited`` (a list) receives the ranks in the order they were seen to end.
        """
        return wait_procs(list(procs), timeout, grace=grace, exited=exited)
