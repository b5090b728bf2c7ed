"""Which device a rank computes on, decided in one place.

:func:`lowband.init` binds every rank to one device before any process group exists: with CUDA present,
``cuda:LOCAL_RANK`` (``torch.cuda.set_device``, and NCCL's communicator created eagerly for it through
``init_process_group(device_id=...)``), else the CPU. ``lowband.device()`` returns it; the bench, the
launcher and the testbed all go through here, so a rank never silently runs on ``cuda:0`` beside the
others.

The request comes from ``init(device=...)`` or the ``LOWBAND_DEVICE`` environment variable:

- ``auto`` (default): CUDA when ``torch.cuda.is_available()``, else the CPU;
- ``cpu``: the CPU even where CUDA exists;
- ``cuda``: CUDA, an error naming the fix where there is none;
- ``cuda:N``: that GPU (one process that wants one particular card).

Which GPU: ``LOWBAND_CUDA_INDEX`` when set (the testbed sets it: its ranks are emulated machines, each
with local rank 0, that share the host's GPUs), else the local rank. ``CUDA_VISIBLE_DEVICES`` is honoured
by CUDA itself: indices count the visible devices only.

More ranks on a machine than visible GPUs: NCCL refuses two ranks of one communicator on one GPU, so with
an NCCL backend that is an error before anything starts (naming the fixes: fewer ranks, ``LOWBAND_DEVICE=
cpu``, or a gloo backend, with which ranks share the GPUs round-robin: CUDA tensors over gloo are staged
through host memory).
"""

from __future__ import annotations

import os

import torch

from lowband.errors import InvalidArgumentError


def requested(device: str | torch.device | None) -> str:
    """The device request: the argument, else ``LOWBAND_DEVICE``, else ``auto`` (validated)."""
    raw = str(device) if device is not None else (os.environ.get("LOWBAND_DEVICE") or "auto")
    req = raw.strip().lower()
    if req in ("auto", "cpu", "cuda"):
        return req
    if req.startswith("cuda:") and req[5:].isdigit():
        return req
    where = "device" if device is not None else "environment variable LOWBAND_DEVICE"
    raise InvalidArgumentError(f"lowband.init: {where}={raw!r}: use auto, cpu, cuda or cuda:N")


def cuda_visible() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "<unset: all>")


def _gpu_index(local_rank: int, local_size: int, count: int, nccl: bool, req: str) -> int:
    if req.startswith("cuda:"):
        index = int(req[5:])
        if index >= count:
            raise InvalidArgumentError(
                f"lowband.init: device {req} does not exist: {count} GPU(s) visible "
                f"(CUDA_VISIBLE_DEVICES={cuda_visible()})"
            )
        return index
    env = os.environ.get("LOWBAND_CUDA_INDEX")
    if env:
        if not env.isdigit():
            raise InvalidArgumentError(f"lowband.init: LOWBAND_CUDA_INDEX={env!r} is not a GPU index")
        slot, ranks = int(env), None
    else:
        slot, ranks = local_rank, local_size
    if nccl and (slot >= count or (ranks is not None and ranks > count)):
        raise InvalidArgumentError(
            f"lowband.init: {ranks if ranks is not None else slot + 1} ranks on this machine but {count} "
            f"GPU(s) visible (CUDA_VISIBLE_DEVICES={cuda_visible()}); NCCL needs one GPU per rank: start at "
            f"most {count} rank(s) per machine, or set LOWBAND_DEVICE=cpu, or pass backend='gloo' to share "
            "the GPUs (CUDA tensors over gloo are staged through host memory)"
        )
    return slot % count


def select(
    device: str | torch.device | None, local_rank: int, local_size: int, backend: str | None
) -> torch.device:
    """The device this rank binds to (see the module docstring); nothing is bound here."""
    req = requested(device)
    available = torch.cuda.is_available()
    if req == "cpu" or (req == "auto" and not available):
        return torch.device("cpu")
    if not available:
        raise InvalidArgumentError(
            f"lowband.init: device {req!r} asked for but CUDA is not available here "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={cuda_visible()}); use device='auto' or 'cpu'"
        )
    nccl = backend is None or "nccl" in backend
    return torch.device("cuda", _gpu_index(local_rank, local_size, torch.cuda.device_count(), nccl, req))


def bind(dev: torch.device) -> None:
    """Make ``dev`` the calling thread's current CUDA device (a no-op for the CPU)."""
    if dev.type == "cuda":
        torch.cuda.set_device(dev)


def default_backend(dev: torch.device) -> str:
    """gloo for CPU tensors, NCCL for CUDA tensors when the rank computes on a GPU."""
    import torch.distributed as dist

    return "cpu:gloo,cuda:nccl" if dev.type == "cuda" and dist.is_nccl_available() else "gloo"


def env_local(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw and raw.isdigit() else default


def check_ranks(nprocs: int, device: str | torch.device | None, backend: str | None, where: str) -> None:
    """Before a launcher starts ``nprocs`` ranks on this machine: the same decision every rank's
    :func:`select` will make, so that too many ranks for the GPUs fail here, once, naming the fix."""
    try:
        select(device, nprocs - 1, nprocs, backend)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(str(exc).replace("lowband.init", where, 1)) from None
