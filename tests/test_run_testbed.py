"""``lowband run`` on emulated links (root and link shaping needed, skipped otherwise): the bytes a user
script's allreduce puts on each link, and clean-up after a failed and an interrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowband.testbed import shaping_available

TESTS = Path(__file__).parent
PY = sys.executable
SCRIPT = TESTS / "_run_user_script.py"
_OK, _WHY = shaping_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"link shaping unavailable here: {_WHY}")
ENV = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _netns_of(pid: int) -> list[str]:
    """``pid``'s testbed namespaces, and their files under /etc/netns (the hosts files)."""
    out = []
    for where in ("/run/netns", "/etc/netns"):
        try:
            out += [n for n in os.listdir(where) if n.startswith(f"lb-{pid}-")]
        except FileNotFoundError:
            pass
    return out


def _procs_running(marker: str) -> list[int]:
    """Processes whose command line mentions ``marker`` (a test's own folder)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            out.append(int(pid))
    return out


def _run(args: list[str], tmp: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [PY, "-m", "lowband.cli", "run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=tmp)


def test_bytes_of_a_user_allreduce_match_the_model(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    args = ["-n", "2", "--rate", "100mbit", "--mode", "netns", "--report", str(report)]
    out = _run([*args, str(SCRIPT), "allreduce", str(tmp_path)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "netns+tbf: 2 ranks, 100 Mbit/s per rank" in out.stderr
    assert "rank 0" in out.stdout and "rank 1" in out.stdout and "sent" in out.stdout, out.stdout
    data = json.loads(report.read_text())
    assert data["shaped"] and data["exit_codes"] == [0, 0]
    # two allreduces of 4 MiB on 2 ranks: each rank sends and receives 2(n-1)/n * 4 MiB per allreduce;
    # on top: TCP/IP/Ethernet framing (< 1% at MTU 9000), ACKs, the rendezvous and gloo's set-up
    model = 2 * (2 * (2 - 1) / 2) * 4 * 2**20
    for m in data["machines"]:
        for key in ("tx", "rx"):
            assert model <= m[key] <= 1.03 * model + 300_000, (key, m, model)


def test_a_failed_rank_ends_the_run_and_leaves_nothing(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [PY, "-m", "lowband.cli", "run", "-n", "2", "--rate", "1gbit", "--grace", "1", str(SCRIPT), "fail",
         str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert "lowband run: rank 1 failed: RuntimeError: rank 1 fails on purpose (_run_user_script.py" in err, (
        err
    )
    assert "Traceback" not in err, err[-3000:]  # in the rank's log
    assert _netns_of(proc.pid) == [] and _procs_running(str(tmp_path)) == []


def test_ctrl_c_removes_every_rank_and_namespace(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [PY, "-m", "lowband.cli", "run", "-n", "2", "--rate", "1gbit", str(SCRIPT), "sleep", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    assert len(_netns_of(proc.pid)) == 3 + 2 and len(_procs_running(str(tmp_path))) >= 3  # + 2 hosts files
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err
    assert _netns_of(proc.pid) == [] and _procs_running(str(tmp_path)) == []


def test_each_machine_resolves_every_rank_address_and_clean_removes_orphaned_files(tmp_path: Path) -> None:
    """torch's store looks up the name of every rank that connects (an IPv4-mapped IPv6 address on its
    dual-stack socket); inside a namespace no DNS server answers, so each machine's /etc/hosts
    (/etc/netns/NS/hosts) names them all: no c10d "hostname of the client socket" warning. clean()
    also removes such files left by a crashed owner."""
    from lowband.testbed import Layout, Testbed, clean

    code = (
        "import socket, sys\n"
        "for a in sys.argv[1:]:\n"
        "    print(socket.getnameinfo((a, 80), 0)[0], socket.getnameinfo(('::ffff:' + a, 80, 0, 0), 0)[0])\n"
    )
    with Testbed(Layout.flat(2, "1gbit"), mode="netns") as tb:
        addrs = [tb.address(m) for m in range(2)]
        procs = tb.spawn([PY, "-c", code, *addrs, "127.0.0.1"], stdout=subprocess.PIPE)
        assert tb.wait(procs, timeout=60) == [0, 0]
        for p in procs:
            assert p.stdout is not None
            names = p.stdout.read().decode().split()
            assert names == ["lowband-m0", "lowband-m0", "lowband-m1", "lowband-m1", "localhost", "localhost"]
    orphan = Path("/etc/netns/lb-999999999-1-m0")  # no such process: a dead owner's leftover
    orphan.mkdir(parents=True)
    (orphan / "hosts").write_text("127.0.0.1 localhost\n")
    clean()
    assert not orphan.exists()
