"""The link-emulation testbed: pure layout maths, namespace life cycle (crash path included), process
control, shaping accuracy (rates, two tiers, allreduce against the ring model) and optional delay."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lowband.testbed.netns as netns_mod
from lowband.errors import CommTimeoutError, InvalidArgumentError, LowbandError
from lowband.testbed import (
    Layout,
    LinkSpec,
    Testbed,
    clean,
    delay_available,
    format_rate,
    have_root,
    list_testbeds,
    parse_rate,
    read_iface_bytes,
    shaping_available,
)
from lowband.testbed import cli as testbed_cli

TESTS = Path(__file__).parent
PY = sys.executable
needs_root = pytest.mark.skipif(
    not have_root(), reason="needs root: network namespaces, veth and tbf qdiscs need CAP_NET_ADMIN"
)
_SHAPING_OK, _SHAPING_WHY = shaping_available()
needs_shaping = pytest.mark.skipif(not _SHAPING_OK, reason=f"link shaping unavailable here: {_SHAPING_WHY}")
_DELAY_OK, _DELAY_WHY = delay_available()


def _netns_names() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


def _root_net_state() -> str:
    """The root namespace's links, addresses, routes (and iptables when installed)."""
    cmds = [["ip", "-o", "link", "show"], ["ip", "-o", "addr", "show"], ["ip", "route", "show"]]
    if subprocess.run(["which", "iptables"], capture_output=True).returncode == 0:
        cmds.append(["iptables", "-S"])
    out = []
    for cmd in cmds:
        text = subprocess.run(cmd, capture_output=True, text=True).stdout
        # counters and link state details change by themselves; keep names and addresses
        out.append("\n".join(sorted(line.split(" state ")[0] for line in text.splitlines())))
    return "\n".join(out)


# pure: rates and layouts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("100mbit", 1e8),
        ("1gbit", 1e9),
        ("10Mbit/s", 1e7),
        ("500kbit", 5e5),
        ("2.5Gbit", 2.5e9),
        ("1e6", 1e6),
        (1e8, 1e8),
        (12345, 12345.0),
        ("100 mbit", 1e8),
    ],
)
def test_parse_rate(text: str | float, bits: float) -> None:
    assert parse_rate(text) == pytest.approx(bits)


def test_parse_rate_none_and_errors() -> None:
    assert parse_rate(None) is None
    assert parse_rate("unlimited") is None
    for bad in ("fast", "100 furlongs", "", "-5mbit", 0, -1.0, float("inf"), float("nan"), True, [1]):
        with pytest.raises(InvalidArgumentError, match="rate"):
            parse_rate(bad)  # type: ignore[arg-type]


def test_format_rate_and_link_labels() -> None:
    assert format_rate(1e8) == "100 Mbit/s"
    assert format_rate(2.5e9) == "2.5 Gbit/s"
    assert format_rate(None) == "unshaped"
    assert LinkSpec.of("100mbit").label() == "100 Mbit/s"
    assert LinkSpec.of("100mbit", down="1gbit").label() == "up 100 Mbit/s / down 1 Gbit/s"
    assert LinkSpec.of("10mbit", delay_ms=20).label() == "10 Mbit/s + 20 ms"
    with pytest.raises(InvalidArgumentError, match="delay_ms"):
        LinkSpec.of("10mbit", delay_ms=-1)
    with pytest.raises(InvalidArgumentError, match=r"LinkSpec\.up"):
        LinkSpec(up=0.0, down=None)


