"""The window service's listener: one thread per rank serves every window peer, keeps each pair's
requests in order, and ends with the windows (win_free), with the rank (shutdown) and when re-created."""

from __future__ import annotations

import time

import pytest
import torch

import lowband
from lowband.decentral import window as W
from lowband.teardown import lowband_threads
from lowband.testing import run_threads
from lowband.topology import fully_connected, ring

F64 = torch.float64


def _listeners(rank: int | None = None) -> list[str]:
    """Names of the window-service threads alive (of ``rank`` only, if given)."""
    names = [t.name for t in lowband_threads() if t.name.startswith("lowband-win")]
    return names if rank is None else [n for n in names if n.endswith(f"-r{rank}")]


def _one_thread_in_order(k: int) -> list[object]:
    r, n = lowband.rank(), lowband.size()
    x = torch.zeros(5, dtype=F64)
    W.win_create(x, "all", topology=fully_connected(n), zero_init=True)
    W.win_create(torch.zeros(2, dtype=F64), "ring", topology=ring(n))
    lowband.barrier()
    mine = _listeners(r)
    lowband.barrier()  # every rank counted before any rank frees
    # k puts to every peer, none waited before the last is posted: each pair's are applied in order
    hs = [W.win_put_nonblocking(torch.full((5,), float(100 * r + i), dtype=F64), "all") for i in range(k)]
    for h in hs:
        W.win_wait(h)
    lowband.barrier()
    bufs = {int(s): b.clone() for s, b in W.win_state_dict("all")["buffers"].items()}
    versions = W.get_win_version("all")
    W.win_free("ring")
    still = _listeners(r)  # a window left: still served
    W.win_free("all")
    after_free = _listeners(r)
    W.win_create(torch.zeros(2, dtype=F64), "again", topology=ring(n))
    again = _listeners(r)
    lowband.barrier()
    W.win_free("again")
    return [mine, bufs, versions, still, after_free, again]


@pytest.mark.parametrize("n", [3, 4])
def test_one_listener_serves_every_peer_in_pair_order(n: int) -> None:
    k = 12
    res = run_threads(_one_thread_in_order, n, k, timeout=120)
    for r, (mine, bufs, versions, still, after_free, again) in enumerate(res):
        assert mine == [f"lowband-win-listener-r{r}"], mine  # n - 1 peers, one thread
        assert still == mine
        assert after_free == []
        assert again == mine
        for s in range(n):
            if s != r:
                assert torch.equal(bufs[s], torch.full((5,), float(100 * s + k - 1), dtype=F64)), (r, s)
        assert versions == {s: k for s in range(n) if s != r}


def _left_open() -> None:
    W.win_create(torch.zeros(3, dtype=F64), "open", topology=fully_connected(lowband.size()))
    lowband.barrier()
    W.win_put(torch.ones(3, dtype=F64), "open")
    lowband.barrier()  # never freed: the rank's shutdown ends its listener


def test_shutdown_ends_the_listener_of_unfreed_windows() -> None:
    run_threads(_left_open, 3, timeout=60)
    deadline = time.monotonic() + 10
    while _listeners() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _listeners() == []
