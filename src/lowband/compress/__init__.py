"""Gradient compression: pure compressors, error-feedback memories, and transports that combine the
ranks' payloads as reducers of the gradient stage (see docs/ARCHITECTURE.md, "compress/")."""

from lowband.compress import casts as _casts  # noqa: F401  (registers identity, fp16, bf16)
from lowband.compress.base import (
    COMPRESSORS,
    CompressContext,
    Compressor,
    Payload,
    make_compressor,
    parse_spec,
    register_compressor,
)
from lowband.compress.memory import Memory, NoMemory, ResidualMemory, reshard_memories
from lowband.compress.reducer import TRANSPORTS, AllreduceCompressedReducer, CompressedReducer, make_reducer

__all__ = [
    "COMPRESSORS",
    "TRANSPORTS",
    "AllreduceCompressedReducer",
    "CompressContext",
    "CompressedReducer",
    "Compressor",
    "Memory",
    "NoMemory",
    "Payload",
    "ResidualMemory",
    "make_compressor",
    "make_reducer",
    "parse_spec",
    "register_compressor",
    "reshard_memories",
]  # fmt: skip
