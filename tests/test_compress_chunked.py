"""The per-chunk compressors: ``dct-topk`` (an orthonormal DCT-II basis; full reconstruction with every
coefficient kept; Parseval; the best k-term approximation per chunk) and ``chunktopk`` (plain top-k per
chunk at ``bits=32``; decoded values on the quantizer's levels within ``s / L``; the per-chunk top-k
indices; error feedback conserving mass), both with their declared wire size, index widths and options
(hypothesis against sort-based references)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.compress import CompressContext, ResidualMemory, make_compressor
from lowband.compress.chunked import ChunkTopK, as_chunks, chunk_layout, decode_local, local_index_dtype
from lowband.compress.dct import DCTTopK, dct_basis, dct_basis_host
from lowband.compress.sparse import TopK, count_from_ratio
from lowband.errors import InvalidArgumentError

F64 = torch.float64
CTX = CompressContext("layer", step=2, rank=1, seed=3)
floats = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False, width=32)
#: values with ties (small integers): the tie-breaking by lowest index is exercised
ints = st.integers(-4, 4).map(float)
values = st.lists(st.one_of(floats, ints), max_size=70)


def _ref_topk(a: list[float], k: int) -> list[int]:
    """The ``k`` largest of ``a``, ties by lowest index, by a full sort (ascending indices)."""
    order = sorted(range(len(a)), key=lambda i: (-a[i], i))
    return sorted(order[:k])


def _ref_basis(c: int) -> torch.Tensor:
    """The DCT-II's definition, element by element in Python floats."""
    rows = []
    for k in range(c):
        f = math.sqrt((1 if k == 0 else 2) / c)
        rows.append([f * math.cos(math.pi * (2 * n + 1) * k / (2 * c)) for n in range(c)])
    return torch.tensor(rows, dtype=F64)


# ---------------------------------------------------------------------------------------------- dct-topk


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300))
def test_dct_basis_is_orthonormal_and_the_definition(c: int) -> None:
    b = dct_basis_host(c)
    assert b.shape == (c, c) and b.dtype == F64
    eye = torch.eye(c, dtype=F64)
    assert torch.allclose(b @ b.T, eye, atol=1e-12, rtol=0) and torch.allclose(
        b.T @ b, eye, atol=1e-12, rtol=0
    )
    if c <= 64:
        assert torch.allclose(b, _ref_basis(c), atol=1e-13, rtol=0)
    cached = dct_basis(c, torch.device("cpu"), torch.float32)
    assert cached.dtype == torch.float32 and cached is dct_basis(c, torch.device("cpu"), torch.float32)
    assert torch.equal(cached, b.float())


@settings(max_examples=80, deadline=None)
@given(values, st.sampled_from([1, 2, 7, 16, 64]))
def test_dct_with_every_coefficient_reconstructs(vals: list[float], chunk: int) -> None:
    x = torch.tensor(vals, dtype=F64)
    c = DCTTopK(chunk=chunk, topk=chunk)
    p = c.compress(x, CTX)
    out = c.decompress(p, CTX)
    assert out.dtype == F64 and out.shape == x.shape
    assert torch.allclose(out, x, atol=1e-12 * max(1.0, float(x.abs().max()) if x.numel() else 1.0), rtol=0)


def _coefficients(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int, int]:
    c, n = chunk_layout(x.numel(), chunk)
    return as_chunks(x, c, n) @ _ref_basis(c).T, c, n


