"""Device discipline of the embedding path: every tensor the sparse code makes takes its device from its
input. On this CPU-only machine the steps run under ``torch.device("meta")`` (thread-local: entered in
each rank's function) while the model and batches are CPU tensors built outside: a tensor made without
a device lands on ``meta`` and fails when mixed with the CPU ones, or comes back on ``meta``. Each case
must equal the same run without the meta context, bit for bit (every EmbRace schedule, the parameter
servers, sparse-allgather, ddp-sparse, the lazy optimizers, the pure row maths and the bench's ops).

The ``cuda`` tests run the same at 2 ranks with the model on CUDA over gloo (one GPU shared by the
ranks; gloo moves CUDA tensors staged through host memory) and compare with the CPU run (float64, within
1e-9: the GPU's kernels may sum in another order). They use processes, not thread ranks: autograd runs
every CUDA backward of a process on one device thread, which thread ranks would share (a blocking
exchange in one rank's backward would hold up the other's) and which has no thread rank's context."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import embedding_model as em
import pytest
import torch
import torch.nn.functional as F
from embrace_model import Net, batch
from torch import nn

import lowband
import lowband.bench.embedding_ops
from lowband.bench.collectives import COLLECTIVES
from lowband.runtime import current, world_group
from lowband.sparse.embedding import PartitionedEmbedding
from lowband.sparse.exchange import mask_counts, sum_blocks
from lowband.sparse.lazy import lazy_step, sparse_rows
from lowband.sparse.partition import split_rows
from lowband.sparse.rows import RowPartition, coalesce, pack_rows, unpack_rows
from lowband.strategies import make_strategy, parse_strategy_spec
from lowband.testing import run_processes, run_threads

STEPS = 3
SCHEDULES = ("hybrid", "horizontal", "vertical", "vertical+overlap", "2d", "2d+overlap")
BASELINES = ("embedding-ps:partition=range", "embedding-ps:partition=modulo", "sparse-allgather")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _meta(on: bool) -> contextlib.AbstractContextManager[Any]:
    return torch.device("meta") if on else contextlib.nullcontext()


def _optimizer(kind: str) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        if kind == "adam":
            return torch.optim.Adam(params, lr=0.05)
        if kind == "adagrad":
            return torch.optim.Adagrad(params, lr=0.1)
        return torch.optim.SGD(params, lr=0.3)

    return make


def _host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
    assert all(v.device.type == "cpu" for v in out.values())
    return out


def _compute_on(device: str) -> None:
    """Thread ranks compute on the CPU unless told: the CUDA runs bind this rank to the GPU (what
    ``lowband.init(device='cuda')`` does for a process)."""
    dev = torch.device(device)
    current("test").device = lowband.device() if dev.type == "cuda" else dev  # cuda:N, as init binds it


def _meta_backward(tables: Iterable[PartitionedEmbedding]) -> None:
    """The autograd engine runs backward without the forward's device context, so the tables'
    backward (the gradient exchange, or the vertical schedule's sink) enters it again here."""
    for t in tables:
        inner = t.gradient_sink or PartitionedEmbedding.exchange_now

        def sink(table: PartitionedEmbedding, plan: Any, grad: torch.Tensor, inner: Any = inner) -> Any:
            with torch.device("meta"):
                return inner(table, plan, grad)

        t.gradient_sink = sink


def _embrace(schedule: str, kind: str, meta: bool, device: str, pad: bool = True) -> dict[str, torch.Tensor]:
    """Rank's local model after ``STEPS`` steps of ``embrace:schedule`` (``+overlap``): model, batches
    and strategy built outside the meta context, the steps inside it."""
    r = lowband.rank()
    _compute_on(device)
    name, _, extra = schedule.partition("+")
    model = Net(padding_idx=0 if pad else None).to(device)
    batches = [tuple(t.to(device) for t in batch(r, k)) for k in range(STEPS + 1)]
    s = make_strategy(
        "embrace",
        model,
        _optimizer(kind),  # type: ignore[arg-type]
        schedule=name,
        overlap=extra == "overlap",
    )
    if meta:
        _meta_backward(s.tables.values())  # type: ignore[attr-defined]
    with _meta(meta):
        for k in range(STEPS):
            ids, y = batches[k]
            s.train_step(lambda m, ids=ids, y=y: F.cross_entropy(m(ids), y))
            s.lookahead({"emb": batches[k + 1][0]})
        s.synchronize()
        with torch.no_grad():  # an evaluation forward (no gradient, no plan hooks' updates)
            logits = model(batches[0][0])
    s.close()
    assert logits.device == batches[0][0].device
    return _host(model.state_dict())


def _baseline(spec: str, meta: bool, device: str) -> dict[str, torch.Tensor]:
    """Rank's model after ``STEPS`` steps of an embedding baseline (its loss' target made outside)."""
    r = lowband.rank()
    _compute_on(device)
    name, opts = parse_strategy_spec(spec)
    model = em.model().to(device)
    batches = [tuple(t.to(device) for t in em.batch(r, k)) for k in range(STEPS)]
    target = torch.zeros(em.BATCH, dtype=torch.int64, device=device)
    s = make_strategy(name, model, em.adam, **opts)
    with _meta(meta):
        for ctx, cand in batches:
            s.train_step(lambda m, c=ctx, d=cand: F.cross_entropy(m(c, d), target))
        s.synchronize()
    s.close()
    return _host(model.state_dict())


def _same(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], tol: float = 0.0) -> None:
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        assert sorted(g) == sorted(w)
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=tol, atol=tol, msg=f"rank {r}: {k}")


