"""MXNet's 1-bit / 2-bit threshold quantizers (compress.threshold, ``threshold_mode="absolute"``) against
an independent per-element reference written from MXNet's kvstore source (gradient_compression-inl.h:
quantize_1bit, dequantize_1bit, quantize_2bit, dequantize_2bit): codes, bit layout, decode and the
residual sequence (lowband's ResidualMemory beside the quantizer), ties, sizes, the batch scale and the
argument checks. The default relative mode: tests/test_compress_threshold_relative.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.compress import CompressContext, Payload, ResidualMemory, make_compressor
from lowband.compress.threshold import OneBit, TwoBit
from lowband.errors import InvalidArgumentError

CTX = CompressContext("layer.weight", step=0)
ABS = "absolute"  # MXNet's units (the default is relative)
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 33]


def mxnet_step(
    kind: str, grad: np.ndarray, residual: np.ndarray, threshold: float
) -> tuple[bytes, np.ndarray]:
    """One MXNet quantize call, element by element in float32: returns the bytes of MXNet's compressed
    float32 array (``ceil(n/32)`` or ``ceil(n/16)`` floats) and the new residual."""
    f32 = np.float32
    t = f32(threshold)
    r = residual.astype(np.float32).copy()
    n = grad.size
    per_float = 32 if kind == "1bit" else 16
    out = bytearray(4 * -(-n // per_float))
    for i in range(n):
        r[i] = f32(r[i] + f32(grad[i]))
        if kind == "1bit":
            if r[i] > t:
                out[i >> 3] |= (0x80, 0x40, 0x20, 0x10, 0x08, 0x04, 0x02, 0x01)[i & 7]
                r[i] = f32(r[i] - f32(1))
            else:
                r[i] = f32(r[i] + f32(1))
        else:
            if r[i] >= t:
                out[i >> 2] |= (0xC0, 0x30, 0x0C, 0x03)[i & 3]
                r[i] = f32(r[i] - t)
            elif r[i] <= -t:
                out[i >> 2] |= (0x80, 0x20, 0x08, 0x02)[i & 3]
                r[i] = f32(r[i] - f32(-t))
    return bytes(out), r


def mxnet_dequantize(kind: str, compressed: bytes, n: int, threshold: float) -> np.ndarray:
    t = np.float32(threshold)
    out = np.zeros(n, dtype=np.float32)
    for i in range(n):
        if kind == "1bit":
            mask = (0x80, 0x40, 0x20, 0x10, 0x08, 0x04, 0x02, 0x01)[i & 7]
            out[i] = 1 if compressed[i >> 3] & mask == mask else -1
        else:
            mask, negmask = (0xC0, 0x30, 0x0C, 0x03)[i & 3], (0x80, 0x20, 0x08, 0x02)[i & 3]
            masked = compressed[i >> 2] & mask
            out[i] = t if masked == mask else (-t if masked == negmask else 0)
    return out


def run_sequence(
    kind: str, threshold: float, grads: list[np.ndarray], scale: float = 1.0, split: int | None = None
) -> None:
    """lowband (compensate + compress + decompress + update) against MXNet's kernel, step by step; with
    ``split`` the unit holds two parameters ("w" and "b"), whose memories are kept by name."""
    n = grads[0].size
    comp = make_compressor(
        "onebit" if kind == "1bit" else "twobit", threshold=threshold, scale=scale, threshold_mode="absolute"
    )
    mem = ResidualMemory()
    segs: tuple[tuple[str, int], ...] = (("w", n),) if split is None else (("w", split), ("b", n - split))
    mx_residual = np.zeros(n, dtype=np.float32)
    for step, g in enumerate(grads):
        ctx = CompressContext("w", step)
        x = torch.from_numpy(g.copy())
        p = mem.compensate(segs, x)
        payload = comp.compress(p, ctx)
        decoded = comp.decompress(payload, ctx)
        mem.update(segs, p, decoded)
        assert torch.equal(x, torch.from_numpy(g))  # the input is never modified
        mx_bytes, mx_residual = mxnet_step(kind, g * np.float32(scale), mx_residual, threshold)
        nbytes = -(-n // (8 if kind == "1bit" else 4))
        assert payload.nbytes == nbytes == comp.wire_bytes(n) and len(payload.data) == 1  # type: ignore[attr-defined]
        got = bytes(payload.data[0].tolist())
        assert got == mx_bytes[:nbytes], (step, got.hex(), mx_bytes.hex())
        assert not any(mx_bytes[nbytes:])  # MXNet's float32 container pads with zero bytes only
        mx_decoded = mxnet_dequantize(kind, mx_bytes, n, threshold)
        assert torch.equal(decoded * scale, torch.from_numpy(mx_decoded)), step
        memory = torch.cat([mem.tensors[name] for name, _ in segs])
        assert torch.equal(memory * scale, torch.from_numpy(mx_residual)), step


_values = st.one_of(
    st.floats(-2, 2, width=32),
    st.sampled_from([0.0, -0.0, 0.5, -0.5, 0.25, -0.25, 1.0, -1.0, 0.3, 0.2]),  # thresholds and ties
)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["1bit", "2bit"]), st.data())
def test_codes_layout_residuals_equal_mxnet(kind: str, data: st.DataObject) -> None:
    n = data.draw(st.one_of(st.sampled_from(SIZES), st.integers(0, 70)))
    thresholds = [-0.5, 0.0, 0.25, 0.5] if kind == "1bit" else [0.25, 0.5, 1.0]
    threshold = data.draw(st.sampled_from(thresholds))
    steps = data.draw(st.integers(1, 4))
    grads = [
        np.array(data.draw(st.lists(_values, min_size=n, max_size=n)), dtype=np.float32) for _ in range(steps)
    ]
    run_sequence(kind, threshold, grads)


@pytest.mark.parametrize("kind", ["1bit", "2bit"])
@pytest.mark.parametrize("n", SIZES)
def test_sizes_and_zeros(kind: str, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    grads = [np.zeros(n, dtype=np.float32)] + [
        (torch.rand(n, generator=gen) * 1.2 - 0.6).numpy() for _ in range(5)
    ]
    run_sequence(kind, 0.5, grads)
    run_sequence(kind, 0.5, grads, split=n // 3)  # two parameters in the unit, memories by name


def test_ties_exactly_at_the_threshold() -> None:
    t = 0.5
    up, down = (
        float(np.nextafter(np.float32(t), np.float32(1))),
        float(np.nextafter(np.float32(-t), np.float32(-1))),
    )
    below = float(np.nextafter(np.float32(t), np.float32(0)))
    g = torch.tensor([t, -t, 0.0, -0.0, up, down, below])
    two = TwoBit(threshold=t, threshold_mode=ABS)
    # 2-bit: >= t and <= -t are sent; 0 and values inside stay 00
    assert two.decompress(two.compress(g, CTX), CTX).tolist() == [t, -t, 0, 0, t, -t, 0]
    one = OneBit(threshold=t, threshold_mode=ABS)
    # 1-bit: strictly above t is 1 (+1), anything else 0 (-1), ties included
    assert one.decompress(one.compress(g, CTX), CTX).tolist() == [-1, -1, -1, -1, 1, -1, -1]
    assert OneBit(threshold=0.0, threshold_mode=ABS).decompress(OneBit(threshold=0.0, threshold_mode=ABS).compress(g, CTX), CTX).tolist() == [
        1, -1, -1, -1, 1, -1, 1,
    ]  # fmt: skip
    run_sequence("1bit", t, [g.numpy(), g.numpy()])
    run_sequence("2bit", t, [g.numpy(), (g * 0.5).numpy()])


def test_mxnet_residual_walkthrough() -> None:
    """MXNet's own residual test for 2-bit (push 0.4, then t - 0.3, 0.2, t - 0.3 with t = 0.5): nothing,
    then +t, nothing, then +t, and the residual back to 0; and its 1-bit one (push 2, 0, -2)."""
    two, mem, segs = TwoBit(threshold=0.5, threshold_mode=ABS), ResidualMemory(), (("w", 3),)
    sent = []
    for v in (0.4, 0.5 - 0.3, 0.2, 0.5 - 0.3):
        p = mem.compensate(segs, torch.full((3,), v))
        d = two.decompress(two.compress(p, CTX), CTX)
        mem.update(segs, p, d)
        sent.append(float(d[0]))
    assert sent == [0.0, 0.5, 0.0, 0.5]
    assert torch.allclose(mem.tensors["w"], torch.zeros(3), atol=1e-7)
    one, mem = OneBit(threshold=0.5, threshold_mode=ABS), ResidualMemory()
    sent = []
    for v in (2.0, 0.0, -2.0):
        p = mem.compensate(segs, torch.full((3,), v))
        d = one.decompress(one.compress(p, CTX), CTX)
        mem.update(segs, p, d)
        sent.append(float(d[0]))
    assert sent == [1.0, 1.0, -1.0]  # residual 1 after the first push, 0 after the second, -1 after the third
    assert mem.tensors["w"].tolist() == [-1.0, -1.0, -1.0]


def test_twobit_decodes_every_code_as_mxnet() -> None:
    """01 is never written but decodes to 0, as in dequantize_2bit (neither mask matches); zeros are +0."""
    two = TwoBit(threshold=0.5, threshold_mode=ABS)
    payload = Payload((torch.tensor([0b01_11_10_00], dtype=torch.uint8),), 4, torch.float32)
    d = two.decompress(payload, CTX)
    assert d.tolist() == [0.0, 0.5, -0.5, 0.0]
    assert torch.equal(d, torch.from_numpy(mxnet_dequantize("2bit", bytes([0b01111000, 0, 0, 0]), 4, 0.5)))
    assert not bool(torch.signbit(d[d == 0]).any())


@pytest.mark.parametrize("kind", ["1bit", "2bit"])
def test_batch_scale_power_of_two_is_mxnet_on_the_summed_gradient(kind: str) -> None:
    """scale = B quantizes B * p: with B a power of two, B * memory is exactly MXNet's residual on the
    batch-summed gradient B * g, and B * decode is MXNet's decode."""
    gen = torch.Generator().manual_seed(7)
    grads = [(torch.randn(37, generator=gen) * 0.02).numpy() for _ in range(6)]
    run_sequence(kind, 0.5, grads, scale=32.0)


