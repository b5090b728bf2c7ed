"""Namespace set-up of the testbed: whether links can be shaped here, and building one testbed's
namespaces, veth links, bridge and tbf qdiscs (:class:`lowband.testbed.netns.Testbed` owns the names
and the life cycle, and spawns the ranks).
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from lowband.errors import InvalidArgumentError
from lowband.testbed.leftovers import NETNS_ETC, have_root, run_cmd
from lowband.testbed.links import DEFAULT_MTU, Layout

if TYPE_CHECKING:
    from lowband.testbed.delay import Delayer

BRIDGE = "br0"
RANK_IF = "veth0"
TBF_LATENCY = "100ms"
MIN_BURST = 64 * 1024


@functools.lru_cache(maxsize=1)
def shaping_available() -> tuple[bool, str]:
    """(ok, reason): can this machine build shaped links? Checks root, ``ip``/``tc``, and really
    creates a bridge, a veth pair and a tbf qdisc in a throw-away namespace (result cached)."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if not have_root():
        return False, "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"the `{tool}` command (iproute2) is missing"
    probe = f"lb-{os.getpid()}-probe"
    cmds = [
        ["ip", "netns", "add", probe],
        ["ip", "-n", probe, "link", "add", "pb0", "type", "bridge"],
        ["ip", "-n", probe, "link", "add", "pv0", "type", "veth", "peer", "name", "pv1"],
        ["tc", "-n", probe, "qdisc", "add", "dev", "pv0", "root", "tbf", *tbf_args(1e8)],
    ]
    try:
        for cmd in cmds:
            res = run_cmd(cmd, check=False)
            if res.returncode != 0:
                what = "tbf qdisc (sch_tbf)" if cmd[0] == "tc" else " ".join(cmd[3:6])
                return False, f"the kernel refused {what}: {res.stderr.strip()}"
    finally:
        run_cmd(["ip", "netns", "del", probe], check=False)
    return True, ""


def tbf_args(rate: float, mtu: int = DEFAULT_MTU) -> list[str]:
    """tbf parameters: burst of 4 ms of traffic at ``rate``, at least 64 KiB and 2 frames; 100 ms queue."""
    burst = max(MIN_BURST, int(rate / 8 / 250), 2 * (mtu + 64))
    return ["rate", f"{int(rate)}bit", "burst", str(burst), "latency", TBF_LATENCY]


def read_iface_bytes(ifname: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of interface ``ifname`` in the calling process's network namespace."""
    with open("/proc/net/dev") as f:
        return _parse_net_dev(f.read(), ifname, "this namespace")


def netns_iface_bytes(ns: str, ifname: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of interface ``ifname`` in network namespace ``ns`` (read from outside it,
    so also before its processes start and after they end)."""
    res = run_cmd(["ip", "netns", "exec", ns, "cat", "/proc/net/dev"])
    return _parse_net_dev(res.stdout, ifname, f"namespace {ns}")


def _parse_net_dev(text: str, ifname: str, where: str) -> tuple[int, int]:
    for line in text.splitlines()[2:]:
        name, _, data = line.partition(":")
        if name.strip() == ifname:
            fields = data.split()
            return int(fields[8]), int(fields[0])
    raise InvalidArgumentError(f"lowband.testbed.read_iface_bytes: no interface {ifname!r} in {where}")


def _tbf(ns: str, dev: str, rate: float, mtu: int, verb: str = "add") -> None:
    run_cmd(["tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "tbf", *tbf_args(rate, mtu)])


def reshape_link(bridge_ns: str, ns: str, machine: int, rate: float, mtu: int) -> None:
    """Change machine ``machine``'s link (namespace ``ns``) to ``rate`` bits/s both ways while it carries
    traffic: its uplink (``veth0``) and downlink (the bridge's port ``vmM``) tbf qdiscs are replaced in
    place (``tc qdisc replace``: the same qdisc, new rate and burst; no link goes down)."""
    _tbf(ns, RANK_IF, rate, mtu, "replace")
    _tbf(bridge_ns, f"vm{machine}", rate, mtu, "replace")


def write_hosts(ns: str, addresses: list[str]) -> None:
    """Give the processes of namespace ``ns`` a hosts file naming every machine's address
    (``lowband-m0`` ..., IPv4 and IPv4-mapped IPv6) after this machine's own ``/etc/hosts``: ``ip netns exec`` mounts
    ``/etc/netns/NS/hosts`` over ``/etc/hosts`` for them. Without it, torch's TCP store looks up the
    name of each rank that connects, the namespace reaches no DNS server, and c10d warns "The hostname
    of the client socket cannot be retrieved" once per rank."""
    try:
        with open("/etc/hosts", encoding="utf-8", errors="replace") as f:
            own = f.read()
    except OSError:
        own = "127.0.0.1 localhost\n::1 localhost\n"
    # torch's store listens on a dual-stack socket: it sees its clients as IPv4-mapped IPv6 addresses
    pairs = [(addr, f"lowband-m{m}") for m, addr in enumerate(addresses)] + [("127.0.0.1", "localhost")]
    names = "".join(f"{a} {n}\n::ffff:{a} {n}\n" for a, n in pairs) + "::1 localhost\n"
    folder = os.path.join(NETNS_ETC, ns)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hosts"), "w", encoding="utf-8") as f:
            f.write(own.rstrip("\n") + "\n# lowband testbed machines\n" + names)
    except OSError as e:  # a read-only /etc: the ranks run, and c10d may warn
        print(
            f"lowband.testbed: cannot write {folder}/hosts ({e}); c10d may warn about host names",
            file=sys.stderr,
        )


def build_links(
    layout: Layout, bridge_ns: str, machine_ns: Callable[[int], str], address: Callable[[int], str], mtu: int
) -> list[Delayer]:
    """Create the bridge namespace and one namespace per machine, linked by veth pairs with their
    rate limits (and delays: the started delayers are returned, to be stopped on tear-down), and each
    machine's hosts file (:func:`write_hosts`)."""
    br = bridge_ns
    delayers: list[Delayer] = []
    addresses = [address(m) for m in range(layout.n_machines)]
    run_cmd(["ip", "netns", "add", br])
    run_cmd(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"])
    run_cmd(["ip", "-n", br, "link", "set", BRIDGE, "up"])
    for m, spec in enumerate(layout.machines):
        ns, port = machine_ns(m), f"vm{m}"
        run_cmd(["ip", "netns", "add", ns])
        write_hosts(ns, addresses)
        run_cmd(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", RANK_IF, "netns", ns])
        run_cmd(["ip", "-n", br, "link", "set", port, "mtu", str(mtu), "master", BRIDGE, "up"])
        run_cmd(["ip", "-n", ns, "link", "set", RANK_IF, "mtu", str(mtu), "up"])
        run_cmd(["ip", "-n", ns, "addr", "add", f"{address(m)}/24", "dev", RANK_IF])
        run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        if spec.up is not None:
            _tbf(ns, RANK_IF, spec.up, mtu)
        if spec.down is not None:
            _tbf(br, port, spec.down, mtu)
        if layout.intra is not None and layout.ranks_per_machine > 1:
            run_cmd(["ip", "-n", ns, "link", "set", "lo", "mtu", str(mtu)])
            _tbf(ns, "lo", layout.intra, mtu)
        if spec.delay_ms > 0:
            from lowband.testbed.delay import Delayer

            delayer = Delayer(ns, RANK_IF, spec.delay_ms)
            delayers.append(delayer)
            delayer.start()
    return delayers