@pytest.mark.parametrize(
    ("schedule", "kind", "pad"),
    [(s, "adam", True) for s in SCHEDULES]
    + [("vertical", "sgd", False), ("vertical+overlap", "sgd", True), ("hybrid", "sgd", False)],
)
def test_embrace_creates_every_tensor_on_its_inputs_device(schedule: str, kind: str, pad: bool) -> None:
    want = run_threads(_embrace, 2, schedule, kind, False, "cpu", pad, timeout=60)
    got = run_threads(_embrace, 2, schedule, kind, True, "cpu", pad, timeout=60)
    _same(got, want)


@pytest.mark.parametrize("spec", BASELINES)
def test_baselines_create_every_tensor_on_their_inputs_device(spec: str) -> None:
    want = run_threads(_baseline, 2, spec, False, "cpu", timeout=60)
    got = run_threads(_baseline, 2, spec, True, "cpu", timeout=60)
    _same(got, want)


def _ddp_sparse(meta: bool) -> list[float]:
    r = lowband.rank()
    model = em.model()
    batches = [em.batch(r, k) for k in range(STEPS)]
    target = torch.zeros(em.BATCH, dtype=torch.int64)
    s = make_strategy("ddp-sparse", model, em.adam)
    with _meta(meta):
        for ctx, cand in batches:
            s.train_step(lambda m, c=ctx, d=cand: F.cross_entropy(m(c, d), target))
    assert all(p.device.type == "cpu" for p in model.parameters())
    return em.flat(model).tolist()


def test_ddp_sparse_creates_every_tensor_on_its_inputs_device() -> None:
    want, got = (
        run_processes(_ddp_sparse, 2, False, timeout=120),
        run_processes(_ddp_sparse, 2, True, timeout=120),
    )
    assert got == want


# -- the pure parts, one process ------------------------------------------------------------------
@pytest.fixture
def meta() -> Iterator[None]:
    with torch.device("meta"):
        yield


@pytest.mark.parametrize("kind", ["range", "modulo"])
@pytest.mark.usefixtures("meta")
def test_row_partition_follows_the_ids(kind: str) -> None:
    part = RowPartition(kind, 11, 3)
    ids = torch.tensor([0, 4, 5, 10, 7], device="cpu")
    for out in (part.owner(ids), part.local(ids), part.by_owner(ids)[0], part.owned(1, ids.device)):
        assert out.device.type == "cpu"
    assert coalesce([ids, ids]).device.type == "cpu"
    assert coalesce([], device="cpu").device.type == "cpu"
    ids2, vals = unpack_rows(pack_rows(ids, torch.ones((5, 2), device="cpu")), 2, torch.float32)
    assert ids2.device.type == vals.device.type == "cpu"


