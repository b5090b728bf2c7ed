"""Forking torch's global random streams without the deadlock torch's own :func:`torch.random.fork_rng`
can meet when two threads fork at once (thread ranks: :func:`lowband.testing.run_threads`, every rank a
thread of one process, sharing the global generators).

torch's ``get_rng_state`` holds the generator's mutex while it wraps the state in a Python tensor, with the
GIL held; that allocation can start a garbage collection whose finalizers run Python code, and the
interpreter can hand the GIL to another thread there. If that thread is in ``get_rng_state`` or
``set_rng_state`` too, it waits for the mutex while holding the GIL, and the first waits for the GIL while
holding the mutex: both wait forever, and no Python-level timeout can run (reproduced with torch 2.13 and
Python 3.11 by two threads, one dropping cyclic garbage with ``__del__`` methods).

:func:`fork_rng` takes a process-wide Python lock around each read and each write of the states (waiting
for a Python lock releases the GIL), so no two lowband forks meet inside torch's; the body runs outside
the lock, so a fork may hold collectives."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

_STATES = threading.Lock()


@contextmanager
def fork_rng(devices: Sequence[int] = ()) -> Iterator[None]:
    """Run the body with the CPU's random state, and those of the CUDA ``devices`` (indices), put back
    afterwards (:func:`torch.random.fork_rng`'s contract, the default being no CUDA device)."""
    with _STATES:
        cpu = torch.get_rng_state()
        cuda = [torch.cuda.get_rng_state(d) for d in devices]
    try:
        yield
    finally:
        with _STATES:
            torch.set_rng_state(cpu)
            for d, state in zip(devices, cuda):
                torch.cuda.set_rng_state(state, d)
