"""Will this machine hold a bench's (or ``lowband run``'s) ranks? A check before any testbed or rank
starts, and the threads each rank computes with.

Every rank is a process with its own torch (about 300 MB resident before any model), the workload's
model, gradients, optimizer state and the strategy's copies and buffers, so ``lowband bench -n 100``
needs tens of GB: started anyway, it runs the machine out of memory. Ranks beyond a few per core make
every step wait on the scheduler and the communication time out. :func:`check_resources` refuses such
runs with its estimate; ``--force`` (``run_bench(..., force=True)``) starts them anyway. ``lowband run``
applies the same check with torch's footprint alone (it does not know the script's model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lowband.errors import InvalidArgumentError

#: a rank process's resident memory before its model: torch, lowband, gloo (measured ~220-300 MB)
TORCH_FOOTPRINT = 300 * 10**6
#: model-sized copies a training rank holds: parameters, gradients, optimizer state (momentum, Adam's
#: two moments), the strategy's own (averaging buffers, windows, error memory), communication buffers
MODEL_COPIES = 6
#: ranks per core beyond which a bench measures the scheduler rather than the links
RANKS_PER_CORE = 4
#: share of the available memory the ranks may take
MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class Machine:
    available_bytes: int | None  # None: unknown (no /proc/meminfo)
    cores: int


def machine() -> Machine:
    """This machine's available memory (``MemAvailable``) and the cores this process may run on."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return Machine(available, cores)


def threads_per_rank(ranks: int, cores: int) -> int:
    """Threads each of ``ranks`` rank processes sharing ``cores`` cores computes with (torch's intra-op
    threads, ``OMP_NUM_THREADS``): the cores shared out, at least 1, as torchrun's 1 and the bench's
    ``threads`` keep them. Every rank taking every core (torch's default) makes the ranks preempt each
    other, and a step measures the scheduler."""
    return max(1, cores // max(1, ranks))


def rank_bytes(model_bytes: int, footprint: int = TORCH_FOOTPRINT) -> int:
    """Estimated resident memory of one training rank."""
    return footprint + MODEL_COPIES * model_bytes


def check_resources(
    world_size: int,
    threads: int,
    per_rank: int,
    m: Machine,
    what: str,
    force: str = "--force (run_bench(..., force=True))",
) -> None:
    """Raise :class:`InvalidArgumentError` with the estimate if ``world_size`` ranks (``threads``
    threads each, ``per_rank`` bytes each) would not fit ``m``; the message says how to start them
    anyway (``force``)."""
    problems = []
    need = world_size * per_rank
    if m.available_bytes is not None and need > MEMORY_SHARE * m.available_bytes:
        problems.append(
            f"{world_size} ranks need about {need / 1e9:.1f} GB ({per_rank / 1e6:.0f} MB per rank: "
            f"~{TORCH_FOOTPRINT / 1e6:.0f} MB of torch per process plus the model, gradients, optimizer "
            f"and strategy state), and this machine has {m.available_bytes / 1e9:.1f} GB available"
        )
    if world_size * threads > RANKS_PER_CORE * m.cores:
        problems.append(
            f"{world_size} ranks x {threads} thread(s) on {m.cores} core(s) is more than "
            f"{RANKS_PER_CORE} per core: steps would measure the scheduler, and waits would time out"
        )
    if problems:
        raise InvalidArgumentError(
            f"{what}: refusing to start: " + "; ".join(problems) + f". Use fewer ranks (-n), or {force} "
            "to start them anyway"
        )
