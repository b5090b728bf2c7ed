"""Two threads forking the global random state for SECONDS seconds while one drops cyclic garbage with
``__del__`` methods (a garbage collection inside torch's get_rng_state, whose finalizers run Python code).
Usage: python _rng_fork_threads.py torch|lowband SECONDS; prints "done" when both threads end."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from lowband.rng import fork_rng


class Cycle:
    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        s = 0
        for i in range(2000):  # bytecode in a finalizer: the interpreter may hand the GIL over here
            s += i


def main() -> None:
    fork: Callable[[], AbstractContextManager[object]] = (
        torch.random.fork_rng if sys.argv[1] == "torch" else fork_rng  # type: ignore[assignment]
    )
    seconds = float(sys.argv[2])
    sys.setswitchinterval(1e-6)
    gc.set_threshold(50, 1, 1)
    stop = threading.Event()

    def garbage() -> None:
        while not stop.is_set():
            for _ in range(20):
                Cycle()
            with fork():
                pass

    def plain() -> None:
        while not stop.is_set():
            with fork():
                torch.rand(1)

    threads = [threading.Thread(target=garbage, daemon=True), threading.Thread(target=plain, daemon=True)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    print("done", flush=True)


if __name__ == "__main__":
    main()
