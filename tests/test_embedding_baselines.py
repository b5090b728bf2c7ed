"""The embedding baselines on thread ranks (sparse-allgather, embedding-ps with both partitions,
dense-priority): 20 steps equal single-process training on the concatenated batches (float64,
Adam: untouched rows move too), the byte counters of a step equal the byte model of
:mod:`lowband.sparse.costs` per operation, a checkpoint resumes bit for bit, and a rank that leaves
makes the others raise within the timeout. ``ddp-sparse`` (torch DDP) is in
test_embedding_baselines_procs.py."""

from __future__ import annotations

import io
import time

import pytest
import torch
from embedding_model import adam, batch, flat, loss, loss_fn, model, oracle, sgd

import lowband
from lowband.sparse import costs
from lowband.sparse.rows import RowPartition, coalesce
from lowband.strategies import make_strategy, parse_strategy_spec
from lowband.strategies.embedding_baselines_priority import chunk_views
from lowband.testing import RankFailures, run_threads

STEPS = 20
SPECS = [
    "sparse-allgather",
    "embedding-ps:partition=range",
    "embedding-ps:partition=modulo",
    "dense-priority:chunk_mb=0.0005",
]


def _train(spec: str, steps: int, make_opt: object = adam) -> torch.Tensor:
    r = lowband.rank()
    name, opts = parse_strategy_spec(spec)
    m = model()
    s = make_strategy(name, m, make_opt, **opts)  # type: ignore[arg-type]
    for k in range(steps):
        s.train_step(loss_fn(r, k))
    s.synchronize()
    assert s.in_sync() and s.replica_spread() == 0.0
    s.close()
    return flat(m)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("spec", SPECS)
def test_equals_single_process_training(spec: str, n: int) -> None:
    want = oracle(n, STEPS)
    for r, got in enumerate(run_threads(_train, n, spec, STEPS, timeout=60)):
        err = float((got - want).abs().max())
        assert err < 1e-10, f"{spec} rank {r} of {n}: max |difference| {err:.3g}"


@pytest.mark.parametrize("spec", ["sparse-allgather", "embedding-ps:partition=modulo"])
def test_sgd_momentum_too(spec: str) -> None:
    want = oracle(3, 8, sgd)
    for got in run_threads(_train, 3, spec, 8, sgd, timeout=60):
        assert float((got - want).abs().max()) < 1e-10


def _resume(spec: str) -> tuple[list[float], list[float]]:
    r = lowband.rank()
    name, opts = parse_strategy_spec(spec)
    whole, half = model(), model()
    s = make_strategy(name, whole, adam, **opts)
    buf = io.BytesIO()
    for k in range(12):
        if k == 6:
            s.synchronize()
            torch.save(s.state_dict(), buf)
        s.train_step(loss_fn(r, k))
    s.synchronize()
    t = make_strategy(name, half, adam, **opts)
    t.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for k in range(6, 12):
        t.train_step(loss_fn(r, k))
    t.synchronize()
    return flat(whole).tolist(), flat(half).tolist()


@pytest.mark.parametrize("spec", SPECS)
def test_resume_is_exact(spec: str) -> None:
    for whole, resumed in run_threads(_resume, 3, spec, timeout=60):
        assert whole == resumed


def test_ps_refuses_another_world_size() -> None:
    def save() -> bytes:
        s = make_strategy("embedding-ps", model(), adam)
        buf = io.BytesIO()
        torch.save(s.state_dict(), buf)
        return buf.getvalue()

    ckpt = run_threads(save, 2)[0]

    def load() -> None:
        s = make_strategy("embedding-ps", model(), adam)
        with pytest.raises(lowband.InvalidArgumentError, match="partition 'modulo' of 2 ranks"):
            s.load_state_dict(torch.load(io.BytesIO(ckpt), weights_only=True))

    run_threads(load, 3)


