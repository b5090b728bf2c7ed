"""Observability: per-op byte counters, per-rank timelines, Chrome trace export; off by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lowband
from lowband.comm.trace import merge_chrome_traces
from lowband.decentral import neighbor_allreduce
from lowband.decentral import window as W
from lowband.testing import run_threads
from lowband.topology import exponential_two


def test_off_by_default() -> None:
    def rank_fn() -> dict[str, dict[str, int]]:
        lowband.allreduce(torch.ones(10))
        return lowband.counters()

    assert run_threads(rank_fn, 2) == [{}, {}]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_counters_follow_the_byte_model(n: int) -> None:
    m = 4 * 1200  # bytes of a float32 tensor of 1200 elements (divisible by 1..4)

    def rank_fn() -> dict[str, dict[str, int]]:
        r = lowband.rank()
        lowband.allreduce(torch.ones(1200), name="grad")
        lowband.allreduce(torch.ones(1200))
        lowband.broadcast(torch.ones(1200), root=0)
        lowband.allgather(torch.ones(r + 1, 3))  # uneven: padded to the largest
        lowband.reduce_scatter(torch.ones(1200))
        if n > 1:
            if r == 0:
                lowband.send(torch.ones(7), 1)
            if r == 1:
                lowband.recv(torch.ones(7), 0)
        return lowband.counters()

    out = run_threads(rank_fn, n, trace=True)
    ring = 2 * (n - 1) * m // n
    for r, c in enumerate(out):
        assert c["allreduce"] == {"calls": 2, "bytes_sent": 2 * ring, "bytes_received": 2 * ring}
        root_sent = m * (n - 1) if r == 0 else 0
        assert c["broadcast"] == {"calls": 1, "bytes_sent": root_sent, "bytes_received": 0 if r == 0 else m}
        padded = n * 3 * 4  # largest first dimension n, rows of 3 float32
        assert c["allgather"] == {
            "calls": 1,
            "bytes_sent": padded * (n - 1),
            "bytes_received": padded * (n - 1),
        }
        rs = (n - 1) * m // n
        assert c["reduce_scatter"] == {"calls": 1, "bytes_sent": rs, "bytes_received": rs}
        if n > 1 and r == 0:
            assert c["send"] == {"calls": 1, "bytes_sent": 28, "bytes_received": 0}
        if n > 1 and r == 1:
            assert c["recv"] == {"calls": 1, "bytes_sent": 0, "bytes_received": 28}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_decentral_traffic_is_counted(n: int) -> None:
    numel = 30
    m = 8 * numel  # bytes of the float64 tensor

    def rank_fn() -> dict[str, dict[str, int]]:
        x = torch.full((numel,), float(lowband.rank()), dtype=torch.float64)
        neighbor_allreduce(x)
        W.win_create(x.clone(), "w")
        W.win_put(x, "w")
        W.win_get("w")
        lowband.barrier()  # every rank's service has answered every request
        c = lowband.counters()
        W.win_free("w")
        return c

    out = run_threads(rank_fn, n, trace=True)
    topo = exponential_two(n)
    for r, c in enumerate(out):
        outs, ins = len(topo.out_neighbors(r)), len(topo.in_neighbors(r))
        assert c["neighbor_allreduce"] == {"calls": 1, "bytes_sent": m * outs, "bytes_received": m * ins}
        assert c["win_put"] == {"calls": 1, "bytes_sent": m * outs, "bytes_received": 0}
        assert c["win_get"] == {"calls": 1, "bytes_sent": 0, "bytes_received": m * ins}
        # this rank's service received its in-neighbors' puts and answered its out-neighbors' gets
        served = {"calls": ins + outs, "bytes_sent": m * outs, "bytes_received": m * ins}
        assert c.get("window_service", {"calls": 0, "bytes_sent": 0, "bytes_received": 0}) == served


def test_timeline_and_chrome_trace(tmp_path: Path) -> None:
    def rank_fn() -> str:
        r = lowband.rank()
        lowband.allreduce(torch.ones(1000), name="layer1.grad")
        h = lowband.iallreduce(torch.ones(10), name="async")
        h.wait()
        if r == 0:
            lowband.send(torch.ones(3), 1, name="hello")
        else:
            lowband.recv(torch.ones(3), 0)
        lowband.gather_counters()  # not traced itself
        return str(lowband.chrome_trace(tmp_path / f"rank{r}.json"))

    paths = run_threads(rank_fn, 2, trace=True)
    merged = merge_chrome_traces(list(paths), tmp_path / "all.json")
    events = json.loads(merged.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    names = sorted(e["name"] for e in spans if e["pid"] == 0)
    assert names == ["async", "hello", "layer1.grad"]
    for e in spans:
        assert e["dur"] >= 0 and e["args"]["completed"], e
        assert e["ts"] > 1e15  # wall-clock microseconds: ranks line up in one view
    s0 = next(e for e in spans if e["name"] == "layer1.grad" and e["pid"] == 0)
    assert s0["args"]["bytes_sent"] == 4000 and s0["cat"] == "allreduce"


def test_gather_counters_and_toggle() -> None:
    def rank_fn() -> dict[int, dict[str, dict[str, int]]]:
        lowband.allreduce(torch.ones(4))  # not counted: tracing off
        lowband.set_trace(True)
        lowband.broadcast(torch.ones(8), root=1)
        lowband.set_trace(False)
        lowband.broadcast(torch.ones(8), root=1)
        out = lowband.gather_counters()
        lowband.reset_trace()
        assert lowband.counters() == {}
        return out

    res = run_threads(rank_fn, 3)
    assert res[0] == res[1] == res[2]
    assert res[0][1]["broadcast"] == {"calls": 1, "bytes_sent": 64, "bytes_received": 0}
    assert res[0][0]["broadcast"] == {"calls": 1, "bytes_sent": 0, "bytes_received": 32}
    assert "allreduce" not in res[0][0]
