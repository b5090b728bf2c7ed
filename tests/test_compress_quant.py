"""Quantizers (compress.quantize): sign, scaledsign, qsgd, terngrad, minmax8. Decode shape/dtype and
value sets, declared wire size against the formula, zeros and extreme magnitudes, determinism per
context and independence across ranks, unbiasedness within a bound derived from the variance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.compress import CompressContext, Payload, make_compressor
from lowband.errors import InvalidArgumentError

SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 33, 127, 513]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SPECS = [
    "sign",
    "scaledsign",
    "qsgd",
    "qsgd:levels=1,bucket=8",
    "qsgd:levels=3,bucket=0",
    "qsgd:levels=127,bucket=16",
    "terngrad",
    "terngrad:bucket=16",
    "terngrad:clip=2.5,bucket=7",
    "minmax8",
    "minmax8:bucket=16,stochastic=true",
    "minmax8:bucket=0",
]
STOCHASTIC = ["qsgd", "terngrad", "minmax8:stochastic=true"]


def ceil(a: int, b: int) -> int:
    return -(-a // b)


def wire_formula(spec: str, n: int) -> int:
    """Bytes on the wire, from the formats' definitions (not from the compressors)."""
    c = make_compressor(spec)
    rows = lambda b: (1 if n else 0) if b == 0 else ceil(n, b)  # noqa: E731
    if c.name == "sign":
        return ceil(n, 8)
    if c.name == "scaledsign":
        return 4 + ceil(n, 8)
    if c.name == "qsgd":
        s = c.options()["levels"]
        bits = 2 if s == 1 else 4 if s <= 7 else 8  # 2s + 1 values in 2, 4 or 8 bits
        return 4 * rows(c.options()["bucket"]) + ceil(n * bits, 8)
    if c.name == "terngrad":
        return 4 * rows(c.options()["bucket"]) + ceil(n, 4)
    assert c.name == "minmax8"
    return 8 * rows(c.options()["bucket"]) + n


def buckets_of(n: int, bucket: int) -> list[slice]:
    size = n if bucket == 0 else bucket
    return [slice(i, min(i + size, n)) for i in range(0, n, size)] if n else []


