"""One-sided windows (lowband.decentral.window): put/get/accumulate/update against a single-process
oracle, versions, asynchronous push-sum, busy ranks, the distributed mutex and win_lock, errors,
free/re-create, state dicts, and a dead peer (real processes)."""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import pytest
import torch
from oracle import WORLD_SIZES, data

import lowband
from lowband.decentral import window as W
from lowband.errors import CollectiveMismatchError, CommFailedError, CommTimeoutError, InvalidArgumentError
from lowband.testing import run_processes, run_threads
from lowband.topology import exponential_two, fully_connected, ring

SHAPE = (3, 4)
F64 = torch.float64


def _x(r: int, salt: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return data(r, SHAPE, dtype, salt, integer=False)


def _dst_w(r: int, d: int) -> float:
    return 0.5 + d / 8 + r / 16


def _src_w(r: int, s: int) -> float:
    return 0.25 + s / 4 + r / 32


def _bufs(name: str) -> dict[int, torch.Tensor]:
    return {int(k): v for k, v in W.win_state_dict(name)["buffers"].items()}


# ---------------------------------------------------------------- put / accumulate / get vs the oracle


def _put_acc_get(dtype: torch.dtype) -> list[Any]:
    r = lowband.rank()
    x = _x(r, 1, dtype)
    W.win_create(x, "w")
    snaps = []
    W.win_put(x, "w")  # default: every out-neighbor, weight 1
    lowband.barrier()
    snaps.append((_bufs("w"), W.get_win_version("w")))
    lowband.barrier()  # nobody starts the next phase before every rank took its snapshot
    topo = exponential_two(lowband.size())
    W.win_put(x, "w", self_weight=0.75, dst_weights={d: _dst_w(r, d) for d in topo.out_neighbors(r)})
    lowband.barrier()
    snaps.append((_bufs("w"), W.get_win_version("w")))
    lowband.barrier()  # nobody starts the next phase before every rank took its snapshot
    W.win_accumulate(_x(r, 2, dtype), "w", dst_weights={d: _dst_w(d, r) for d in topo.out_neighbors(r)})
    lowband.barrier()
    snaps.append((_bufs("w"), W.get_win_version("w")))
    lowband.barrier()  # nobody starts the next phase before every rank took its snapshot
    W.win_get("w", src_weights={s: _src_w(r, s) for s in topo.in_neighbors(r)})
    lowband.barrier()
    snaps.append((_bufs("w"), W.get_win_version("w")))
    lowband.barrier()  # nobody starts the next phase before every rank took its snapshot
    W.win_free("w")
    return [snaps, x.clone()]


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_put_accumulate_get_match_oracle(n: int, dtype: torch.dtype) -> None:
    res = run_threads(_put_acc_get, n, dtype, timeout=60)
    topo = exponential_two(n)
    xs = [_x(r, 1, dtype) for r in range(n)]
    for i in range(n):
        snaps, final = res[i]
        ins = topo.in_neighbors(i)
        # phase 1: plain put
        exp1 = {j: xs[j] for j in ins}
        # phase 2: weighted put, then every sender scales its own tensor by 0.75
        exp2 = {j: xs[j] * _dst_w(j, i) for j in ins}
        # phase 3: accumulate adds the other seeded tensor
        exp3 = {j: exp2[j] + _x(j, 2, dtype) * _dst_w(i, j) for j in ins}
        # phase 4: get overwrites with the source's (scaled) tensor times my weight
        exp4 = {j: (xs[j] * 0.75) * _src_w(i, j) for j in ins}
        for k, (exp, ver) in enumerate([(exp1, 1), (exp2, 2), (exp3, 3), (exp4, 4)]):
            bufs, versions = snaps[k]
            assert set(bufs) == set(ins)
            for j in ins:
                assert torch.equal(bufs[j], exp[j]), (i, j, k)
            assert versions == dict.fromkeys(ins, ver)
        assert torch.equal(final, xs[i] * 0.75)


# ---------------------------------------------------------------- win_update


def _update() -> list[Any]:
    r, n = lowband.rank(), lowband.size()
    topo = exponential_two(n)
    x = _x(r, 3)
    W.win_create(x, "u")
    before = _bufs("u")  # zero_init=False: every buffer starts as a copy of my own tensor
    lowband.barrier()  # (every phase ends with a barrier: a fast rank's next puts must not land early)
    W.win_put(_x(r, 4), "u")
    lowband.barrier()
    got_default = W.win_update("u").clone()
    v_after = W.get_win_version("u")
    lowband.barrier()
    # custom weights, clone: the registered tensor is unchanged
    W.win_put(_x(r, 5), "u")
    lowband.barrier()
    sw, srcs = 0.3, {j: 0.1 * (j + 1) for j in topo.in_neighbors(r)}
    kept = x.clone()
    got_clone = W.win_update("u", self_weight=sw, src_weights=srcs, clone=True)
    unchanged = torch.equal(x, kept)
    got_reset = W.win_update("u", self_weight=sw, src_weights=srcs, reset=True).clone()
    after_reset = _bufs("u")
    W.win_free("u")
    z = _x(r, 6)
    W.win_create(z, "z", zero_init=True)
    zero_bufs = _bufs("z")
    got_zero = W.win_update("z").clone()
    W.win_free("z")
    return [before, got_default, v_after, got_clone, unchanged, got_reset, after_reset, zero_bufs, got_zero]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_win_update_default_and_custom_weights(n: int) -> None:
    res = run_threads(_update, n, timeout=60)
    topo = exponential_two(n)
    for i in range(n):
        before, got_default, v_after, got_clone, unchanged, got_reset, after_reset, zero_bufs, got_zero = res[
            i
        ]
        ins = topo.in_neighbors(i)
        x0 = _x(i, 3)
        assert all(torch.equal(before[j], x0) for j in ins)
        exp = x0 * topo.self_weight(i)
        for j, w in topo.src_weights(i).items():
            exp = exp + _x(j, 4) * w
        torch.testing.assert_close(got_default, exp, rtol=1e-14, atol=1e-14)
        assert v_after == dict.fromkeys(ins, 0)
        srcs = {j: 0.1 * (j + 1) for j in ins}
        exp_c = got_default * 0.3
        for j, w in srcs.items():
            exp_c = exp_c + _x(j, 5) * w
        torch.testing.assert_close(got_clone, exp_c, rtol=1e-14, atol=1e-14)
        assert unchanged
        torch.testing.assert_close(got_reset, exp_c, rtol=1e-14, atol=1e-14)
        assert all(not after_reset[j].any() for j in ins)
        assert all(not zero_bufs[j].any() for j in ins)
        torch.testing.assert_close(got_zero, _x(i, 6) * topo.self_weight(i), rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------- versions


def _versions() -> list[Any]:
    r = lowband.rank()
    x = _x(r)
    W.win_create(x, "v", zero_init=True)
    for _ in range(r + 1):
        W.win_put(x, "v")
    lowband.barrier()
    v1 = W.get_win_version("v")
    W.win_update("v")
    v2 = W.get_win_version("v")
    lowband.barrier()
    W.win_accumulate(x, "v")
    W.win_get("v")
    lowband.barrier()
    v3 = W.get_win_version("v")
    W.win_update_then_collect("v")
    v4 = W.get_win_version("v")
    W.win_free("v")
    return [v1, v2, v3, v4]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_versions_count_writes_since_update(n: int) -> None:
    res = run_threads(_versions, n, timeout=60)
    topo = exponential_two(n)
    for i in range(n):
        ins = topo.in_neighbors(i)
        v1, v2, v3, v4 = res[i]
        assert v1 == {j: j + 1 for j in ins}
        assert v2 == dict.fromkeys(ins, 0)
        assert v3 == dict.fromkeys(ins, 2)  # one accumulate from j, one get from j
        assert v4 == dict.fromkeys(ins, 0)


# ---------------------------------------------------------------- asynchronous push-sum (paper Listing 3)

PS_DIM = 5


def _push_sum() -> torch.Tensor:
    r, n = lowband.rank(), lowband.size()
    rng = random.Random(1000 + r)
    x = data(r, (PS_DIM,), F64, 9, integer=False)
    x_ext = torch.cat([x, torch.ones(1, dtype=F64)])
    W.win_create(x_ext, "ps", zero_init=True)
    outs = exponential_two(n).out_neighbors(r)
    share = 1.0 / (len(outs) + 1)
    for _ in range(150 + 25 * r):  # every rank runs a different number of iterations
        W.win_accumulate(
            x_ext, "ps", self_weight=share, dst_weights=dict.fromkeys(outs, share), require_mutex=True
        )
        W.win_update_then_collect("ps")
        time.sleep(rng.uniform(0.0, 0.003))
    lowband.barrier()  # every rank's accumulates have been applied
    W.win_update_then_collect("ps")
    W.win_free("ps")
    return x_ext.clone()


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_async_push_sum_conserves_mass_and_converges(n: int) -> None:
    res = run_threads(_push_sum, n, timeout=90)
    xs = torch.stack([data(r, (PS_DIM,), F64, 9, integer=False) for r in range(n)])
    final = torch.stack(res)
    torch.testing.assert_close(final[:, :PS_DIM].sum(0), xs.sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        final[:, PS_DIM].sum(), torch.tensor(float(n), dtype=F64), rtol=1e-12, atol=1e-12
    )
    avg = xs.mean(0)
    for i in range(n):
        torch.testing.assert_close(final[i, :PS_DIM] / final[i, PS_DIM], avg, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- a busy rank still receives


def _busy(done: threading.Event, count: list[int], lock: threading.Lock) -> dict[int, int]:
    r, n = lowband.rank(), lowband.size()
    x = _x(r)
    W.win_create(x, "b", zero_init=True)
    putters = [j for j in range(1, n) if 0 in exponential_two(n).out_neighbors(j)]
    if r == 0:
        # Busy: calls nothing of lowband until every putter's blocking put has returned.
        assert done.wait(30.0), "puts to a busy rank did not complete"
        seen = W.get_win_version("b")  # completion means applied: no barrier needed
    else:
        if r in putters:
            W.win_put(x, "b", dst_weights={0: 1.0})
            with lock:
                count[0] += 1
                if count[0] == len(putters):
                    done.set()
        seen = {}
    lowband.barrier()
    W.win_free("b")
    return seen


@pytest.mark.parametrize("n", [2, 3, 4])
def test_busy_rank_window_receives_puts(n: int) -> None:
    res = run_threads(_busy, n, threading.Event(), [0], threading.Lock(), timeout=60)
    assert res[0] == dict.fromkeys(exponential_two(n).in_neighbors(0), 1)


# ---------------------------------------------------------------- the distributed mutex


def _exclusion(shared: dict[str, Any], k: int) -> int:
    r = lowband.rank()
    W.win_create(_x(r), "m", topology=fully_connected(lowband.size()))
    lowband.barrier()
    entered = 0
    for _ in range(k):
        ctx = W.win_mutex("m", for_self=True) if r == 0 else W.win_mutex("m", ranks=[0])
        with ctx:
            with shared["lock"]:
                shared["inside"] += 1
                if shared["inside"] != 1:
                    shared["violations"] += 1
            time.sleep(0.002)
            with shared["lock"]:
                shared["inside"] -= 1
            entered += 1
    lowband.barrier()
    W.win_free("m")
    return entered


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_win_mutex_is_mutually_exclusive(n: int) -> None:
    shared: dict[str, Any] = {"lock": threading.Lock(), "inside": 0, "violations": 0}
    res = run_threads(_exclusion, n, shared, 6, timeout=60)
    assert res == [6] * n
    assert shared["violations"] == 0


def _no_lost_update(k: int) -> torch.Tensor:
    r, n = lowband.rank(), lowband.size()
    x = torch.zeros(SHAPE, dtype=F64)
    W.win_create(x, "c", zero_init=True, topology=fully_connected(n))
    one = torch.ones(SHAPE, dtype=F64)
    others = [j for j in range(n) if j != r]
    for i in range(k):
        if i % 3 == 2 and others:
            # holding the destinations' mutexes, a mutexed accumulate to them is applied at once
            with W.win_mutex("c", ranks=others):
                W.win_accumulate(one, "c", require_mutex=True)
        else:
            h = W.win_accumulate_nonblocking(one, "c", require_mutex=True)
            W.win_update_then_collect("c")
            assert W.win_wait(h)
    lowband.barrier()
    W.win_update_then_collect("c")
    W.win_free("c")
    return x.clone()


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_concurrent_mutexed_accumulates_lose_nothing(n: int) -> None:
    k = 12
    res = run_threads(_no_lost_update, n, k, timeout=60)
    for i in range(n):
        assert torch.equal(res[i], torch.full(SHAPE, float(k * (n - 1)), dtype=F64))


def _locked(locked: threading.Event, issued: threading.Barrier) -> list[Any]:
    r, n = lowband.rank(), lowband.size()
    x = _x(r)
    W.win_create(x, "l", zero_init=True)
    senders = exponential_two(n).in_neighbors(0)
    out: list[Any] = []
    if r == 0:
        with W.win_lock("l"):
            locked.set()
            issued.wait(30.0)
            time.sleep(0.05)  # a wrongly applied put would show up meanwhile
            out = [W.get_win_version("l"), _bufs("l")]
        lowband.barrier()
        out.append(W.get_win_version("l"))
    else:
        assert locked.wait(30.0)
        if r in senders:
            h = W.win_put_nonblocking(x, "l", dst_weights={0: 1.0})
            out.append(W.win_poll(h))  # cannot be done while rank 0 holds its window locked
            issued.wait(30.0)
            assert W.win_wait(h)
        else:
            issued.wait(30.0)
        lowband.barrier()
    W.win_free("l")
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_win_lock_holds_back_incoming_operations(n: int) -> None:
    res = run_threads(_locked, n, threading.Event(), threading.Barrier(n), timeout=60)
    ins = exponential_two(n).in_neighbors(0)
    during, bufs, after = res[0]
    assert during == dict.fromkeys(ins, 0)
    assert all(not bufs[j].any() for j in ins)
    assert after == dict.fromkeys(ins, 1)
    for j in ins:
        assert res[j] == [False]


# ---------------------------------------------------------------- errors


def _errors() -> list[str]:
    r, n = lowband.rank(), lowband.size()
    msgs: list[str] = []

    def expect(exc: type[BaseException], fn: Any, *args: Any, **kw: Any) -> None:
        with pytest.raises(exc) as info:
            fn(*args, **kw)
        msgs.append(str(info.value))

    x = _x(r)
    topo = ring(n, style="right")  # r sends to r+1 only, receives from r-1 only
    expect(InvalidArgumentError, W.win_put, x, "nope")
    expect(InvalidArgumentError, W.win_create, torch.zeros(3, dtype=torch.int64), "ints")
    W.win_create(x, "e", topology=topo)
    expect(InvalidArgumentError, W.win_create, x, "e")  # duplicate name
    stranger = (r + 2) % n
    expect(InvalidArgumentError, W.win_put, x, "e", dst_weights={stranger: 1.0})
    expect(InvalidArgumentError, W.win_accumulate, x, "e", dst_weights=[(r - 1) % n])  # an in-neighbor only
    expect(InvalidArgumentError, W.win_get, "e", src_weights={(r + 1) % n: 1.0})  # an out-neighbor only
    expect(InvalidArgumentError, W.win_put, torch.zeros(2, dtype=F64), "e")  # shape
    expect(InvalidArgumentError, W.win_update, "e", self_weight=0.5)  # weights must come together
    expect(InvalidArgumentError, W.win_update, "e", self_weight=0.5, src_weights={(r + 1) % n: 1.0})
    with W.win_mutex("e"):
        expect(InvalidArgumentError, W.win_free, "e")  # still holding the neighbor's mutex
    expect(InvalidArgumentError, W.win_load_state_dict, "e", {"buffers": {}, "versions": {}})
    lowband.barrier()
    W.win_free("e")
    expect(InvalidArgumentError, W.win_update, "e")  # freed
    # a different shape on one rank: every rank raises the same mismatch error
    expect(CollectiveMismatchError, W.win_create, torch.zeros(3 + (r == n - 1), dtype=F64), "s")
    assert W.window_names() == []
    return msgs


@pytest.mark.parametrize("n", [3, 4])
def test_errors_name_rank_and_argument(n: int) -> None:
    res = run_threads(_errors, n, timeout=60)
    for r in range(n):
        msgs = res[r]
        assert len(msgs) == 13
        for m in msgs[:-1]:
            assert f"on rank {r}" in m, m
        assert "no window named 'nope'" in msgs[0]
        assert "already exists" in msgs[2]
        assert f"rank {(r + 2) % n}" in msgs[3] and "out-neighbor" in msgs[3]
        assert "in-neighbor" in msgs[5]
        assert "shape" in msgs[-1] and f"rank {n - 1}" in msgs[-1]


# ---------------------------------------------------------------- a peer declaring a size that does not fit


def _forged_requests() -> list[Any]:
    """Rank 0 sends rank 1 hand-made requests: a put of the window's bytes in another dtype (refused,
    received within the window's size, the pair stays usable), then one declaring 2**40 float64 elements
    (8 TiB) with no payload behind it (refused before anything is allocated)."""
    from lowband.decentral.window_protocol import MISMATCH, PUT, request_ops
    from lowband.decentral.window_service import lookup, registry

    r = lowband.rank()
    x = _x(r, 3)
    W.win_create(x, "f", topology=fully_connected(2), zero_init=True)
    out: list[Any] = []
    if r == 0:
        _, svc, rec = lookup("test", "f")
        half = torch.ones(2 * x.numel(), dtype=torch.float32)  # the window's bytes, another dtype
        ops, st = request_ops(
            1, PUT, rec.wid, svc.next_tag(), payload=half, numel=half.numel(), dtype=half.dtype
        )
        svc.post("win_put", ops, lambda: True).wait(10.0)
        out.append(int(st.item()))
        W.win_put(x, "f")  # the pair still works
        ops, st = request_ops(1, PUT, rec.wid, svc.next_tag(), numel=2**40, dtype=F64)
        svc.post("win_put", ops, lambda: True).wait(10.0)
        out.append(int(st.item()))
        out.append(MISMATCH)
    lowband.barrier()
    if r == 1:
        out.append(registry(lowband.runtime.current()).by_name["f"][1].buffers[0].clone())
        with pytest.raises(CommFailedError) as info:
            W.get_win_version("f")  # the service's failure surfaces on this rank's next window call
        out.append(str(info.value))
    return out


def test_window_service_checks_declared_size_before_receiving() -> None:
    res = run_threads(_forged_requests, 2, timeout=60)
    first, second, mismatch = res[0]
    assert first == mismatch and second == mismatch
    buf, msg = res[1]
    assert torch.equal(buf, _x(0, 3))  # the genuine put after the refused one was applied
    assert "rank 0 declared a payload of 1099511627776 torch.float64 elements" in msg, msg
    assert "refused without receiving it" in msg and "on rank 1" in msg


# ---------------------------------------------------------------- free / re-create, several windows, groups


def _recreate() -> list[Any]:
    r, n = lowband.rank(), lowband.size()
    a = _x(r, 11)
    W.win_create(a, "a")
    W.win_free("a")
    a2 = torch.arange(7.0, dtype=F64) + r
    b = _x(r, 12)
    W.win_create(a2, "a", zero_init=True, topology=ring(n))
    W.win_create(b, "b")  # another window, another topology, at the same time
    names = W.window_names()
    W.win_put(a2, "a")
    W.win_accumulate(b, "b")
    lowband.barrier()
    out = [names, _bufs("a"), _bufs("b")]
    W.win_free()
    out.append(W.window_names())
    return out


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_free_then_recreate_and_two_windows(n: int) -> None:
    res = run_threads(_recreate, n, timeout=60)
    for i in range(n):
        names, bufs_a, bufs_b, after = res[i]
        assert names == ["a", "b"] and after == []
        for j in ring(n).in_neighbors(i):
            assert torch.equal(bufs_a[j], torch.arange(7.0, dtype=F64) + j)
        for j in exponential_two(n).in_neighbors(i):
            assert torch.equal(bufs_b[j], _x(i, 12) + _x(j, 12))  # zero_init=False: my copy + theirs


def _subgroup() -> dict[int, torch.Tensor] | None:
    r = lowband.rank()
    g = lowband.new_group([1, 2, 3])
    if g is None:
        return None
    x = _x(r, 13)
    W.win_create(x, "g", zero_init=True, group=g)
    W.win_put(x, "g")
    lowband.barrier(group=g)
    out = _bufs("g")
    W.win_free("g")
    return out


def test_window_on_a_subgroup() -> None:
    res = run_threads(_subgroup, 4, timeout=60)
    assert res[0] is None
    topo = exponential_two(3)
    for gi in range(3):
        bufs = res[gi + 1]
        assert bufs is not None
        for gj in topo.in_neighbors(gi):
            assert torch.equal(bufs[gj], _x(gj + 1, 13))


# ---------------------------------------------------------------- state dict, nonblocking handles


def _state() -> list[Any]:
    r = lowband.rank()
    x = _x(r, 14)
    W.win_create(x, "sd", zero_init=True)
    hs = [W.win_put_nonblocking(x, "sd"), W.win_accumulate_nonblocking(x, "sd")]
    assert all(W.win_wait(h) for h in hs) and all(W.win_poll(h) for h in hs)
    lowband.barrier()
    saved = W.win_state_dict("sd")
    g = W.win_get_nonblocking("sd", src_weights=None)
    W.win_wait(g)
    lowband.barrier()
    changed = _bufs("sd")
    W.win_load_state_dict("sd", saved)
    restored = W.win_state_dict("sd")
    W.win_free("sd")
    return [saved, changed, restored]


@pytest.mark.parametrize("n", [1, 3])
def test_state_dict_roundtrip_and_nonblocking(n: int) -> None:
    res = run_threads(_state, n, timeout=60)
    topo = exponential_two(n)
    for i in range(n):
        saved, changed, restored = res[i]
        for j in topo.in_neighbors(i):
            assert torch.equal(saved["buffers"][j], 2 * _x(j, 14))
            assert torch.equal(changed[j], _x(j, 14))
            assert torch.equal(restored["buffers"][j], saved["buffers"][j])
        assert restored["versions"] == saved["versions"] == dict.fromkeys(topo.in_neighbors(i), 2)


# ---------------------------------------------------------------- a dead peer (real processes)


def _die_then_put() -> str | None:
    r = lowband.rank()
    x = torch.ones(1000, dtype=F64)
    W.win_create(x, "d")
    lowband.barrier()
    if r == 2:
        time.sleep(0.2)
        os._exit(3)
    try:
        for _ in range(2000):
            W.win_put(x, "d")
            time.sleep(0.01)
    except (CommFailedError, CommTimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def test_dead_peer_fails_window_ops_boundedly() -> None:
    out = run_processes(_die_then_put, 3, timeout=90, allow_exit=(2,), comm_timeout=5.0)
    for r in (0, 1):
        assert out[r] is not None, f"rank {r} never noticed the dead rank"
        assert f"on rank {r}" in out[r], out[r]


def test_create_refuses_a_non_topology() -> None:
    def fn() -> str:
        with pytest.raises(InvalidArgumentError) as info:
            W.win_create(torch.zeros(2, dtype=F64), "t", topology="ring")  # type: ignore[arg-type]
        return str(info.value)

    msg = run_threads(fn, 2, timeout=30)[0]
    assert "topology" in msg and "on rank 0" in msg