@settings(max_examples=100, deadline=None)
@given(values, st.sampled_from([1, 3, 8, 16, 64]), st.integers(0, 20))
def test_dct_keeps_the_best_k_terms_per_chunk(vals: list[float], chunk: int, k: int) -> None:
    """The kept coefficients are each chunk's k largest (ties by lowest index); the decode is their
    inverse transform, whose energy is the input's minus the dropped coefficients' (Parseval), and no
    other k coefficients leave a smaller error."""
    x = torch.tensor(vals, dtype=F64)
    d = x.numel()
    c = DCTTopK(chunk=chunk, topk=k)
    p = c.compress(x, CTX)
    out = c.decompress(p, CTX)
    assert p.nbytes == c.nbytes(d, F64)
    if d == 0:
        assert p.nbytes == 0 and out.numel() == 0
        return
    coef, cl, n = _coefficients(x, chunk)
    kk = min(k, cl)
    idx, vals_ = p.data
    assert idx.dtype == torch.uint8 and vals_.dtype == F64 and p.nbytes == n * kk * 9
    got = decode_local(idx).view(n, kk)
    kept = torch.zeros_like(coef)
    scale = 1e-12 * max(1.0, float(x.abs().max()) * math.sqrt(cl))
    for j in range(n):
        mags = coef[j].abs()
        want = _ref_topk(mags.tolist(), kk)
        if got[j].tolist() != want:  # a near-tie the float rounding decided otherwise: equal magnitudes
            assert torch.allclose(mags[got[j]].sort().values, mags[want].sort().values, atol=scale, rtol=0)
        kept[j, got[j]] = coef[j, got[j]]
        dropped = torch.ones(cl, dtype=torch.bool)
        dropped[got[j]] = False
        if kk and dropped.any():  # every kept magnitude >= every dropped one: the best k-term choice
            assert float(mags[got[j]].min()) >= float(mags[dropped].max()) - scale
    assert torch.allclose(vals_.view(n, kk), kept.gather(1, got), atol=scale, rtol=0)
    want_out = (kept @ _ref_basis(cl)).reshape(-1)[:d]
    assert torch.allclose(out, want_out, atol=scale, rtol=0)
    # Parseval: the decode's energy is the input's minus the dropped coefficients'
    padded = (kept @ _ref_basis(cl)).reshape(-1)
    energy_dropped = float((coef**2).sum() - (kept**2).sum())
    assert math.isclose(float((padded**2).sum()), float((x**2).sum()) - energy_dropped, abs_tol=scale * 10)
    x_pad = as_chunks(x, cl, n).reshape(-1)
    assert math.isclose(float(((x_pad - padded) ** 2).sum()), energy_dropped, abs_tol=scale * 10)