def test_layouts() -> None:
    flat = Layout.flat(4, "100mbit")
    assert flat.world_size == 4 and flat.n_machines == 4 and flat.bottleneck() == 1e8
    assert flat.describe() == "4 ranks, 100 Mbit/s per rank"
    asym = Layout.flat(2, None, up="10mbit", down="1gbit", delay_ms=5)
    assert asym.machines[0] == LinkSpec(up=1e7, down=1e9, delay_ms=5.0) and asym.bottleneck() == 1e7
    het = Layout.heterogeneous(["1gbit", "100mbit", None])
    assert het.bottleneck() == 1e8 and [m.up for m in het.machines] == [1e9, 1e8, None]
    assert het.describe() == "3 ranks, ranks at 1 Gbit/s, 100 Mbit/s, unshaped"
    tiers = Layout.two_tier(2, 4, "100mbit", "10gbit")
    assert tiers.world_size == 8 and tiers.intra == 1e10 and tiers.bottleneck() == 1e8
    assert [tiers.machine_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert "8 ranks on 2 machines x 4" in tiers.describe()
    assert Layout.flat(3, None).bottleneck() is None and not Layout.flat(3, None).shaped


def test_layout_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="n: must be >= 1"):
        Layout.flat(0, "1mbit")
    with pytest.raises(InvalidArgumentError, match="ranks_per_machine: must be >= 1"):
        Layout.two_tier(2, 0, "1mbit")
    with pytest.raises(InvalidArgumentError, match="machines: must be >= 1"):
        Layout.two_tier(0, 2, "1mbit")
    with pytest.raises(InvalidArgumentError, match="at least 1 rate"):
        Layout.heterogeneous([])
    with pytest.raises(InvalidArgumentError, match="sequence of rates"):
        Layout.heterogeneous("100mbit")
    with pytest.raises(InvalidArgumentError, match="rate"):
        Layout.two_tier(2, 2, "100mbit", intra="-1gbit")
    with pytest.raises(InvalidArgumentError, match="at least 1 machine"):
        Layout(machines=())
    with pytest.raises(InvalidArgumentError, match="rank must be"):
        Layout.flat(2, None).machine_of(2)
    with pytest.raises(InvalidArgumentError, match="mode"):
        Testbed(Layout.flat(2, None), mode="fast")
    with pytest.raises(InvalidArgumentError, match="prefix"):
        Testbed(Layout.flat(2, None), prefix="Bad-Prefix")
    with pytest.raises(InvalidArgumentError, match="layout must be a Layout"):
        Testbed("4x100mbit")  # type: ignore[arg-type]
    for bad_mtu in (100, 70000, 1500.0, True):
        with pytest.raises(InvalidArgumentError, match=r"mtu must be in 576\.\.65000"):
            Testbed(Layout.flat(2, None), mtu=bad_mtu)  # type: ignore[arg-type]


def test_read_iface_bytes() -> None:
    tx, rx = read_iface_bytes("lo")
    assert tx >= 0 and rx >= 0
    with pytest.raises(InvalidArgumentError, match="no interface"):
        read_iface_bytes("nosuchif0")


# loopback fallback and process control (run everywhere) ---------------------------------------


def test_loopback_mode_is_labelled_unshaped() -> None:
    with Testbed(Layout.two_tier(2, 2, "100mbit"), mode="loopback") as tb:
        assert not tb.shaped and tb.mode == "loopback" and tb.namespaces() == []
        assert "UNSHAPED" in tb.label() and tb.master_addr() == "127.0.0.1"
        env = tb.rank_env(3)
        assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
        assert env["LOCAL_WORLD_SIZE"] == env["LOWBAND_LOCAL_SIZE"] == "2"
        assert env["GLOO_SOCKET_IFNAME"] == env["LOWBAND_TESTBED_IFNAME"] == "lo"
        assert env["LOWBAND_TESTBED_SHAPED"] == "0"
        code = "import os; print(os.environ['RANK'], os.environ['FOO'])"
        procs = tb.spawn([PY, "-c", code], env={"FOO": "bar"}, stdout=subprocess.PIPE)
        assert tb.wait(procs, timeout=30) == [0, 0, 0, 0]
        assert [p.stdout.read().decode().split() for p in procs] == [[str(r), "bar"] for r in range(4)]  # type: ignore[union-attr]


def test_auto_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(netns_mod, "shaping_available", lambda: (False, "not root"))
    tb = Testbed(Layout.flat(2, "1mbit"))
    assert tb.mode == "loopback" and tb.reason == "not root"
    assert tb.label() == "loopback (UNSHAPED: not root): 2 ranks"
    assert "UNSHAPED" in capsys.readouterr().err
    with pytest.raises(LowbandError, match="not root"):
        Testbed(Layout.flat(2, "1mbit"), mode="netns")


