"""Device discipline of the compression framework: every tensor it creates takes its device from its
input (or says ``device="cpu"`` where it is host bookkeeping).

CPU-checkable: each registered compressor through each registered transport that carries it, the
gs-SGD, Sketched-SGD and gTop-k reducers, CountSketch, HEAVYMIX, the gTop-k merge and the wire framing
run on CPU inputs made outside ``with torch.device("meta")`` with their work inside it: a tensor made
without a device lands on ``meta`` and fails when mixed with the CPU inputs, or comes back on ``meta``.
Every output must be a CPU tensor equal (bit for bit) to the same run without the context.

CUDA (``@pytest.mark.cuda``, skipped without a GPU): the same matrix with CUDA inputs at 2 thread-ranks
over gloo (host-staged allreduce, broadcast, allgather, all-to-all), compared with the CPU run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from compress_fixtures import buildable

import lowband
from lowband.compress import COMPRESSORS, TRANSPORTS, CompressContext, Payload, build_reducer, make_compressor
from lowband.compress.allgather import split_frames
from lowband.compress.finite import ENV, raise_pending
from lowband.compress.gssgd import GsSGDReducer, GTopKReducer, SketchedSGDReducer
from lowband.compress.heavymix import heavymix, merge_topk
from lowband.compress.sketch import CountSketch
from lowband.compress.wire import framed, from_bytes, to_bytes, unframe
from lowband.errors import InvalidArgumentError
from lowband.optim.reducer import ReduceContext, Reducer, Unit
from lowband.testing import run_threads

Tensor = torch.Tensor
N = 2
STEPS = 2
#: PowerSGD compresses from the first step (its default starts after 1000)
TRANSPORT_SPECS = {"powersgd": "powersgd:start_iter=0,rank=1"}
#: units: a matrix PowerSGD compresses ((8 + 6) * 2 < 48), a vector and a scalar beside it, a unit
#: alone, a unit of no elements
LAYOUT: tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], ...] = (
    ("block", (("block.w", (8, 6)), ("block.b", (6,)), ("block.tiny", (1,)))),
    ("head", (("head.w", (11,)),)),
    ("empty", (("empty.w", (0,)),)),
)


def units(device: torch.device | str) -> list[Unit]:
    return [
        Unit(key, tuple(n for n, _ in ps), tuple(torch.zeros(s, device=device) for _, s in ps))
        for key, ps in LAYOUT
    ]


def grads(rank: int, step: int, unit: int, device: torch.device | str, integer: bool = False) -> list[Tensor]:
    """Seeded gradients: normal, or integers in [-9, 9] (any sum of two is exact in any order)."""
    g = torch.Generator().manual_seed(7919 * rank + 104_729 * step + 13 * unit + 1)
    if integer:
        return [torch.randint(-9, 10, s, generator=g).float().to(device) for _, s in LAYOUT[unit][1]]
    return [torch.randn(s, generator=g).to(device) for _, s in LAYOUT[unit][1]]


@contextlib.contextmanager
def on(meta: bool) -> Iterator[None]:
    """The default device ``meta`` (thread-local) when ``meta``; nothing otherwise."""
    if meta:
        with torch.device("meta"):
            yield
    else:
        yield


def reduce_steps(make: Callable[[], Reducer], device: str, meta: bool, integer: bool = False) -> list[Tensor]:
    """This rank's results of ``STEPS`` steps over every unit (inputs made outside ``meta``)."""
    reducer = make()
    # the globally sparse reducers refuse a unit of no elements (k = 0): not a device matter
    us = [u for u in units(device) if u.key != "empty" or not integer]
    inputs = [[grads(lowband.rank(), s, i, device, integer) for i in range(len(us))] for s in range(STEPS)]
    group = lowband.world().unchecked()  # as the gradient stage runs its reducer
    out = []
    for s in range(STEPS):
        for i, u in enumerate(us):
            with on(meta):
                res = reducer.reduce(u, [g.clone() for g in inputs[s][i]], ReduceContext(group, s)).wait()
            out += [t.detach().reshape(-1) for t in res]
    return out


