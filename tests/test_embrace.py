"""The ``embrace`` strategy: 20 training steps of every schedule against the single-process oracle
(SGD and Adam, 1-4 ranks), collective order under random per-rank delays, exact resume including
undelivered embedding gradients, loading at another world size, and a dead rank during an exchange."""

from __future__ import annotations

import io
import random
import threading
import time
from typing import Any

import pytest
import torch
from embrace_model import Net, batch, loss, make_optimizer, oracle

import lowband
from lowband.errors import CommFailedError, CommTimeoutError, InvalidArgumentError
from lowband.strategies import Strategy, assemble_state_dicts, make_strategy
from lowband.testing import RankFailures, run_threads

STEPS = 20


def _train(s: Strategy, steps: range, delay: random.Random | None = None) -> None:
    """Train on this rank's batches of ``steps``, telling the strategy the next batch's ids after each
    step (as the bench does; the horizontal schedules prefetch its lookups, the others ignore it)."""
    r = lowband.rank()
    for k in steps:
        if delay is not None:
            time.sleep(delay.random() * 0.002)
        b = batch(r, k)
        s.train_step(lambda m, b=b: loss(m, b))
        s.lookahead({"emb": batch(r, k + 1)[0]})


def _close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float = 1e-10) -> None:
    assert sorted(got) == sorted(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=tol, msg=k)


def _options(schedule: str) -> dict[str, Any]:
    """``vertical+overlap``: the vertical (or 2d) schedule with the delayed rows on the communication
    thread."""
    name, _, extra = schedule.partition("+")
    return {"schedule": name, "overlap": extra == "overlap"}


def _run(schedule: str, kind: str, steps: int) -> dict[str, Any]:
    s = make_strategy("embrace", Net(), make_optimizer(kind), **_options(schedule))  # type: ignore[arg-type]
    _train(s, range(steps))
    return {"model": s.average_state_dict(), "report": s.report(), "spread": s.replica_spread()}


LAZY = ("vertical", "2d")
SCHEDULES = ("hybrid", "horizontal", "vertical", "vertical+overlap", "2d", "2d+overlap")


@pytest.mark.parametrize("kind", ("sgd", "adam"))
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_training_equals_the_single_process_oracle(n: int, schedule: str, kind: str) -> None:
    res = run_threads(_run, n, schedule, kind, STEPS, timeout=90)
    lazy = schedule.startswith(LAZY)
    ref = oracle(n, STEPS, kind, lazy=lazy).state_dict()
    for out in res:
        _close(out["model"], ref)
        assert out["spread"] == 0.0
    if schedule.startswith(("horizontal", "2d")):  # the dense layers went through the negotiated queue
        assert res[0]["report"]["negotiations"] >= STEPS * 2, res[0]["report"]
    if lazy and n > 1:  # both halves of Algorithm 1 ran
        rows = res[0]["report"]["delivered_rows"]
        assert rows["prior"] > 0 and rows["delayed"] > 0, rows
        busy = res[0]["report"].get("comm_thread_busy_s")  # the delayed rows went on the thread
        assert (busy > 0) if schedule.endswith("+overlap") else busy is None, busy


@pytest.mark.parametrize("schedule", ("vertical", "vertical+overlap", "horizontal", "2d+overlap"))
def test_random_delays_never_reorder_collectives(schedule: str) -> None:
    """Random per-rank sleeps before every step over 200 steps: no mismatch, no hang, the oracle's model."""

    def fn() -> dict[str, torch.Tensor]:
        s = make_strategy("embrace", Net(), make_optimizer("sgd"), **_options(schedule))  # type: ignore[arg-type]
        _train(s, range(200), random.Random(lowband.rank()))
        return s.average_state_dict()

    res = run_threads(fn, 3, timeout=120)
    _close(res[0], oracle(3, 200, "sgd", lazy=schedule.startswith(LAZY)).state_dict())


