"""A process that owns a testbed and then waits to be killed (the testbed's crash-path test).

Brings up a 2-rank testbed, starts a sleeping process in each rank's namespace, prints one JSON line
(namespaces, rank pids) and sleeps inside the ``with`` block until a signal arrives.
"""

from __future__ import annotations

import json
import time

from lowband.testbed import Layout, Testbed


def main() -> None:
    with Testbed(Layout.flat(2, "10mbit"), mode="netns") as tb:
        procs = tb.spawn(["sleep", "120"])
        print(json.dumps({"namespaces": tb.namespaces(), "pids": [p.pid for p in procs]}), flush=True)
        time.sleep(120)


if __name__ == "__main__":
    main()