def matrix() -> list[Any]:
    """Every (compressor, transport) pair the transport carries, as its own test id."""
    pairs = []
    for t in sorted(TRANSPORTS.descriptions()):
        for c in sorted(COMPRESSORS.descriptions()):
            spec, _ = buildable(c, TRANSPORT_SPECS.get(t, t))
            if spec is not None:
                pairs.append(pytest.param(spec, TRANSPORT_SPECS.get(t, t), id=f"{c}-{t}"))
    return pairs


def compressed(spec: str, transport: str) -> Callable[[], Reducer]:
    return lambda: build_reducer(spec, transport, seed=5)


def _check_same(plain: list[Tensor], got: list[Tensor], device: str, what: str) -> None:
    assert len(plain) == len(got), what
    for k, (a, b) in enumerate(zip(plain, got, strict=True)):
        assert b.device.type == device, f"{what}: output {k} on {b.device}"
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: output {k} differs: {a} vs {b}"


def _meta_vs_plain(make: Callable[[], Reducer], what: str, integer: bool = False) -> None:
    def rank_fn() -> tuple[list[Tensor], list[Tensor]]:
        return reduce_steps(make, "cpu", False, integer), reduce_steps(make, "cpu", True, integer)

    for r, (plain, meta) in enumerate(run_threads(rank_fn, N, timeout=60.0)):
        _check_same(plain, meta, "cpu", f"{what} rank {r}")


@pytest.mark.parametrize(("spec", "transport"), matrix())
def test_compressor_transport_on_input_device(spec: str, transport: str) -> None:
    _meta_vs_plain(compressed(spec, transport), f"{spec} over {transport}")


#: the globally sparse reducers (tree, allreduce and star reductions), a unit of 51 elements
SPARSE: dict[str, Callable[[], Reducer]] = {
    "gs-sgd-tree": lambda: GsSGDReducer(density=0.1, seed=3),
    "gs-sgd-allreduce-topk": lambda: GsSGDReducer(density=0.1, reduce="allreduce", recovery="topk", seed=3),
    "sketched-sgd": lambda: SketchedSGDReducer(density=0.1, oversample=2.0, momentum=0.5, masking=True),
    "gtopk": lambda: GTopKReducer(density=0.1),
    "gtopk-paper": lambda: GTopKReducer(k=4, feedback="paper"),
}


@pytest.mark.parametrize("kind", sorted(SPARSE))
def test_sparse_reducers_on_input_device(kind: str) -> None:
    _meta_vs_plain(SPARSE[kind], kind, integer=True)


# ------------------------------------------------------------------------ pure parts


def test_countsketch_on_input_device() -> None:
    sk = CountSketch(300, 5, 40, seed=9)
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    y = torch.randn(300, generator=torch.Generator().manual_seed(2))

    def run(meta: bool) -> list[Tensor]:
        with on(meta):
            t = sk.sketch(x)
            sk.accumulate(t, y)
            est = sk.estimate(t)
            rows = sk.row_estimates(t)
            z = sk.zeros(torch.float64, x.device)
            return [t, est, rows, sk.norm_sq_tensor(t), z, torch.tensor(sk.norm_sq(t), device="cpu")]

    _check_same(run(False), run(True), "cpu", "CountSketch")


def test_heavymix_and_merge_on_input_device() -> None:
    g = torch.Generator().manual_seed(4)
    est = torch.randn(200, generator=g)
    est[[3, 50, 120]] *= 40  # a few heavy coordinates, filled up to k from the shared stream
    ia, ib = torch.tensor([1, 4, 9, 12]), torch.tensor([4, 5, 12, 30])
    va, vb = torch.randn(4, generator=g), torch.randn(4, generator=g)

    def run(meta: bool) -> list[Tensor]:
        with on(meta):
            gen = torch.Generator(device="cpu").manual_seed(11)
            picked = heavymix(est, float(est.double().square().sum()), 10, gen)
            gen = torch.Generator(device="cpu").manual_seed(11)
            picked_t = heavymix(est, est.double().square().sum(), 10, gen)
            return [picked, picked_t, *merge_topk(ia, va, ib, vb, 3)]

    plain, meta = run(False), run(True)
    _check_same(plain, meta, "cpu", "heavymix/merge_topk")
    assert torch.equal(plain[0], plain[1]) and plain[0].numel() == 10