def test_failing_rank_kills_the_others_in_bounded_time() -> None:
    code = "import os, sys, time; r = int(os.environ['RANK']); time.sleep(0.3); sys.exit(3) if r == 1 else time.sleep(60)"
    with Testbed(Layout.flat(3, "100mbit")) as tb:
        start = time.monotonic()
        procs = tb.spawn([PY, "-c", code])
        codes = tb.wait(procs, timeout=60, grace=1.0)
        assert time.monotonic() - start < 15
        assert codes == [-signal.SIGKILL, 3, -signal.SIGKILL]


def test_wait_timeout_kills_everything_and_names_ranks() -> None:
    with Testbed(Layout.flat(2, None)) as tb:
        procs = tb.spawn([PY, "-c", "import time; time.sleep(60)"])
        start = time.monotonic()
        with pytest.raises(CommTimeoutError, match=r"ranks \[0, 1\] still running after 1 s"):
            tb.wait(procs, timeout=1.0)
        assert time.monotonic() - start < 10
        assert all(p.poll() is not None for p in procs)


def test_spawn_requires_up() -> None:
    tb = Testbed(Layout.flat(2, None), mode="loopback")
    with pytest.raises(LowbandError, match="not up"):
        tb.spawn([PY, "-c", "pass"])


# namespaces: life cycle, crash path ------------------------------------------------------------


@needs_root
def test_shaping_available_as_root() -> None:
    assert shaping_available() == (True, ""), "root here, but the probe failed"


@needs_shaping
def test_up_down_leaves_nothing_and_never_touches_the_root_namespace() -> None:
    before_ns, before_root = _netns_names(), _root_net_state()
    a = Testbed(Layout.flat(3, "100mbit"), mode="netns")
    b = Testbed(Layout.two_tier(2, 2, "50mbit", "1gbit"), mode="netns", mtu=1500)
    with a, b:
        assert a.shaped and a.label() == "netns+tbf: 3 ranks, 100 Mbit/s per rank, MTU 9000"
        assert set(a.namespaces()) | set(b.namespaces()) <= _netns_names()
        assert not set(a.namespaces()) & set(b.namespaces())
        assert len(a.namespaces()) == 4 and len(b.namespaces()) == 3
        assert _root_net_state() == before_root
        env = b.rank_env(3)
        assert env["MASTER_ADDR"] == b.address(0) and env["GLOO_SOCKET_IFNAME"] == "veth0"
        assert env["LOCAL_RANK"] == "1" and env["LOWBAND_TESTBED_SHAPED"] == "1"
        qdiscs = subprocess.run(
            ["tc", "-n", b.machine_ns(1), "qdisc", "show"], capture_output=True, text=True
        ).stdout
        assert "dev veth0 root" in qdiscs and "rate 50Mbit" in qdiscs and "rate 1Gbit" in qdiscs
        for tb, mtu in ((a, 9000), (b, 1500)):
            links = subprocess.run(
                ["ip", "-n", tb.machine_ns(1), "link", "show", "veth0"], capture_output=True, text=True
            ).stdout
            assert f"mtu {mtu} " in links, links
        a.up()  # idempotent
    a.down()  # idempotent
    assert _netns_names() == before_ns
    assert _root_net_state() == before_root


@needs_shaping
def test_exception_inside_with_cleans_up() -> None:
    before = _netns_names()
    with pytest.raises(RuntimeError, match="boom"), Testbed(Layout.flat(2, "10mbit"), mode="netns") as tb:
        procs = tb.spawn([PY, "-c", "import time; time.sleep(60)"])
        assert tb.namespaces()[0] in _netns_names()
        raise RuntimeError("boom")
    assert _netns_names() == before
    assert all(p.poll() is not None for p in procs)


