"""The compressed transports' state, bytes and failures: memories keyed by parameter name in
``state_dict`` (a reducer rebuilt from it continues bit-identically; the two-stage server memory
re-shards exactly to another world size), the bytes lowband's counters measure against each
transport's stated model, and a dead rank failing the others within the configured timeout.
"""

from __future__ import annotations

import io
import math
import threading
import time
from typing import Any

import pytest
import torch
from transport_oracle import Int8Scale, Reference, Threshold, flat, grads, units

import lowband
from lowband.compress import (
    CompressContext,
    Compressor,
    TwoStageCompressedReducer,
    make_reducer,
    reshard_server_memories,
)
from lowband.compress.wire import header_bytes
from lowband.errors import CommFailedError, CommTimeoutError
from lowband.optim.reducer import ReduceContext, Reducer, Unit
from lowband.testing import RankFailures, run_threads
from lowband.tracing import counters, reset_trace

TRANSPORTS = ("allgather", "ps", "twostage")
NAMES = {name for u in units() for name in u.names}


def reduce_flat(reducer: Reducer, unit: Unit, gs: list[torch.Tensor], step: int) -> torch.Tensor:
    out = reducer.reduce(unit, [g.clone() for g in gs], ReduceContext(lowband.world().unchecked(), step))
    return flat(out.wait())


def run_steps(reducer: Reducer, steps: range) -> list[torch.Tensor]:
    r = lowband.rank()
    return [reduce_flat(reducer, u, grads(r, s, ui), s) for s in steps for ui, u in enumerate(units())]


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    out: dict[str, Any] = torch.load(buf)
    return out


@pytest.mark.parametrize("n", (1, 2, 3, 4))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_resume_bit_identical(transport: str, n: int) -> None:
    """Two steps, ``state_dict`` through torch.save/load into a new reducer, two more steps: the same
    bits as four uninterrupted steps; the memories are keyed by parameter name."""

    def rank_fn() -> list[str]:
        bad = []
        whole = run_steps(make_reducer(transport, Int8Scale(), seed=5), range(4))
        first = make_reducer(transport, Int8Scale(), seed=5)
        run_steps(first, range(2))
        state = roundtrip(first.state_dict())
        if set(state["memory"]["tensors"]) != NAMES:
            bad.append(f"worker memory keys {sorted(state['memory']['tensors'])}")
        if transport == "twostage" and set(state["server"]["memory"]["tensors"]) != NAMES:
            bad.append(f"server memory keys {sorted(state['server']['memory']['tensors'])}")
        again = make_reducer(transport, Int8Scale(), seed=5)
        again.load_state_dict(state)
        rest = run_steps(again, range(2, 4))
        k = len(units()) * 2
        for a, b in zip(whole[k:], rest, strict=True):
            if not torch.equal(a, b):
                bad.append(f"rank {lowband.rank()}: resumed {b} != uninterrupted {a}")
        return bad

    for bad in run_threads(rank_fn, n):
        assert not bad, "\n".join(bad[:5])


def test_twostage_server_memory_reshards_exactly() -> None:
    """Two steps at 2 ranks; every rank's state re-sharded to 3 ranks: the server memory per parameter
    is the reference's (the owners' parts concatenated); a third step at 3 ranks from those states
    equals the reference continued from the same memories (worker memories: their mean)."""
    comp = Int8Scale()
    ref2 = Reference("twostage", comp, 2)
    for step in range(2):
        for ui, u in enumerate(units()):
            ref2.step(u, step, [grads(q, step, ui) for q in range(2)])

    def at_two() -> dict[str, Any]:
        red = make_reducer("twostage", comp)
        run_steps(red, range(2))
        return red.state_dict()

    states = run_threads(at_two, 2)
    for name, whole in ref2.server.items():
        parts = torch.cat([s["server"]["memory"]["tensors"][name] for s in states])
        assert torch.equal(parts, whole), name
    new = reshard_server_memories(states, 3)
    assert [s["server"]["world_size"] for s in new] == [3, 3, 3]

    ref3 = Reference("twostage", comp, 3)
    ref3.server = {k: v.clone() for k, v in ref2.server.items()}
    for u in units():
        mean = (ref2.worker[0][u.key] + ref2.worker[1][u.key]) / 3
        ref3.worker = [dict(w, **{u.key: mean.clone()}) for w in ref3.worker]
    want = [ref3.step(u, 2, [grads(q, 2, ui) for q in range(3)]) for ui, u in enumerate(units())]

    def at_three() -> list[torch.Tensor]:
        red = make_reducer("twostage", comp)
        red.load_state_dict(new[lowband.rank()])
        return run_steps(red, range(2, 3))

    for got in run_threads(at_three, 3):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (a, b)


def test_twostage_other_world_size_resets_with_warning() -> None:
    """One rank's state loaded at another world size cannot be cut again: the first reduction warns
    and starts the server memory from zero (the worker memory is kept)."""

    def at_two() -> dict[str, Any]:
        red = make_reducer("twostage", Int8Scale())
        run_steps(red, range(1))
        return red.state_dict()

    state = run_threads(at_two, 2)[0]

    def at_one() -> tuple[bool, list[torch.Tensor], list[torch.Tensor]]:
        red = make_reducer("twostage", Int8Scale())
        red.load_state_dict(state)
        with pytest.warns(RuntimeWarning, match="cut for 2 ranks and the group has 1"):
            got = run_steps(red, range(1, 2))
        fresh = make_reducer("twostage", Int8Scale())
        fresh.load_state_dict({"memory": state["memory"]})
        assert isinstance(red, TwoStageCompressedReducer) and red.server_world == 1
        return True, got, run_steps(fresh, range(1, 2))

    ok, got, want = run_threads(at_one, 1)[0]
    assert ok and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# ------------------------------------------------------------------------ bytes


