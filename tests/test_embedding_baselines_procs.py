"""``ddp-sparse`` (torch DDP with the tables as ``sparse=True``, torch's gloo sparse path) on real
processes (DDP needs a process-wide group): 20 steps equal single-process training on the
concatenated batches, a checkpoint resumes bit for bit (DDP rebuilds its buckets first), and a rank
that dies makes the others raise lowband's errors within the timeout."""

from __future__ import annotations

import io
import os
import time

import pytest
import torch
from embedding_model import adam, batch, flat, loss, loss_fn, model, oracle

import lowband
from lowband.strategies import make_strategy
from lowband.testing import run_processes

STEPS, RESUME_AT = 20, 9
COMM_TIMEOUT = 10.0


def _train_and_resume() -> tuple[list[float], list[float], bool]:
    r = lowband.rank()
    whole = model()
    s = make_strategy("ddp-sparse", whole, adam)
    buf = io.BytesIO()
    for k in range(STEPS):
        if k == RESUME_AT:
            torch.save(s.state_dict(), buf)
        s.train_step(loss_fn(r, k))
    sparse = whole.emb.sparse and whole.out_emb.sparse
    half = model()
    t = make_strategy("ddp-sparse", half, adam)
    t.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for k in range(RESUME_AT, STEPS):
        t.train_step(loss_fn(r, k))
    return flat(whole).tolist(), flat(half).tolist(), sparse


@pytest.mark.parametrize("n", [3])
def test_ddp_sparse_equals_single_process_and_resumes(n: int) -> None:
    want = oracle(n, STEPS)
    for r, (whole, resumed, sparse) in enumerate(run_processes(_train_and_resume, n, timeout=180)):
        assert sparse, "the tables were not switched to sparse gradients"
        err = float((torch.tensor(whole, dtype=torch.float64) - want).abs().max())
        assert err < 1e-10, f"rank {r} of {n}: max |difference| {err:.3g}"
        assert resumed == whole, f"rank {r}: the resumed run differs"


def _die(victim: int) -> tuple[str, float] | None:
    r = lowband.rank()
    s = make_strategy("ddp-sparse", model(), adam)
    s.train_step(lambda mod: loss(mod, batch(r, 0)))
    lowband.barrier()
    if r == victim:
        time.sleep(0.3)
        os._exit(3)
    t0 = time.monotonic()
    try:
        for k in range(1, 1000):
            s.train_step(loss_fn(r, k))
            time.sleep(0.01)
    except (lowband.CommFailedError, lowband.CommTimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    return None


def test_ddp_sparse_dead_rank() -> None:
    n, victim = 2, 1
    out = run_processes(_die, n, victim, timeout=120, allow_exit=(victim,), comm_timeout=COMM_TIMEOUT)
    res = out[0]
    assert res is not None, "rank 0 never noticed the dead rank"
    msg, waited = res
    assert "ddp-sparse" in msg and "on rank 0" in msg, msg
    assert waited < COMM_TIMEOUT + 5, f"rank 0 took {waited:.1f} s to notice"