def test_wire_on_input_device() -> None:
    data = (torch.arange(5, dtype=torch.int64), torch.randn(3), torch.tensor([1, 0, 1], dtype=torch.uint8))
    full = Payload(data, 9, torch.float32)
    empty = Payload((), 9, torch.float32)

    def run(meta: bool) -> list[Tensor]:
        with on(meta):
            frames = [framed(full), framed(empty), framed(empty, device="cpu")]
            back = [t for b in split_frames(torch.cat(frames), 3) for t in unframe(b, 9, torch.float32).data]
            raw = to_bytes(data)
            return [*frames, *back, raw, *from_bytes(raw, data), to_bytes((), device="cpu")]

    _check_same(run(False), run(True), "cpu", "wire")


# ------------------------------------------------------------------------ CUDA (skipped without a GPU)


def _cuda_vs_cpu(make: Callable[[], Reducer], what: str, tol: float | None, integer: bool = False) -> None:
    """The CUDA run's results against the CPU run's: bit for bit (``tol=0``), within ``rtol=tol,
    atol=tol`` or, ``tol=None``, only finite and of the same shape; the ranks agree bit for bit on CUDA."""

    def rank_fn() -> tuple[list[Tensor], list[Tensor]]:
        torch.cuda.set_device(0)
        cpu = reduce_steps(make, "cpu", False, integer)
        gpu = reduce_steps(make, "cuda", False, integer)
        assert all(t.device.type == "cuda" for t in gpu), f"{what}: an output left the GPU"
        return cpu, [t.to("cpu") for t in gpu]

    out = run_threads(rank_fn, N, timeout=120.0)
    for r, (cpu, gpu) in enumerate(out):
        assert len(cpu) == len(gpu), what
        for k, (a, b) in enumerate(zip(cpu, gpu, strict=True)):
            assert a.shape == b.shape and a.dtype == b.dtype and bool(torch.isfinite(b).all()), what
            if tol == 0:
                assert torch.equal(a, b), f"{what} rank {r} output {k}: CPU {a} vs CUDA {b}"
            elif tol is not None:
                assert torch.allclose(a, b, rtol=tol, atol=tol), f"{what} rank {r} output {k}: {a} vs {b}"
    for k, (a, b) in enumerate(zip(out[0][1], out[1][1], strict=True)):
        assert torch.equal(a, b), f"{what}: ranks disagree on CUDA at output {k}"


#: stochastic rounding draws from a per-rank stream on the input's device (CUDA's Philox, not the
#: CPU's Mersenne twister; a full-size CPU draw per step would cost a host-to-device copy of the
#: gradient's size): their CUDA results are not the CPU's, only checked for shape, finiteness and
#: agreement across ranks
STOCHASTIC = {"qsgd", "terngrad"}
#: a reduction (a sum, a norm) in the compressor: CUDA's summation order rounds differently; or an
#: ``a * b + c`` that CUDA's elementwise kernels contract into one fused multiply-add (minmax8's decode
#: ``lo + code * step``: on an H200 its results differed from the CPU's in the last bits, 2026-11-26);
#: onebit's and twobit's reconstruction values are means of the positive and negative parts (on an
#: H200 they differed from the CPU's in the last bits over every transport, 2026-11-27); dct-topk's
#: transform is a matrix product (cuBLAS sums in its own order)
REDUCING = {"scaledsign", "minmax8", "onebit", "twobit", "dct-topk"}


def cuda_tolerance(spec: str, transport: str) -> float | None:
    name, tname = spec.split(":")[0], transport.split(":")[0]
    if name in STOCHASTIC:
        return None
    if tname == "powersgd" or name in REDUCING:  # matmul, QR and norms on cuBLAS/cuSOLVER
        return 1e-4
    return 0.0  # casts, selections, sign, threshold codes, min-max: exact; rank-order sums: exact