def _step_bytes(spec: str) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """This rank's counters over one training step, and the byte model's prediction per op."""
    r, n = lowband.rank(), lowband.size()
    name, opts = parse_strategy_spec(spec)
    m = model()
    s = make_strategy(name, m, adam, **opts)
    lowband.reset_trace()
    b = batch(r, 0)
    s.train_step(lambda mod: loss(mod, b))
    s.synchronize()
    got = lowband.counters()
    want: dict[str, int] = {}
    ids = {"emb": [batch(q, 0)[0] for q in range(n)], "out_emb": [batch(q, 0)[1] for q in range(n)]}
    tables = {"emb": m.emb, "out_emb": m.out_emb}
    if name != "dense-priority":  # the report: ids looked up and distinct ids (coalesced rows) per step
        rep = s.report()["tables"]
        for t, e in tables.items():
            assert rep[t]["lookups_per_step"] == ids[t][r].numel()
            assert rep[t]["coalesced_rows_per_step"] == coalesce([ids[t][r]]).numel()
            assert rep[t]["density"] == coalesce([ids[t][r]]).numel() / e.num_embeddings
    if name == "sparse-allgather":
        want["grouped_allreduce"] = sum(costs.allreduce_bytes(p.numel(), 8, n) for p in m.mlp.parameters())
        want["allgather"] = sum(
            costs.sparse_allgather_bytes([coalesce([i]).numel() for i in ids[t]], e.embedding_dim, 8)
            for t, e in tables.items()
        )
    elif name == "embedding-ps":
        want["grouped_allreduce"] = sum(costs.allreduce_bytes(p.numel(), 8, n) for p in m.mlp.parameters())
        total = 0
        for t, e in tables.items():
            part = RowPartition(opts["partition"], e.num_embeddings, n)
            counts = [part.by_owner(coalesce([i]))[1] for i in ids[t]]
            from_q = [counts[q][r] for q in range(n)]
            total += costs.ps_request_bytes(counts[r], r)  # pull: ids to the owners
            total += costs.ps_reply_bytes(from_q, r, e.embedding_dim, 8)  # pull: the owners' rows back
            total += costs.ps_push_bytes(counts[r], r, e.embedding_dim, 8)  # push: rows + ids to owners
        want["alltoall"] = total
        # the refresh after the step (synchronize): one allgather of every owner's rows per table
        want["allgather"] = sum(
            (n - 1) * max(RowPartition(opts["partition"], e.num_embeddings, n).counts()) * e.embedding_dim * 8
            for e in tables.values()
        )
    else:  # dense-priority: every layer's chunks, each allreduced
        chunk = int(opts["chunk_mb"] * 2**20)
        views = chunk_views([p.detach() for p in m.parameters()], chunk)
        want["grouped_allreduce"] = sum(costs.allreduce_bytes(v.numel(), 8, n) for v in views)
    s.close()
    return got, want


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("spec", SPECS)
def test_byte_counters_match_the_model(spec: str, n: int) -> None:
    for r, (got, want) in enumerate(run_threads(_step_bytes, n, spec, trace=True, timeout=60)):
        # the dense part's plain average: one grouped allreduce per unit, or (power-of-two groups, the
        # non-finite check riding its division) the unit flattened and allreduced: the same bytes
        # (power-of-two groups: the plain average's unit is flattened and allreduced whole, the
        # non-finite check riding its division; its ring chunks round per unit, not per parameter:
        # up to 8 bytes per unit and step more than the model's per-parameter count)
        got, want = dict(got), dict(want)
        if "grouped_allreduce" in want and "grouped_allreduce" not in got and "allreduce" in got:
            fused = got.pop("allreduce")
            extra = fused["bytes_sent"] - want.pop("grouped_allreduce")
            assert 0 <= extra <= 8 * fused["calls"] * n, f"{spec} rank {r} of {n}: {fused} ({extra} B over)"
        sent = {op: c["bytes_sent"] for op, c in got.items() if op in want}
        assert sent == want, f"{spec} rank {r} of {n}: sent {sent} want {want}"


def _leave(spec: str, victim: int) -> tuple[str, float] | None:
    r = lowband.rank()
    name, opts = parse_strategy_spec(spec)
    s = make_strategy(name, model(), adam, **opts)
    s.train_step(lambda mod: loss(mod, batch(r, 0)))  # everybody is up and connected
    if r == victim:
        return None  # leaves: its shutdown closes its connections
    t0 = time.monotonic()
    try:
        for k in range(1, 1000):
            s.train_step(loss_fn(r, k))
            s.synchronize()
    except (lowband.CommFailedError, lowband.CommTimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    return None


@pytest.mark.parametrize("spec", SPECS)
def test_a_rank_leaving_makes_the_others_raise(spec: str) -> None:
    comm_timeout = 2.0
    try:
        out = run_threads(_leave, 3, spec, 1, timeout=60, comm_timeout=comm_timeout)
    except RankFailures as exc:  # a rank may also fail inside a torch callback: it must name the op
        pytest.fail(f"ranks failed with other errors: {exc}")
    for r in (0, 2):
        res = out[r]
        assert res is not None, f"rank {r} never noticed"
        msg, waited = res
        assert f"rank {r}" in msg, msg
        assert waited < comm_timeout + 5, f"rank {r} took {waited:.1f} s"


def test_unknown_options_are_refused() -> None:
    def build() -> None:
        with pytest.raises(lowband.InvalidArgumentError, match="partition"):
            make_strategy("embedding-ps", model(), adam, partition="hash")
        with pytest.raises(lowband.InvalidArgumentError, match="chunk_mb"):
            make_strategy("dense-priority", model(), adam, chunk_mb=0)

    run_threads(build, 2)
