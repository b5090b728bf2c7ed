"""Gradient compression: pure compressors, error-feedback memories, and transports that combine the
ranks' payloads as reducers of the gradient stage (see docs/ARCHITECTURE.md, "compress/")."""

from lowband.compress import casts as _casts  # noqa: F401  (registers identity, fp16, bf16)
from lowband.compress import chunked as _chunked  # noqa: F401  (chunktopk)
from lowband.compress import dct as _dct  # noqa: F401  (dct-topk)
from lowband.compress import quantize as _quantize  # noqa: F401  (sign, scaledsign, qsgd, terngrad, minmax8)
from lowband.compress import sparse as _sparse  # noqa: F401  (registers topk, randomk)
from lowband.compress import threshold as _threshold  # noqa: F401  (onebit, twobit)
from lowband.compress.allgather import AllgatherCompressedReducer
from lowband.compress.base import (
    COMPRESSORS,
    CompressContext,
    Compressor,
    Payload,
    make_compressor,
    parse_spec,
    register_compressor,
)
from lowband.compress.dgc import DGCMemory
from lowband.compress.hooks import ddp_hook
from lowband.compress.memory import MEMORIES, Memory, NoMemory, ResidualMemory, reshard_memories
from lowband.compress.optimizer import CompressedOptimizer
from lowband.compress.powersgd import PowerSGDReducer
from lowband.compress.ps import PSCompressedReducer
from lowband.compress.reducer import TRANSPORTS, AllreduceCompressedReducer, CompressedReducer, make_reducer
from lowband.compress.specs import build_reducer
from lowband.compress.twostage import TwoStageCompressedReducer, reshard_server_memories

__all__ = [
    "COMPRESSORS",
    "MEMORIES",
    "TRANSPORTS",
    "AllgatherCompressedReducer",
    "AllreduceCompressedReducer",
    "CompressContext",
    "CompressedOptimizer",
    "CompressedReducer",
    "Compressor",
    "DGCMemory",
    "Memory",
    "NoMemory",
    "PSCompressedReducer",
    "Payload",
    "PowerSGDReducer",
    "ResidualMemory",
    "TwoStageCompressedReducer",
    "build_reducer",
    "ddp_hook",
    "make_compressor",
    "make_reducer",
    "parse_spec",
    "register_compressor",
    "reshard_memories",
    "reshard_server_memories",
]  # fmt: skip