def _nbytes(comp: Compressor, x: torch.Tensor, name: str, rank: int, step: int = 0) -> int:
    c = CompressContext(name, step, rank, 0)
    pl = comp.compress(x, c)
    return pl.nbytes + (0 if comp.fixed_size else header_bytes(len(pl.data)))


def _model(
    transport: str, comp: Compressor, n: int, me: int, unit: Unit, ui: int
) -> dict[str, tuple[int, int]]:
    """Each op's (sent, received) bytes on rank ``me`` by the transport's docstring, from payload
    sizes computed here in one process (every rank's inputs rebuilt)."""
    xs = [flat(grads(q, 0, ui, quiet=1)) for q in range(n)]
    numel = xs[0].numel()
    if transport == "allgather":
        b = max(_nbytes(comp, x, unit.key, q) for q, x in enumerate(xs))
        return {"allgather": ((n - 1) * b, (n - 1) * b)}
    numels = [p.numel() for p in unit.params]
    if transport == "ps":
        idx = list(torch.tensor_split(torch.arange(numel), n))
    else:
        offs = [sum(numels[:i]) for i in range(len(numels))]
        idx = [
            torch.cat(
                [o + torch.tensor_split(torch.arange(m), n)[j] for o, m in zip(offs, numels, strict=True)]
            )
            for j in range(n)
        ]
    size = [[_nbytes(comp, xs[q][idx[j]], f"{unit.key}#shard{j}", q) for j in range(n)] for q in range(n)]
    ops = {
        "alltoall": (
            sum(size[me][j] for j in range(n) if j != me),
            sum(size[q][me] for q in range(n) if q != me),
        )
    }
    if transport == "ps":
        nb = (n - 1) * math.ceil(numel / n) * 4
    else:
        server = []
        for j in range(n):
            parts = []
            for q in range(n):
                c = CompressContext(f"{unit.key}#shard{j}", 0, q, 0)
                parts.append(comp.decompress(comp.compress(xs[q][idx[j]], c), c))
            avg = parts[0].clone()
            for d in parts[1:]:
                avg += d
            avg = avg / n if n > 1 else avg
            server.append(_nbytes(comp, avg, f"{unit.key}#server{j}", j))
        nb = (n - 1) * max(server)
    ops["allgather"] = (nb, nb)
    return ops


@pytest.mark.parametrize("n", (2, 3, 4))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_measured_bytes_match_the_model(transport: str, n: int) -> None:
    """lowband's counters, per op, within 2% of each transport's byte model (declared payload sizes,
    framing headers, padding of uneven blocks): fixed-size and data-dependent compressors."""

    def rank_fn() -> list[str]:
        me, bad = lowband.rank(), []
        for comp in (Int8Scale(), Threshold(0.5)):
            for ui, unit in enumerate(units()):
                red = make_reducer(transport, comp)
                reset_trace()
                reduce_flat(red, unit, grads(me, 0, ui, quiet=1), 0)
                got = {op: (c["bytes_sent"], c["bytes_received"]) for op, c in counters().items()}
                want = _model(transport, comp, n, me, unit, ui)
                for op, (ws, wr) in want.items():
                    gs, gr = got.pop(op, (0, 0))
                    if abs(gs - ws) > 0.02 * ws or abs(gr - wr) > 0.02 * wr:
                        bad.append(
                            f"rank {me} {comp.name} {unit.key} {op}: measured {(gs, gr)}, model {(ws, wr)}"
                        )
                if any(v != (0, 0) for v in got.values()):
                    bad.append(f"rank {me} {comp.name} {unit.key}: unexpected ops {got}")
        return bad

    for bad in run_threads(rank_fn, n, trace=True):
        assert not bad, "\n".join(bad[:6])


# ------------------------------------------------------------------------ failures


COMM_TIMEOUT = 2.0


@pytest.mark.parametrize(
    ("transport", "comp"),
    [
        ("allgather", Threshold(0.5)),
        ("allgather", Int8Scale()),
        ("ps", Int8Scale()),
        ("twostage", Threshold(0.5)),
    ],
    ids=["allgather-sized", "allgather-fixed", "ps", "twostage"],
)
def test_dead_rank_fails_the_others_in_bounded_time(transport: str, comp: Compressor) -> None:
    """Rank 2 raises before the collective; ranks 0 and 1 raise a lowband comm error within the
    configured timeout (plus scheduling slack), from reduce() or from wait()."""
    seen: dict[int, tuple[str, float]] = {}
    lock = threading.Lock()

    def rank_fn() -> None:
        r = lowband.rank()
        red = make_reducer(transport, comp)
        run_steps(red, range(1))  # everybody up and connected
        if r == 2:
            raise ValueError("rank 2 dies before the collective")
        t0 = time.monotonic()
        try:
            reduce_flat(red, units()[0], grads(r, 1, 0), 1)
        except (CommTimeoutError, CommFailedError) as exc:
            with lock:
                seen[r] = (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)

    with pytest.raises(RankFailures) as ei:
        run_threads(rank_fn, 3, comm_timeout=COMM_TIMEOUT, timeout=60)
    assert set(ei.value.errors) == {2}, ei.value
    assert set(seen) == {0, 1}, seen
    for r, (msg, waited) in seen.items():
        assert f"on rank {r}" in msg, msg
        assert waited < COMM_TIMEOUT + 5, f"rank {r} took {waited:.1f} s: {msg}"