@pytest.mark.parametrize(("chunk", "dtype"), [(64, torch.uint8), (256, torch.uint8), (257, torch.int16)])
def test_dct_index_width_ratio_and_dtypes(chunk: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    for xdtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(3 * chunk + 5, generator=g).to(xdtype)
        c = make_compressor(f"dct-topk:chunk={chunk},ratio=0.1")
        p = c.compress(x, CTX)
        k = count_from_ratio(0.1, chunk)
        assert p.data[0].dtype == dtype and p.data[1].dtype == xdtype and p.data[1].numel() == 4 * k
        assert p.nbytes == c.nbytes(x.numel(), xdtype) == 4 * k * (dtype.itemsize + x.element_size())  # type: ignore[attr-defined]
        out = c.decompress(p, CTX)
        assert out.dtype == xdtype and out.shape == x.shape
    assert repr(make_compressor("dct-topk")) == "DCTTopK(chunk=64, topk=4)"
    with pytest.raises(InvalidArgumentError, match="not both"):
        make_compressor("dct-topk:topk=3,ratio=0.1")


def test_dct_short_unit_is_one_chunk_of_its_length() -> None:
    x = torch.randn(10, dtype=F64, generator=torch.Generator().manual_seed(2))
    c = DCTTopK(chunk=64, topk=10)
    p = c.compress(x, CTX)
    assert p.data[1].numel() == 10 and torch.allclose(c.decompress(p, CTX), x, atol=1e-12, rtol=0)


# --------------------------------------------------------------------------------------------- chunktopk


def _levels(s: float, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The quantizer's levels ``s * (2j - L) / L``, evaluated in the arithmetic's dtype (float32, float64
    for float64 values) and rounded to ``dtype``."""
    work = F64 if dtype == F64 else torch.float32
    lv = (1 << bits) - 1
    return ((torch.arange(lv + 1, dtype=work) * 2 - lv) / lv * s).to(dtype).double()


@settings(max_examples=100, deadline=None)
@given(values, st.sampled_from([1, 3, 8, 16]), st.integers(0, 10), st.sampled_from([torch.float32, F64]))
def test_chunktopk_without_quantization_is_topk_per_chunk(
    vals: list[float], chunk: int, k: int, dtype: torch.dtype
) -> None:
    x = torch.tensor(vals, dtype=dtype)
    d = x.numel()
    c = ChunkTopK(chunk=chunk, k=k, bits=32)
    p = c.compress(x, CTX)
    out = c.decompress(p, CTX)
    assert p.nbytes == c.nbytes(d, dtype) and out.dtype == dtype and out.shape == x.shape
    if d == 0:
        return
    cl, n = chunk_layout(d, chunk)
    rows = as_chunks(x, cl, n)
    plain = TopK(k=k)
    want = torch.cat([plain.decompress(plain.compress(r.clone(), CTX), CTX) for r in rows])[:d]
    assert torch.equal(out, want)
    assert p.data[1].dtype == dtype and p.nbytes == n * min(k, cl) * (1 + x.element_size())


@settings(max_examples=150, deadline=None)
@given(values, st.sampled_from([1, 4, 9, 32]), st.integers(0, 12), st.sampled_from([2, 4, 8]),
       st.sampled_from([torch.float32, F64, torch.bfloat16]))  # fmt: skip
def test_chunktopk_quantizes_the_per_chunk_topk_to_levels(
    vals: list[float], chunk: int, k: int, bits: int, dtype: torch.dtype
) -> None:
    """The indices are each chunk's top k (ties by lowest index); each decoded value is one of the
    chunk's levels ``s * (2j - L) / L`` (s = its float32 scale, at least the largest kept magnitude),
    the nearest: within ``s / L`` of the value; nothing else is decoded."""
    x = torch.tensor(vals, dtype=F64).to(dtype)
    d = x.numel()
    c = ChunkTopK(chunk=chunk, k=k, bits=bits)
    p = c.compress(x, CTX)
    out = c.decompress(p, CTX)
    assert p.nbytes == c.nbytes(d, dtype) and out.dtype == dtype and out.shape == x.shape
    if d == 0:
        assert p.nbytes == 0
        return
    cl, n = chunk_layout(d, chunk)
    kk = min(k, cl)
    idx, scales, _ = p.data
    assert idx.dtype == torch.uint8 and scales.dtype == torch.float32 and scales.numel() == n
    assert p.nbytes == n * kk + 4 * n + -(-n * kk * bits // 8)
    rows = as_chunks(x.double(), cl, n)
    got = decode_local(idx).view(n, kk)
    dec = as_chunks(out.double(), cl, n)
    lv = (1 << bits) - 1
    for j in range(n):
        assert got[j].tolist() == _ref_topk(rows[j].abs().tolist(), kk)
        kept = rows[j, got[j]]
        s = float(scales[j])
        assert kk == 0 or s >= float(kept.abs().max())
        m = float(kept.abs().max()) if kk else 0.0
        assert s == m if dtype != F64 else m <= s <= m * (1 + 2**-23)  # float64: rounded up to a float32
        real = got[j] + j * cl < d  # padding may be kept; its decode is dropped
        on, kept = dec[j, got[j]][real], kept[real]
        levels = _levels(s, bits, dtype)
        assert all(bool((levels == v).any()) for v in on.tolist()), (on, levels)
        slack = 1e-6 * s if dtype != torch.bfloat16 else 2**-7 * s  # the decode rounded to the dtype
        assert bool(((kept - on).abs() <= s / lv + slack).all())
        rest = torch.ones(cl, dtype=torch.bool)
        rest[got[j]] = False
        assert bool((dec[j, rest] == 0).all())


def test_chunktopk_sixteen_bit_indices_round_trip() -> None:
    """Chunks of 65536: indices up to 65535 travel in 16 bits (an int16 holding them unsigned)."""
    x = torch.zeros(70_000)
    spikes = [3, 32_767, 32_768, 40_000, 65_535, 65_536, 69_999]
    x[spikes] = torch.arange(1, len(spikes) + 1, dtype=torch.float32)
    c = make_compressor("chunktopk:chunk=65536,k=4,bits=32")
    p = c.compress(x, CTX)
    assert p.data[0].dtype == torch.int16
    # chunk 0: the four largest (index 3 dropped); chunk 1 (4464 values): 0 and 4463, then ties 1, 2
    assert decode_local(p.data[0]).tolist() == [32_767, 32_768, 40_000, 65_535, 0, 1, 2, 4463]
    assert local_index_dtype(65_536) == torch.int16 and local_index_dtype(65_537) == torch.int32
    assert local_index_dtype(256) == torch.uint8 and local_index_dtype(257) == torch.int16
    out = c.decompress(p, CTX)
    want = x.clone()
    want[3] = 0
    assert torch.equal(out, want)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(0, 60), st.sampled_from(["chunktopk:chunk=8,k=2", "chunktopk:chunk=16,ratio=0.2,bits=4",
       "dct-topk:chunk=8,topk=2"]), st.integers(0, 999))  # fmt: skip
def test_error_feedback_conserves_mass(steps: int, d: int, spec: str, seed: int) -> None:
    """With the residual memory, each step's new memory plus its decode is the old memory plus the
    input; so what was sent plus the final memory is the sum of the inputs."""
    c = make_compressor(spec)
    mem = ResidualMemory()
    segs = (("a", d // 3), ("b", d - d // 3))
    g = torch.Generator().manual_seed(seed)
    e_old = torch.zeros(d, dtype=F64)
    total, sent = torch.zeros(d, dtype=F64), torch.zeros(d, dtype=F64)
    for s in range(steps):
        x = torch.randn(d, generator=g, dtype=F64)
        ctx = CompressContext("u", s)
        p = mem.compensate(segs, x)
        dec = c.decompress(c.compress(p, ctx), ctx)
        mem.update(segs, p, dec)
        e_new = torch.cat([mem.tensors["a"], mem.tensors["b"]])
        assert torch.allclose(e_new + dec, e_old + x, atol=1e-12, rtol=0)
        e_old = e_new
        total += x
        sent += dec
    assert torch.allclose(sent + e_old, total, atol=1e-11 * steps, rtol=0)


def test_chunktopk_options_and_defaults() -> None:
    c = make_compressor("chunktopk")
    assert repr(c) == "ChunkTopK(chunk=4096, ratio=0.02, bits=2)"
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(4))
    p = c.compress(x, CTX)
    k = count_from_ratio(0.02, 4096)  # 82 per chunk, 3 chunks
    assert [t.dtype for t in p.data] == [torch.int16, torch.float32, torch.uint8]
    assert p.nbytes == c.nbytes(10_000, torch.float32) == 3 * k * 2 + 3 * 4 + -(-3 * k * 2 // 8)  # type: ignore[attr-defined]
    for bad, said in (("bits=3", "bits"), ("k=2,ratio=0.1", "not both"), ("chunk=0", "chunk")):
        with pytest.raises(InvalidArgumentError, match=said):
            make_compressor(f"chunktopk:{bad}")
    zeros = make_compressor("chunktopk:chunk=4,k=2")
    p0 = zeros.compress(torch.zeros(9), CTX)
    assert torch.equal(zeros.decompress(p0, CTX), torch.zeros(9))