def _start_owner() -> tuple[subprocess.Popen[str], dict[str, list]]:
    owner = subprocess.Popen(
        [PY, str(TESTS / "_testbed_crash.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    line = owner.stdout.readline()
    assert line, f"the testbed owner died: {owner.stderr.read() if owner.stderr else ''}"
    return owner, json.loads(line)


def _pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@needs_shaping
def test_crash_leftovers_are_cleaned_and_live_owners_are_not() -> None:
    owner, info = _start_owner()
    names = info["namespaces"]
    try:
        assert set(names) <= _netns_names()
        # the owner is alive: clean() must leave its testbed alone
        assert not set(clean()) & set(names)
        assert set(names) <= _netns_names()
        listed = {i.name: i for i in list_testbeds()}
        assert all(listed[n].alive and listed[n].owner_pid == owner.pid for n in names)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    # SIGKILL: nothing ran, the namespaces and the rank processes are still there
    assert set(names) <= _netns_names()
    assert all(_pid_running(pid) for pid in info["pids"])
    assert all(not i.alive for i in list_testbeds() if i.name in names)
    removed = clean()
    assert set(names) <= set(removed)
    assert not set(names) & _netns_names()
    deadline = time.monotonic() + 5
    while any(_pid_running(pid) for pid in info["pids"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_pid_running(pid) for pid in info["pids"]), "ranks of the crashed testbed still run"


@needs_shaping
def test_up_removes_dead_owners_leftovers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    fake_dead, fake_live = f"lb-{dead.pid}-1-m0", f"lb-{live.pid}-1-br"
    try:
        for name in (fake_dead, fake_live):
            subprocess.run(["ip", "netns", "add", name], check=True)
        monkeypatch.setattr("lowband.testbed.leftovers.have_root", lambda: False)
        with pytest.raises(LowbandError, match=rf"removing .*{fake_dead}.* needs root"):
            clean()
        monkeypatch.undo()
        with Testbed(Layout.flat(1, "10mbit"), mode="netns"):
            names = _netns_names()
            assert fake_dead not in names and fake_live in names
    finally:
        live.kill()
        live.wait()
        for name in (fake_dead, fake_live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@needs_shaping
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_tears_down(sig: signal.Signals) -> None:
    owner, info = _start_owner()
    try:
        owner.send_signal(sig)
        try:
            # 7 s alone; once over 20 s (SIGINT) with the whole suite on both cores: 60 s, and say why
            owner.wait(timeout=60)
        except subprocess.TimeoutExpired:
            owner.kill()
            _, err = owner.communicate()
            pytest.fail(f"the testbed owner did not end within 60 s of {sig.name}; its stderr:\n{err}")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert owner.returncode != 0
    assert not set(info["namespaces"]) & _netns_names()
    assert not any(_pid_running(pid) for pid in info["pids"])


@needs_shaping
def test_cli_status_and_clean(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    testbed_cli.add_parser(parser.add_subparsers(dest="cmd"))
    with Testbed(Layout.flat(2, "10mbit"), mode="netns") as tb:
        assert testbed_cli.main(parser.parse_args(["testbed", "status"])) == 0
        out = capsys.readouterr().out
        assert f"{tb.bridge_ns}  owner pid {os.getpid()}  alive" in out
        assert testbed_cli.main(parser.parse_args(["testbed", "clean"])) == 0
        out = capsys.readouterr().out
        assert "namespace" in out and "removed" in out and tb.bridge_ns not in out
        assert set(tb.namespaces()) <= _netns_names()
    assert testbed_cli.main(parser.parse_args(["testbed", "status", "--prefix", "zz"])) == 0
    assert "no testbed namespaces" in capsys.readouterr().out


# shaping accuracy ------------------------------------------------------------------------------


def _probe(tb: Testbed, *args: str, timeout: float = 60) -> dict[str, float]:
    procs = tb.spawn(
        [PY, str(TESTS / "_testbed_probe.py"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    codes = tb.wait(procs, timeout=timeout, grace=5)
    errs = [p.stderr.read().decode() for p in procs]  # type: ignore[union-attr]
    assert codes == [0] * len(procs), errs
    outs = [p.stdout.read().decode().strip() for p in procs]  # type: ignore[union-attr]
    return json.loads(next(o for o in outs if o))  # type: ignore[no-any-return]


#: the share of an emulated rate a loaded 2-core host still delivers. Quiet, the probes get 1.00-1.02x the
#: rate and the 16 MiB allreduce below takes 1.04x the ring model (benchmarks/testbed_accuracy.py,
#: 2026-11-29); on a shared CI host with CPU steal the
#: allreduce took 1.39x the ring model (2026-11-29) and the probes measured 12-19 % below the rate: the
#: ranks and tbf's throttling timer wait for the CPU, not the link. What the shaping itself must never do,
#: let traffic through faster than the rate, is checked tightly; the exact accuracy belongs in a quiet
#: measurement, not in a timed unit test.
LOADED_HOST_FLOOR = 0.6


def _shaped_to(mbit: float, rate: float) -> bool:
    """``mbit`` (measured goodput) at most ``rate`` (tbf's burst allows a little over it on a short
    transfer) and not below the floor's share of the goodput (TCP/IP headers take up to ~4.5 %)."""
    return LOADED_HOST_FLOOR * 0.955 * rate <= mbit <= 1.05 * rate


@needs_shaping
def test_heterogeneous_uplinks_and_downlinks() -> None:
    # rank 0 receives at most 30 Mbit/s; rank 1 sends at 100, rank 2 at 10
    layout = Layout(
        machines=(LinkSpec.of("100mbit", down="30mbit"), LinkSpec.of("100mbit"), LinkSpec.of("10mbit"))
    )
    with Testbed(layout, mode="netns") as tb:
        got = _probe(tb, "tput", "--bytes", str(2 << 20), "--peers", "1,2")
    assert _shaped_to(got["1"], 30), got
    assert _shaped_to(got["2"], 10), got


@needs_shaping
def test_two_tier_intra_machine_traffic_is_not_limited_by_the_inter_rate() -> None:
    with Testbed(Layout.two_tier(2, 2, "50mbit"), mode="netns") as tb:
        free = _probe(tb, "tput", "--bytes", str(4 << 20), "--peers", "1,2")
    with Testbed(Layout.two_tier(2, 2, "50mbit", intra="200mbit"), mode="netns") as tb:
        shaped = _probe(tb, "tput", "--bytes", str(4 << 20), "--peers", "1,2")
    # rank 1 shares rank 0's machine (loopback), rank 2 is on the other machine
    assert _shaped_to(free["2"], 50), free
    assert free["1"] > 10 * free["2"], free
    assert _shaped_to(shaped["2"], 50), shaped
    assert _shaped_to(shaped["1"], 200), shaped


@needs_shaping
def test_allreduce_16mb_at_100mbit_matches_the_ring_model() -> None:
    # 5 timed repetitions: on a loaded 2-core machine one or two can stall on the CPU, not the link
    n, nbytes, rate, reps = 4, 16 * 2**20, 1e8, 5
    model_bytes = 2 * (n - 1) / n * nbytes
    model_s = model_bytes * 8 / rate  # 2.01 s
    with Testbed(Layout.flat(n, "100mbit"), mode="netns") as tb:
        env = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
        procs = tb.spawn(
            [PY, str(TESTS / "_testbed_worker.py"), "--mib", "16", "--reps", str(reps)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        codes = tb.wait(procs, timeout=120, grace=5)
        errs = [p.stderr.read().decode()[-2000:] for p in procs]  # type: ignore[union-attr]
        assert codes == [0] * n, errs
        res = [json.loads(p.stdout.read()) for p in procs]  # type: ignore[union-attr]
    slowest = [max(r["times"][i] for r in res) for i in range(reps)]
    median = statistics.median(slowest)
    # never faster than the link allows; slower only within what a loaded host explains (see _shaped_to)
    assert 0.9 * model_s <= median <= model_s / LOADED_HOST_FLOOR, (median, model_s, res)
    # every rank's interface sends and receives the ring's 2(n-1)/n*M, plus TCP/IP/Ethernet framing
    for r in res:
        for tx, rx in zip(r["tx"], r["rx"]):
            assert 1.0 <= tx / model_bytes <= 1.08, r
            assert 1.0 <= rx / model_bytes <= 1.08, r


@needs_shaping
@pytest.mark.skipif(not _DELAY_OK, reason=f"optional delay unavailable: {_DELAY_WHY}")
def test_one_way_delay_adds_to_the_round_trip() -> None:
    with Testbed(Layout.flat(2, "100mbit", delay_ms=10), mode="netns") as tb:
        assert "+ 10 ms" in tb.label()
        got = _probe(tb, "rtt", "--count", "20")
    # each direction is delayed 10 ms on the receiver's side: ~20 ms round trip
    assert 19.0 <= got["rtt_ms"] <= 26.0, got
