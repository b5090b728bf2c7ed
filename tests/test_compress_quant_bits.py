"""Bit packing (compress.bits): round trips, the MSB-first layout against a per-element reference, sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.compress.bits import WIDTHS, pack_bits, packed_size, unpack_bits, width_for
from lowband.errors import InvalidArgumentError


def reference_pack(codes: list[int], bits: int) -> bytes:
    """Per element: code i goes to byte i // (8 // bits), ``bits`` bits below the previous code's."""
    per = 8 // bits
    out = bytearray(-(-len(codes) * bits // 8))
    for i, c in enumerate(codes):
        out[i // per] |= c << (8 - bits * (i % per + 1))
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(WIDTHS), st.data())
def test_round_trip_and_layout(bits: int, data: st.DataObject) -> None:
    n = data.draw(st.one_of(st.sampled_from([0, 1, 7, 8, 9, 15, 16, 17, 33]), st.integers(0, 300)))
    codes = data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=n, max_size=n))
    dtype = data.draw(
        st.sampled_from(
            [torch.uint8, torch.int16, torch.int64, torch.bool] if bits == 1 else [torch.uint8, torch.int32]
        )
    )
    t = torch.tensor(codes, dtype=torch.int64).to(dtype)
    packed = pack_bits(t, bits)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert packed.numel() == packed_size(n, bits) == -(-n * bits // 8)
    assert bytes(packed.tolist()) == reference_pack(codes, bits)
    back = unpack_bits(packed, n, bits)
    assert back.dtype == torch.uint8 and back.tolist() == codes


def test_layout_examples() -> None:
    # 2-bit: the first code in the top bits, masks 0xc0, 0x30, 0x0c, 0x03 (MXNet's layout)
    assert pack_bits(torch.tensor([3, 2, 0, 1, 3]), 2).tolist() == [0b11_10_00_01, 0b11_000000]
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1]), 1).tolist() == [0x81, 0x80]
    assert pack_bits(torch.tensor([0xA, 0x5, 0xF]), 4).tolist() == [0xA5, 0xF0]
    assert pack_bits(torch.tensor([7, 200]), 8).tolist() == [7, 200]
    assert unpack_bits(torch.tensor([0xE1], dtype=torch.uint8), 3, 2).tolist() == [3, 2, 0]


def test_empty_and_no_aliasing() -> None:
    assert pack_bits(torch.zeros(0, dtype=torch.uint8), 1).numel() == 0
    assert unpack_bits(torch.zeros(0, dtype=torch.uint8), 0, 4).numel() == 0
    codes = torch.tensor([1, 2, 3], dtype=torch.uint8)
    packed = pack_bits(codes, 8)
    packed[0] = 9
    assert codes.tolist() == [1, 2, 3]  # 8-bit packing copies


def test_non_contiguous_codes() -> None:
    codes = torch.tensor([[1, 0], [0, 1], [1, 1]]).t()  # [[1, 0, 1], [0, 1, 1]], read in logical order
    assert pack_bits(codes, 1).tolist() == [0b101011_00]
    assert unpack_bits(pack_bits(codes, 1), 6, 1).tolist() == codes.reshape(-1).tolist()


def test_sizes_and_widths() -> None:
    assert [packed_size(n, 1) for n in (0, 1, 8, 9)] == [0, 1, 1, 2]
    assert [packed_size(n, 2) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert [packed_size(n, 4) for n in (1, 2, 3)] == [1, 1, 2]
    assert [width_for(v) for v in (2, 3, 4, 5, 16, 17, 256)] == [1, 2, 2, 4, 4, 8, 8]
    with pytest.raises(InvalidArgumentError, match="8 bits"):
        width_for(257)


def test_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="bits must be one of"):
        pack_bits(torch.zeros(3, dtype=torch.uint8), 3)
    with pytest.raises(InvalidArgumentError, match="integers"):
        pack_bits(torch.zeros(3), 1)
    with pytest.raises(InvalidArgumentError, match="take 2 bytes, got 1"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 9, 1)
    with pytest.raises(InvalidArgumentError, match="1-D uint8"):
        unpack_bits(torch.zeros(2, dtype=torch.int8), 9, 1)
    with pytest.raises(InvalidArgumentError, match="numel"):
        packed_size(-1, 1)