def _save(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _load(data: bytes) -> dict[str, Any]:
    out: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    return out


@pytest.mark.parametrize("schedule", ("hybrid", "vertical", "vertical+overlap", "horizontal", "2d+overlap"))
def test_resume_is_exact_including_undelivered_gradients(schedule: str) -> None:
    def fn() -> tuple[dict[str, torch.Tensor], int]:
        opts = _options(schedule)
        s = make_strategy("embrace", Net(), make_optimizer("adam"), **opts)  # type: ignore[arg-type]
        _train(s, range(7))
        ckpt = _save(s.state_dict())  # without synchronize: gradients still pending
        pending = len(s.state_dict()["extra"].get("vertical", {}).get("pending", []))
        t = make_strategy("embrace", Net(seed=11), make_optimizer("adam"), **opts)  # type: ignore[arg-type]
        t.load_state_dict(_load(ckpt))
        _train(t, range(7, STEPS))
        return t.average_state_dict(), pending

    res = run_threads(fn, 3, timeout=90)
    _close(res[0][0], oracle(3, STEPS, "adam", lazy=schedule.startswith(LAZY)).state_dict())
    if schedule.startswith(LAZY):
        assert res[0][1] > 0


def test_checkpoint_loads_at_another_world_size() -> None:
    """Every rank's checkpoint at 3 ranks, assembled offline, resumes at 2 ranks: the same model as
    the oracle trained on 3 ranks' batches, then 2 ranks' batches."""

    def save() -> bytes:
        s = make_strategy("embrace", Net(), make_optimizer("adam"), schedule="vertical")  # type: ignore[arg-type]
        _train(s, range(6))
        s.synchronize()  # delivers every pending gradient: the checkpoint holds none
        return _save(s.state_dict())

    ckpts = [_load(c) for c in run_threads(save, 3, timeout=60)]
    full = _save(assemble_state_dicts(ckpts))

    def resume() -> dict[str, torch.Tensor]:
        t = make_strategy("embrace", Net(seed=2), make_optimizer("adam"), schedule="vertical")  # type: ignore[arg-type]
        t.load_state_dict(_load(full))
        _train(t, range(6, 12))
        return t.average_state_dict()

    got = run_threads(resume, 2, timeout=60)[0]
    ref = Net()
    make = make_optimizer("adam")
    opt_d = make([p for p in ref.parameters() if p is not ref.emb.weight])  # type: ignore[operator]
    opt_t = torch.optim.SparseAdam([ref.emb.weight], lr=0.05)
    ref.emb.sparse = True
    for k in range(12):
        n = 3 if k < 6 else 2
        opt_d.zero_grad()
        opt_t.zero_grad()
        (sum(loss(ref, batch(r, k)) for r in range(n)) / n).backward()  # type: ignore[union-attr]
        opt_d.step()
        opt_t.step()
    ref.emb.sparse = False
    _close(got, ref.state_dict())


def test_pending_gradients_do_not_load_at_another_world_size() -> None:
    def save() -> bytes:
        s = make_strategy("embrace", Net(), make_optimizer("sgd"), schedule="vertical")  # type: ignore[arg-type]
        _train(s, range(2))
        return _save(s.state_dict())

    ckpts = [_load(c) for c in run_threads(save, 2, timeout=60)]
    full = _save(assemble_state_dicts(ckpts))

    def load() -> None:
        t = make_strategy("embrace", Net(), make_optimizer("sgd"), schedule="vertical")  # type: ignore[arg-type]
        t.load_state_dict(_load(full))

    with pytest.raises(RankFailures, match="after synchronize"):
        run_threads(load, 3, timeout=60)


def test_options_are_checked() -> None:
    def fn(opts: dict[str, Any], opt: str) -> None:
        make_strategy("embrace", Net(), make_optimizer(opt), **opts)  # type: ignore[arg-type]

    with pytest.raises(RankFailures, match="schedule must be one of"):
        run_threads(fn, 2, {"schedule": "diagonal"}, "sgd", timeout=30)

    def momentum() -> None:
        make_strategy(
            "embrace", Net(), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), schedule="vertical"
        )

    with pytest.raises(RankFailures, match="momentum"):
        run_threads(momentum, 2, timeout=30)
    assert issubclass(InvalidArgumentError, Exception)


def test_lookahead_is_checked() -> None:
    """lookahead names only tables; the next call must be on the prefetched ids (every rank raises)."""

    def fn() -> None:
        s = make_strategy("embrace", Net(), make_optimizer("sgd"), schedule="horizontal")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match=r"lookahead ids for \['nope'\].*tables: \['emb'\]"):
            s.lookahead({"nope": torch.zeros(2, 3, dtype=torch.long)})
        r = lowband.rank()
        s.lookahead({"emb": batch(r, 0)[0]})
        with pytest.raises(InvalidArgumentError, match="other than the ones prefetched"):
            b = batch(r, 1)
            s.train_step(lambda m: loss(m, b))

    run_threads(fn, 2, timeout=60)


COMM_TIMEOUT = 3.0


@pytest.mark.parametrize("schedule", ("hybrid", "vertical+overlap", "2d+overlap"))
def test_dead_rank_during_the_exchange_fails_the_others_in_bounded_time(schedule: str) -> None:
    """Rank 2 dies after a step; ranks 0 and 1 raise a lowband comm error within the timeout (from the
    lookup's exchange, or from the communication thread's delayed exchange)."""
    seen: dict[int, tuple[str, float]] = {}
    lock = threading.Lock()

    def fn() -> None:
        r = lowband.rank()
        s = make_strategy("embrace", Net(), make_optimizer("sgd"), **_options(schedule))  # type: ignore[arg-type]
        _train(s, range(1))  # everybody up and connected
        if r == 2:
            raise ValueError("rank 2 dies before the lookup's exchange")
        t0 = time.monotonic()
        try:
            _train(s, range(1, 2))
        except (CommTimeoutError, CommFailedError) as exc:
            with lock:
                seen[r] = (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)

    with pytest.raises(RankFailures) as ei:
        run_threads(fn, 3, comm_timeout=COMM_TIMEOUT, timeout=60)
    assert set(ei.value.errors) == {2}, ei.value
    assert set(seen) == {0, 1}, seen
    for r, (msg, waited) in seen.items():
        assert f"on rank {r}" in msg, msg
        assert waited < COMM_TIMEOUT + 5, f"rank {r} took {waited:.1f} s: {msg}"
