"""The threshold quantizers' relative mode (``threshold_mode="relative"``, the default): thresholds and
levels in units of each tensor's mean magnitude ``mean|x|``, which travels as one float32 ahead of the
codes. Against a per-element reference from the unit on the wire, the unit against ``mean|x|``, scale
invariance, sizes, error feedback on gradients of PyTorch's (mean-reduced) scale, and the options."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.compress import CompressContext, ResidualMemory, make_compressor
from lowband.compress.bits import packed_size
from lowband.errors import InvalidArgumentError

CTX = CompressContext("layer.weight", step=0)


def reference(kind: str, x: np.ndarray, unit: np.float32, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Per element, in float32: the codes and the decode of the relative mode, given the unit."""
    level = np.float32(unit * np.float32(threshold))
    codes, out = np.zeros(x.size, dtype=np.uint8), np.zeros(x.size, dtype=np.float32)
    for i, v in enumerate(x.astype(np.float32)):
        if kind == "onebit":
            codes[i] = 1 if v > level else 0
            out[i] = unit if codes[i] else -unit
        elif v >= level:
            codes[i], out[i] = 0b11, level
        elif v <= -level:
            codes[i], out[i] = 0b10, -level
    return codes, out


def unpacked(packed: torch.Tensor, n: int, bits: int) -> np.ndarray:
    per = 8 // bits
    b = packed.numpy()
    return np.array(
        [(b[i // per] >> (8 - bits * (i % per + 1))) & (2**bits - 1) for i in range(n)], dtype=np.uint8
    )


_values = st.one_of(st.floats(-0.0625, 0.0625, width=32), st.sampled_from([0.0, -0.0, 2.0**-10, -(2.0**-10)]))


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(["onebit", "twobit"]), st.sampled_from([0.25, 0.5, 1.0]), st.data())
def test_codes_and_decode_follow_the_unit_on_the_wire(
    kind: str, threshold: float, data: st.DataObject
) -> None:
    n = data.draw(st.integers(0, 70))
    x = np.array(data.draw(st.lists(_values, min_size=n, max_size=n)), dtype=np.float32)
    c = make_compressor(kind, threshold=threshold)
    payload = c.compress(torch.from_numpy(x.copy()), CTX)
    assert len(payload.data) == 2 and payload.data[0].dtype == torch.float32 and payload.data[0].numel() == 1
    unit = np.float32(payload.data[0].item())
    want = np.float32(np.abs(x.astype(np.float64)).mean()) if n else np.float32(0)
    assert unit == pytest.approx(want, rel=1e-6, abs=0)  # mean |x|, in float32
    bits = 1 if kind == "onebit" else 2
    codes, decoded = reference(kind, x, unit, threshold)
    assert np.array_equal(unpacked(payload.data[1], n, bits), codes)
    assert torch.equal(c.decompress(payload, CTX), torch.from_numpy(decoded))
    assert payload.nbytes == 4 + packed_size(n, bits) == c.wire_bytes(n)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["onebit", "twobit"])
def test_scale_invariant(kind: str) -> None:
    """c * x decodes to c * decode(x) for a power of two c: only the gradient's shape matters."""
    x = torch.randn(257, generator=torch.Generator().manual_seed(3)) * 1e-3
    c = make_compressor(kind)
    base = c.decompress(c.compress(x, CTX), CTX)
    for k in (2.0**-20, 2.0**-3, 1.0, 2.0**10):
        assert torch.equal(c.decompress(c.compress(x * k, CTX), CTX), base * k)


@pytest.mark.parametrize("kind", ["onebit", "twobit"])
def test_error_feedback_tracks_small_mean_reduced_gradients(kind: str) -> None:
    """With error feedback, what was sent over 200 steps is the sum of the gradients but the last
    residual: on gradients of PyTorch's averaged scale (1e-3) the residual is a few percent of that sum
    in relative mode, and as large as the sum itself with MXNet's absolute levels (+-1 for 1-bit;
    nothing below 0.5 for 2-bit)."""
    segs = (("w", 300),)

    def residual(spec: str) -> float:
        gen = torch.Generator().manual_seed(11)
        bias = torch.randn(300, generator=gen) * 1e-3  # a persistent direction, as a gradient has
        c, mem, total = make_compressor(spec), ResidualMemory(), torch.zeros(300)
        for step in range(200):
            g = bias + torch.randn(300, generator=gen) * 1e-3
            total += g
            p = mem.compensate(segs, g)
            mem.update(segs, p, c.decompress(c.compress(p, CompressContext("w", step)), CTX))
        return float(mem.tensors["w"].norm() / total.norm())

    assert residual(kind) < 0.15
    assert residual(f"{kind}:threshold_mode=absolute") > 0.5


@pytest.mark.parametrize("kind", ["onebit", "twobit"])
def test_zeros_and_dtypes(kind: str) -> None:
    c = make_compressor(kind)
    z = c.decompress(c.compress(torch.zeros(9), CTX), CTX)
    assert torch.equal(z, torch.zeros(9))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = torch.tensor([0.7, -0.7, 0.1, 0.5, -0.5], dtype=dtype)
        d = c.decompress(c.compress(x, CTX), CTX)
        assert d.dtype == dtype and d.shape == x.shape
        unit = float(x.double().abs().mean())  # about 0.5: decisions at 0.25
        level = unit if kind == "onebit" else 0.5 * unit
        want = [1, -1, -1, 1, -1] if kind == "onebit" else [1, -1, 0, 1, -1]
        assert d.double().tolist() == pytest.approx([level * w for w in want], rel=1e-2)


def test_options() -> None:
    assert make_compressor("onebit").options() == {
        "threshold": 0.5,
        "scale": 1.0,
        "threshold_mode": "relative",
    }
    assert make_compressor("twobit:threshold_mode=absolute;scale=32").options() == {
        "threshold": 0.5, "scale": 32.0, "threshold_mode": "absolute",
    }  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="threshold_mode"):
        make_compressor("onebit:threshold_mode=batch")
    with pytest.raises(InvalidArgumentError, match="threshold_mode=absolute"):
        make_compressor("onebit:scale=32")  # MXNet's batch scale needs MXNet's units
    with pytest.raises(InvalidArgumentError, match="2 tensor"):
        c = make_compressor("onebit")
        payload = c.compress(torch.zeros(5), CTX)
        c.decompress(type(payload)(payload.data[1:], 5, torch.float32), CTX)
