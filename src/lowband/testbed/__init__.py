"""Link emulation: ranks in network namespaces joined by rate-limited veth links (see netns.py)."""

from lowband.testbed.delay import Delayer, delay_available
from lowband.testbed.links import Layout, LinkSpec, format_rate, parse_rate
from lowband.testbed.netns import (
    NamespaceInfo,
    Testbed,
    clean,
    have_root,
    list_testbeds,
    read_iface_bytes,
    shaping_available,
    wait_procs,
)

__all__ = [
    "Delayer",
    "Layout",
    "LinkSpec",
    "NamespaceInfo",
    "Testbed",
    "clean",
    "delay_available",
    "format_rate",
    "have_root",
    "list_testbeds",
    "parse_rate",
    "read_iface_bytes",
    "shaping_available",
    "wait_procs",
]