@pytest.mark.usefixtures("meta")
def test_masks_and_owner_sums_follow_the_rows() -> None:
    rows = [torch.tensor([1, 3, 4], device="cpu"), torch.tensor([0, 3], device="cpu")]
    masks = [split_rows(r, torch.tensor([3, 4], device="cpu")) for r in rows]
    assert [m.device.type for m in masks] == ["cpu", "cpu"]
    assert split_rows(rows[0], torch.zeros(0, dtype=torch.int64, device="cpu")).device.type == "cpu"
    counts = mask_counts(masks)
    assert counts == [2, 1]
    blocks = [torch.ones((c, 2), dtype=torch.float64, device="cpu") for c in counts]
    union, values = sum_blocks(blocks, rows, masks, 2, torch.float64)
    assert union.tolist() == [3, 4] and values.device.type == "cpu"
    assert values[:, 0].tolist() == [2.0, 1.0]


@pytest.mark.parametrize("kind", ["adam", "adagrad", "sgd"])
def test_lazy_step_keeps_the_state_on_the_parameters_device(kind: str) -> None:
    from lowband.sparse.lazy import lazy_optimizer

    p = nn.Parameter(torch.randn((6, 3), dtype=torch.float64, device="cpu"))
    opt = lazy_optimizer(_optimizer(kind)([p]), where="test")
    rows, vals = torch.tensor([1, 4], device="cpu"), torch.ones((2, 3), dtype=torch.float64, device="cpu")
    # torch's own sparse Adagrad makes its update with torch.sparse_coo_tensor and no device (it follows
    # the default one), so under meta it is torch that fails: Adagrad's steps run outside the context
    with _meta(kind != "adagrad"):
        for it in (1, 1, 2):
            lazy_step(opt, {p: sparse_rows(rows, vals, p.shape)}, it)
    assert p.device.type == "cpu" and torch.isfinite(p).all()
    for st in opt.state.values():
        for k, v in st.items():
            assert not isinstance(v, torch.Tensor) or v.device.type == "cpu"
            if k == "step":  # pinned to the iteration, torch's own type kept
                assert float(v) == 2.0 and (kind != "adagrad" or isinstance(v, torch.Tensor))


def _bench_ops(meta: bool) -> list[torch.Tensor]:
    group = world_group(None, "test")[1]
    out = []
    for op, opts in (
        ("emb_allgather", {"density": 0.2, "dim": 4}),
        ("emb_alltoall", {"density": 0.2, "dim": 4}),
        ("emb_ps", {"density": 0.2, "dim": 4, "partition": "range"}),
        ("emb_ps", {"density": 0.2, "dim": 4, "partition": "modulo"}),
    ):
        fn = COLLECTIVES.get(op)(group, **opts)
        buf = torch.arange(4 * 40, dtype=torch.float32, device="cpu")
        with _meta(meta):
            for step in range(2):
                fn(buf, step)
        out.append(buf.clone())
    return out


def test_bench_embedding_ops_follow_the_buffer() -> None:
    assert run_threads(_bench_ops, 2, True, timeout=60)[0][0].device.type == "cpu"


# -- CUDA: the same runs with the model on the GPU, thread ranks over gloo ------------------------
@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_embrace_on_cuda_equals_the_cpu_run(schedule: str) -> None:
    want = run_threads(_embrace, 2, schedule, "adam", False, "cpu", timeout=120)
    got = run_processes(
        _embrace, 2, schedule, "adam", False, "cuda", timeout=300, backend="gloo", device="cuda"
    )
    _same(got, want, 1e-9)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("spec", BASELINES)
def test_baselines_on_cuda_equal_the_cpu_run(spec: str) -> None:
    want = run_threads(_baseline, 2, spec, False, "cpu", timeout=120)
    got = run_processes(_baseline, 2, spec, False, "cuda", timeout=300, backend="gloo", device="cuda")
    _same(got, want, 1e-9)
