"""torch's PowerSGD hook on CPU buckets, on a machine that has CUDA.

torch's ``powerSGD_hook`` (torch 2.11-2.13, its ``decompress`` step) calls
``torch.cuda.synchronize(device)`` whenever CUDA is available, ``device`` being the bucket's. A model
trained on the CPU of a machine with a GPU then fails at the first compressed step with ``ValueError:
Expected a cuda device, but got: cpu`` (seen on an H200 machine by ``tests/test_cuda_lightning.py``).
:func:`tolerate_cpu_buckets` gives the hook's module a view of torch whose ``cuda.synchronize`` returns
at once for a device that is not a GPU, which is what synchronising a CPU bucket means; every other
name is torch's own.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd


class _Cuda(types.ModuleType):
    """``torch.cuda`` but for :meth:`synchronize` on a non-CUDA device."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        if isinstance(device, (torch.device, str)) and torch.device(device).type != "cuda":
            return
        torch.cuda.synchronize(device)


class _Torch(types.ModuleType):
    """``torch`` with :class:`_Cuda` as its ``cuda``."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _Cuda("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def tolerate_cpu_buckets() -> None:
    """Idempotent: torch's PowerSGD hook module sees :class:`_Torch` from now on."""
    if not isinstance(getattr(psgd, "torch", None), _Torch):
        setattr(psgd, "torch", _Torch())  # noqa: B010 (the hook module's global name for torch)