def test_batch_scale_decodes_in_averaged_units() -> None:
    x = torch.tensor([0.2, -0.2, 0.01])
    two = TwoBit(threshold=0.5, scale=3.0, threshold_mode=ABS)
    assert torch.allclose(two.decompress(two.compress(x, CTX), CTX), torch.tensor([0.5, -0.5, 0.0]) / 3)
    one = OneBit(threshold=0.5, scale=4.0, threshold_mode=ABS)
    assert one.decompress(one.compress(x, CTX), CTX).tolist() == [0.25, -0.25, -0.25]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["onebit", "twobit"])
def test_dtypes(name: str, dtype: torch.dtype) -> None:
    x = torch.tensor([0.7, -0.7, 0.1, 0.5, -0.5], dtype=dtype)
    c = make_compressor(name, threshold_mode=ABS)
    d = c.decompress(c.compress(x, CTX), CTX)
    assert d.dtype == dtype and d.shape == x.shape
    want = [1, -1, -1, -1, -1] if name == "onebit" else [0.5, -0.5, 0, 0.5, -0.5]
    assert d.tolist() == want


@pytest.mark.parametrize("name", ["onebit", "twobit"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_a_clear_error(name: str, bad: float) -> None:
    x = torch.tensor([0.1, bad, 0.3])
    with pytest.raises(InvalidArgumentError, match=rf"{name}.*non-finite.*element 1 of 3"):
        make_compressor(name).compress(x, CTX)


def test_option_checks_and_specs() -> None:
    c = make_compressor("twobit:threshold=0.25,scale=64,threshold_mode=absolute")
    assert isinstance(c, TwoBit) and c.options() == {"threshold": 0.25, "scale": 64.0, "threshold_mode": ABS}
    assert make_compressor("onebit").options() == {
        "threshold": 0.5,
        "scale": 1.0,
        "threshold_mode": "relative",
    }
    assert make_compressor("onebit:threshold=-0.5").options()["threshold"] == -0.5  # allowed, as in MXNet
    assert OneBit(threshold=0.1).threshold == float(np.float32(0.1))  # a C float, as MXNet's
    with pytest.raises(InvalidArgumentError, match=r"threshold must be a number > 0, got 0\.0"):
        make_compressor("twobit", threshold=0.0)  # MXNet: CHECK_GT(threshold, 0) for 2bit
    with pytest.raises(InvalidArgumentError, match="scale must be a number > 0, got 0"):
        make_compressor("onebit", scale=0)
    with pytest.raises(InvalidArgumentError, match="threshold must be a number, got nan"):
        make_compressor("onebit", threshold=float("nan"))
    with pytest.raises(InvalidArgumentError, match="threshold must be a number, got 'high'"):
        make_compressor("onebit:threshold=high")
    with pytest.raises(InvalidArgumentError, match="unknown option"):
        make_compressor("twobit:levels=3")
    with pytest.raises(InvalidArgumentError, match="flat"):
        OneBit().compress(torch.zeros(2, 2), CTX)
    with pytest.raises(InvalidArgumentError, match="a payload of 1 tensor"):
        payload = TwoBit(threshold_mode=ABS).compress(torch.zeros(5), CTX)
        TwoBit(threshold_mode=ABS).decompress(
            type(payload)((*payload.data, payload.data[0]), 5, torch.float32), CTX
        )