@pytest.mark.parametrize(("spec", "transport"), matrix())
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compressor_transport_matches_cpu(spec: str, transport: str) -> None:
    """Deterministic compressors bit-equal to the CPU; see :func:`cuda_tolerance` for the others."""
    _cuda_vs_cpu(compressed(spec, transport), f"{spec} over {transport}", cuda_tolerance(spec, transport))


#: the sparse reducers that use only allreduce and broadcast (host-staged by gloo on CUDA)
CUDA_SPARSE = ("gs-sgd-allreduce-topk",)
#: the tree and star reductions run on point-to-point ops: ProcessGroupGloo's send/recv hand the
#: tensor's pointer to its TCP transport unstaged (only its collectives stage CUDA tensors through the
#: host), so comm/ must stage CUDA tensors for gloo's point-to-point ops before these can run there
TREE_LIMITATION = "gloo send/recv of CUDA tensors are not host-staged (tree reductions, comm/batch.py)"


@pytest.mark.parametrize("kind", sorted(SPARSE))
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sparse_reducers_match_cpu(kind: str) -> None:
    """Integer-valued gradients: sketches (CUDA's atomic scatter-adds in any order), sums and selections
    are exact, so the CUDA run is the CPU run bit for bit. The tree and star reductions run on
    point-to-point ops, which comm/batch.py stages through host memory for gloo."""
    _cuda_vs_cpu(SPARSE[kind], kind, 0.0, integer=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_countsketch_and_wire() -> None:
    """CountSketch tables are the CPU's (drawn there, moved once); framing stays on the payload's device."""
    sk = CountSketch(300, 5, 40, seed=9)
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    cpu, gpu = sk.sketch(x), sk.sketch(x.cuda())
    assert gpu.device.type == "cuda" and torch.allclose(cpu, gpu.cpu(), rtol=1e-6, atol=1e-6)
    assert torch.equal(sk.estimate(gpu).cpu(), sk.estimate(gpu.cpu()))
    data = (torch.arange(5, device="cuda"), torch.randn(3, device="cuda"))
    buf = framed(Payload(data, 9, torch.float32))
    assert buf.device.type == "cuda"
    back = unframe(buf, 9, torch.float32).data
    assert all(a.device == b.device and torch.equal(a, b) for a, b in zip(data, back, strict=True))
    assert framed(Payload((), 9, torch.float32), device="cuda").device.type == "cuda"


# ------------------------------------------------------------------------ the finiteness check


def test_finite_check_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` and ``sync`` raise at once on the CPU naming the element; ``off`` lets the value
    through; an unknown mode is refused by name."""
    topk = make_compressor("topk:k=1")
    x = torch.tensor([1.0, float("nan"), 2.0])
    for mode in ("auto", "sync"):
        monkeypatch.setenv(ENV, mode)
        with pytest.raises(InvalidArgumentError, match=r"'u' \(rank 0\) at step 3.*nan at element 1 of 3"):
            topk.compress(x, CompressContext("u", 3))
    monkeypatch.setenv(ENV, "off")
    assert topk.compress(x, CompressContext("u", 3)).numel == 3
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(InvalidArgumentError, match=ENV):
        topk.compress(x, CompressContext("u", 3))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_finite_check_is_asynchronous_and_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the check does not raise inside the compress call; once the device's flag has landed
    the next check (or raise_pending) raises, naming the unit and step; ``sync`` raises at once."""
    monkeypatch.setenv(ENV, "auto")
    c = make_compressor("sign")
    bad = torch.tensor([1.0, float("inf"), 2.0], device="cuda")
    c.compress(bad, CompressContext("u", 7))
    torch.cuda.synchronize()
    with pytest.raises(InvalidArgumentError, match=r"'u' \(rank 0\) at step 7.*asynchronously"):
        raise_pending()
    raise_pending()  # consumed: nothing left
    monkeypatch.setenv(ENV, "sync")
    with pytest.raises(InvalidArgumentError, match=r"inf at element 1 of 3"):
        c.compress(bad, CompressContext("u", 8))
