"""Batched point-to-point (lowband.comm.batch): a ring and a both-ways exchange against the single-process
oracle, byte counting and tracing, argument errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from oracle import WORLD_SIZES, data

import lowband
from lowband.comm.batch import Channel, P2POp, ibatch_p2p, recv_op, send_op
from lowband.errors import InvalidArgumentError
from lowband.testing import run_threads

SHAPE = (5, 3)
F64 = torch.float64


def _ring() -> list[Any]:
    r, n = lowband.rank(), lowband.size()
    x = data(r, SHAPE, F64, 11)
    left, right = data(r, SHAPE, F64, 12), data(r, SHAPE, F64, 13)
    ops: list[P2POp] = []
    if n > 1:  # receives first, then sends: to the right and, with another tag, to the left
        prev, nxt = (r - 1) % n, (r + 1) % n
        ops = [recv_op(left, prev, 3), recv_op(right, nxt, 4), send_op(x, nxt, 3), send_op(x, prev, 4)]
    h = ibatch_p2p("ring", ops, lambda: (left, right), name="halo")
    got = h.wait()
    return [got[0], got[1], lowband.counters()]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_exchange_matches_oracle_and_is_counted(n: int) -> None:
    res = run_threads(_ring, n, trace=True)
    m = 8 * 15
    for r in range(n):
        left, right, counters = res[r]
        if n == 1:  # nothing moved: the buffers are untouched
            assert torch.equal(left, data(r, SHAPE, F64, 12)) and torch.equal(right, data(r, SHAPE, F64, 13))
            assert counters["ring"] == {"calls": 1, "bytes_sent": 0, "bytes_received": 0}
            continue
        assert torch.equal(left, data((r - 1) % n, SHAPE, F64, 11))
        assert torch.equal(right, data((r + 1) % n, SHAPE, F64, 11))
        assert counters["ring"] == {"calls": 1, "bytes_sent": 2 * m, "bytes_received": 2 * m}


def _control_not_counted() -> dict[str, dict[str, int]]:
    r = lowband.rank()
    word = torch.tensor([r], dtype=torch.int64)
    payload = torch.zeros(4)
    if r == 0:
        ops = [send_op(word, 1, 0, control=True), send_op(payload, 1, 1)]
    else:
        ops = [recv_op(word, 0, 0, control=True), recv_op(payload, 0, 1)]
    Channel.of(None).batch("exchange", ops)
    return lowband.counters()


def test_control_messages_are_moved_but_not_counted() -> None:
    c0, c1 = run_threads(_control_not_counted, 2, trace=True)
    assert c0["exchange"] == {"calls": 1, "bytes_sent": 16, "bytes_received": 0}
    assert c1["exchange"] == {"calls": 1, "bytes_sent": 0, "bytes_received": 16}


def _bad() -> list[str]:
    r, n = lowband.rank(), lowband.size()
    msgs = []
    x = torch.zeros(4, 4)
    for ops in (
        [send_op(x, r, 0)],  # to itself
        [recv_op(x, n, 0)],  # not a rank of the group
        [send_op(x.t(), (r + 1) % n, 0)],  # not contiguous
    ):
        with pytest.raises(InvalidArgumentError) as info:
            ibatch_p2p("bad", ops, lambda: None)
        msgs.append(str(info.value))
    return msgs


def test_invalid_messages_raise_before_anything_is_posted() -> None:
    for r, msgs in enumerate(run_threads(_bad, 2)):
        assert len(msgs) == 3
        for m in msgs:
            assert f"lowband.bad on rank {r}" in m and "contiguous tensor to another rank" in m, m