def check_decode(spec: str, x: torch.Tensor, d: torch.Tensor) -> None:
    """What each format's decode must look like for input ``x`` (float64 reasoning)."""
    c = make_compressor(spec)
    xd, dd = x.double(), d.double()
    tol = 1e-2 if x.dtype in (torch.float16, torch.bfloat16) else 1e-5
    if c.name == "sign":
        assert torch.equal(dd, torch.where(xd >= 0, 1.0, -1.0).double())
        return
    if c.name == "scaledsign":
        scale = xd.abs().mean() if x.numel() else 0.0
        want = torch.where(xd >= 0, 1.0, -1.0).double() * scale
        assert torch.allclose(dd, want, rtol=tol, atol=0)
        return
    if c.name != "minmax8":
        nonzero = dd != 0
        assert torch.all(torch.sign(dd[nonzero]) == torch.sign(xd[nonzero]))  # never flips a sign
        assert torch.all(dd[xd == 0] == 0)
    opts = c.options()
    for sl in buckets_of(x.numel(), opts["bucket"]):
        xb, db = xd[sl], dd[sl]
        if c.name == "qsgd":
            norm, s = float(xb.norm()), opts["levels"]
            assert torch.all(db.abs() <= norm * (1 + tol))
            if norm > 0:
                lv = db.abs() / norm * s
                assert torch.allclose(lv, lv.round(), atol=tol * s)  # multiples of norm / s
                assert torch.all((lv - xb.abs() / norm * s).abs() <= 1 + tol * s)  # a neighbouring level
        elif c.name == "terngrad":
            if opts["clip"] == 0:
                m = float(xb.abs().max())
                assert torch.all((db == 0) | ((db.abs() - m).abs() <= m * tol))
            else:
                vals = db[db != 0].abs()
                assert vals.numel() == 0 or float(vals.max() - vals.min()) <= float(vals.max()) * tol
        else:  # minmax8
            lo, hi = float(xb.min()), float(xb.max())
            step = (hi - lo) / 255
            slack = 1.0 if opts["stochastic"] else 0.5
            # the decode in x's dtype, from a float32 minimum and step on the wire
            eps = max(torch.finfo(x.dtype).eps, torch.finfo(torch.float32).eps)
            rounding = 2 * max(abs(lo), abs(hi)) * eps
            assert torch.all((db - xb).abs() <= step * slack * (1 + 1e-5) + rounding)


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(SPECS), st.data())
def test_decode_shape_dtype_values_and_wire_size(spec: str, data: st.DataObject) -> None:
    n = data.draw(st.one_of(st.sampled_from(SIZES), st.integers(0, 200)))
    dtype = data.draw(st.sampled_from(DTYPES))
    magnitude = data.draw(st.sampled_from([1.0, 1e-3, 1e3] if dtype == torch.float16 else [1.0, 1e-30, 1e30]))
    kind = data.draw(st.sampled_from(["normal", "zeros", "ties", "one-hot"]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    if kind == "zeros":
        x = torch.zeros(n)
    elif kind == "ties":
        x = torch.randint(-2, 3, (n,), generator=gen).double() / 2
    elif kind == "one-hot":
        x = torch.zeros(n)
        if n:
            x[n // 2] = -3.0
    else:
        x = torch.randn(n, generator=gen)
    x = (x.double() * magnitude).to(dtype)
    c = make_compressor(spec)
    ctx = CompressContext("unit", step=3, rank=1, seed=5)
    before = x.clone()
    payload = c.compress(x, ctx)
    assert torch.equal(x, before)  # never modifies its input
    assert payload.numel == n and payload.dtype == dtype
    assert payload.nbytes == wire_formula(spec, n) == c.wire_bytes(n)  # type: ignore[attr-defined]
    assert all(t.dim() == 1 and t.is_contiguous() for t in payload.data)
    d = c.decompress(payload, ctx)
    assert d.shape == (n,) and d.dtype == dtype
    assert bool(torch.isfinite(d).all())
    check_decode(spec, x, d)


def decodes(spec: str, x: torch.Tensor, count: int, rank: int = 0) -> torch.Tensor:
    c = make_compressor(spec)
    return torch.stack(
        [
            c.decompress(c.compress(x, CompressContext("u", k, rank, 11)), CompressContext("u", k, rank, 11))
            for k in range(count)
        ]
    )


def variance(spec: str, x: torch.Tensor) -> torch.Tensor:
    """Per element, the variance of one decode of ``x`` (float64), from the format's definition: a
    two-point distribution ``base`` or ``base + step`` with probability ``p`` has variance
    ``step**2 * p * (1 - p)``."""
    c = make_compressor(spec)
    opts = c.options()
    out = torch.zeros_like(x)
    for sl in buckets_of(x.numel(), opts["bucket"]):
        xb = x[sl]
        if c.name == "qsgd":
            s = opts["levels"]
            norm = float(torch.tensor(float(xb.norm()), dtype=torch.float32))
            a = xb.abs() / norm * s
            p, step = a - a.floor(), norm / s
        elif c.name == "terngrad":
            m = float(torch.tensor(float(xb.abs().max()), dtype=torch.float32))
            p, step = xb.abs() / m, m
        else:
            lo = float(torch.tensor(float(xb.min()), dtype=torch.float32))
            step = float(torch.tensor((float(xb.max()) - lo) / 255, dtype=torch.float32))
            v = (xb - lo) / step
            p = v - v.floor()
        out[sl] = step**2 * (p * (1 - p)).clamp(min=0)
    return out


def within_bound(samples: torch.Tensor, x: torch.Tensor, var: torch.Tensor, z: float = 5.0) -> bool:
    """The mean of ``K`` independent decodes is within ``z`` standard errors (``sqrt(var / K)``) of
    ``x`` for every element; a zero variance leaves only the slack of float32 scales on the wire."""
    k = samples.shape[0]
    err = (samples.mean(0) - x).abs()
    return bool(torch.all(err <= z * (var / k).sqrt() + 1e-6 * x.abs().max()))


@pytest.mark.parametrize("spec", [*STOCHASTIC, "qsgd:levels=2,bucket=16", "terngrad:bucket=16"])
def test_unbiased_within_statistical_bounds(spec: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(48, generator=gen).double()  # float32 values: the scales on the wire hold them exactly
    x[5] = 0.0
    samples = decodes(spec, x, 3000)
    var = variance(spec, x)
    assert float(var.max()) > 0  # the rounding is random: the bound is not vacuous
    assert within_bound(samples, x, var)
    # the same check rejects a biased decoder: a shift of a fifth of the largest per-element spread
    shifted = samples + (var.max().sqrt() / 5)
    assert not within_bound(shifted, x, var)


def test_deterministic_minmax8_is_biased_and_the_bound_sees_it() -> None:
    x = torch.linspace(-1, 1, 40, dtype=torch.float64) + 0.0013
    var = variance("minmax8:stochastic=true", x)
    assert within_bound(decodes("minmax8:stochastic=true", x, 3000), x, var)
    assert not within_bound(decodes("minmax8", x, 50), x, var)  # nearest-level rounding is biased


@pytest.mark.parametrize("spec", SPECS)
def test_same_context_same_payload_and_ranks_round_independently(spec: str) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    c = make_compressor(spec)

    def payload(rank: int, step: int = 4) -> Payload:
        return c.compress(x, CompressContext("block.0", step, rank, 9))

    def same(a: Payload, b: Payload) -> bool:
        return all(torch.equal(s, t) for s, t in zip(a.data, b.data, strict=True))

    assert same(payload(0), payload(0))
    stochastic = c.name in ("qsgd", "terngrad") or c.options().get("stochastic", False)
    assert same(payload(0), payload(1)) != stochastic  # rank-independent exactly when deterministic
    assert same(payload(0, 4), payload(0, 5)) != stochastic


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_a_clear_error(spec: str, bad: float) -> None:
    x = torch.tensor([0.1, 0.2, bad])
    name = make_compressor(spec).name
    with pytest.raises(InvalidArgumentError, match=rf"{name}.*non-finite.*element 2 of 3"):
        make_compressor(spec).compress(x, CompressContext("u", 0))


def test_formats_in_detail() -> None:
    ctx = CompressContext("u", 0)
    x = torch.tensor([0.5, -0.0, 0.0, -2.0, 1.5])
    sign = make_compressor("sign")
    p = sign.compress(x, ctx)
    assert p.data[0].tolist() == [0b11101_000] and sign.decompress(p, ctx).tolist() == [1, 1, 1, -1, 1]
    ss = make_compressor("scaledsign")
    p = ss.compress(x, ctx)
    assert p.data[0].dtype == torch.float32 and p.data[0].tolist() == pytest.approx([0.8])
    assert ss.decompress(p, ctx).tolist() == pytest.approx([0.8, 0.8, 0.8, -0.8, 0.8])
    # qsgd, levels 1 in 2 bits: sign * level + 1; one norm per bucket of 2
    q = make_compressor("qsgd:levels=1,bucket=2")
    p = q.compress(torch.tensor([3.0, -4.0, 0.0]), ctx)
    assert p.data[0].tolist() == [5.0, 0.0]
    codes = [(p.data[1][0].item() >> s) & 3 for s in (6, 4, 2)]
    assert codes[2] == 1 and codes[0] in (1, 2) and codes[1] in (0, 1)  # 0 is level 0, signs kept
    # terngrad: t + 1 in 2 bits; an element at the maximum is always kept
    t = make_compressor("terngrad")
    d = t.decompress(t.compress(torch.tensor([-2.0, 0.0, 1.0]), ctx), ctx)
    assert d[0] == -2.0 and d[1] == 0.0 and d[2] in (0.0, 2.0)
    m = make_compressor("minmax8:bucket=0")
    p = m.compress(torch.tensor([0.0, 127.5, 255.0, 0.5, 1.5, 200.2]), ctx)
    assert p.data[0].tolist() == [0.0] and p.data[1].tolist() == [1.0]
    assert p.data[2].tolist() == [0, 128, 255, 0, 2, 200]  # nearest level, ties to even
    c = make_compressor("minmax8")
    assert c.decompress(c.compress(torch.full((5,), 3.25), ctx), ctx).tolist() == [3.25] * 5


def test_option_checks() -> None:
    assert make_compressor("qsgd:levels=16;bucket=128").options() == {"levels": 16, "bucket": 128}
    for spec, match in [
        ("qsgd:levels=0", "levels must be an int in"),
        ("qsgd:levels=128", "levels must be an int in"),
        ("qsgd:bucket=-1", "bucket must be an int >= 0"),
        ("qsgd:levels=2.5", r"levels must be an int in \[1, 127\], got 2.5"),
        ("terngrad:clip=-1", "clip must be a number >= 0, got -1"),
        ("minmax8:stochastic=3", "stochastic must be true or false, got 3"),
        ("sign:levels=3", "unknown option"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            make_compressor(spec)
    with pytest.raises(InvalidArgumentError, match="2 tensors expected"):
        make_compressor("qsgd").decompress(
            Payload((torch.zeros(1),), 3, torch.float32), CompressContext("u", 0)
        )
    ss, ctx = make_compressor("scaledsign"), CompressContext("u", 0)
    p = ss.compress(torch.zeros(0), ctx)
    assert p.data[0].tolist() == [0.0] and p.data[1].numel() == 0 and ss.decompress(p, ctx).numel() == 0
