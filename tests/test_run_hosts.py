"""Several emulated machines as hosts (root and link shaping needed, skipped otherwise): each runs its own
torchrun agent and they meet through a c10d rendezvous over the emulated links; a stopped rank ends a
run within the communication timeout; ``lowband testbed up``/``down``."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from test_run_testbed import ENV, PY, SCRIPT, _netns_of, _procs_running, _run

from lowband.testbed import Layout, Testbed, shaping_available

_OK, _WHY = shaping_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"link shaping unavailable here: {_WHY}")


def test_a_stopped_rank_ends_the_run_within_the_timeout_and_grace(tmp_path: Path) -> None:
    start = time.monotonic()
    args = ["-n", "2", "--rate", "1gbit", "--timeout", "3", "--grace", "1"]
    out = _run([*args, str(SCRIPT), "stop", str(tmp_path)], tmp_path)
    took = time.monotonic() - start
    assert out.returncode == 1, out.stderr[-3000:]
    assert "lowband run: rank 1 stopped answering first" in out.stderr, out.stderr[-3000:]  # the cause
    assert "CommTimeoutError" in out.stderr or "timed out" in out.stderr, out.stderr[-3000:]
    assert took < 3 + 1 + 30, took  # timeout + grace + the ranks' start (loaded machine)
    assert _procs_running(str(tmp_path)) == []


def test_two_hosts_each_with_its_own_torchrun_agent(tmp_path: Path) -> None:
    """Two emulated machines act as hosts: each runs ``lowband run --nnodes 2 -n 2 --rdzv-endpoint``
    (torchrun's agent) in its namespace; the agents meet through a c10d rendezvous on machine 0's
    address, over the emulated links; 4 ranks, 2 per host, train the hierarchical strategy."""
    port = 29400
    with Testbed(Layout.two_tier(2, 2, "200mbit"), mode="netns") as tb:
        before = tb.link_bytes()
        endpoint = f"{tb.address(0)}:{port}"
        argvs = [
            [PY, "-m", "lowband.cli", "run", "--nnodes", "2", "-n", "2", "--rdzv-endpoint", endpoint,
             "--rdzv-id", "twohost", "--rdzv-conf", f"is_host={1 if m == 0 else 0}", "--max-restarts", "0",
             "--local-addr", tb.address(m),
             "--timeout", "60", str(SCRIPT), "twohost", str(tmp_path)]
            for m in range(2)
        ]  # fmt: skip
        procs = tb.spawn_machines(argvs, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        codes = tb.wait(procs, timeout=150, grace=10)
        logs = [p.stdout.read().decode(errors="replace")[-3000:] for p in procs]  # type: ignore[union-attr]
        assert codes == [0, 0], logs
        after = tb.link_bytes()
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    by_addr: dict[str, list[dict[str, object]]] = {}
    for info in infos:
        assert info["local_size"] == 2 and info["machine_size"] == 2, info
        assert info["machine_rank"] == info["rank"] // 2 and info["local_rank"] == info["rank"] % 2, info
        by_addr.setdefault(info["addr"], []).append(info)
    # the two ranks of a machine are the two ranks of one emulated host (one namespace, one agent)
    assert sorted(by_addr) == sorted(tb.address(m) for m in range(2))
    assert all({i["machine_rank"] for i in group} in ({0}, {1}) for group in by_addr.values())
    for info in infos:
        m, lr = int(info["machine_rank"]), int(info["local_rank"])
        assert info["local_sum"] == 2 * m + (2 * m + 1)  # the machine's own two ranks
        assert info["across_sum"] == lr + (2 + lr)  # this local rank on both machines
        assert all(x == x and x < 1e6 for x in info["losses"]), info  # finite
    for b, a in zip(before, after):  # the ranks talked across the emulated link
        assert a["tx"] - b["tx"] > 10_000 and a["rx"] - b["rx"] > 10_000


def test_testbed_up_holds_the_links_until_down() -> None:
    proc = subprocess.Popen(
        [PY, "-m", "lowband.cli", "testbed", "up", "-n", "2", "--rate", "10mbit", "--mode", "netns"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Ctrl-C"):
            break
    text = "".join(lines)
    names = sorted(set(_netns_of(proc.pid)))  # the namespaces (and the machines' hosts files)
    assert len(names) == 3, (text, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
    assert "netns+tbf: 2 ranks, 10 Mbit/s per rank" in text
    assert f"ip netns exec {names[0].rsplit('-', 1)[0]}-m1 env RANK=1 WORLD_SIZE=2" in text, text
    down = subprocess.run(
        [PY, "-m", "lowband.cli", "testbed", "down"], capture_output=True, text=True, timeout=60, env=ENV
    )
    assert down.returncode == 0 and "1 testbed removed" in down.stdout, down
    assert proc.wait(timeout=30) == 0
    assert _netns_of(proc.pid) == []
