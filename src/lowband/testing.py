"""Multi-rank test harness: run a function on N ranks from pytest.

``run_threads`` (the fast path) runs every rank as a thread of the calling process, each with its
own gloo process group over loopback (rendezvous through an in-memory store: no ports to leak), so a
multi-rank test costs milliseconds instead of 2-4 s of process start-up and ``import torch`` per rank.
gloo releases the GIL while it moves data, so ranks really run concurrently.

``run_processes`` runs ranks as real processes (for tests where a rank must die, or that need
process-wide state): started by multiprocessing from a fork server that preloaded torch (spawn where
there is none), rendezvous on a TCP store that the calling process hosts on 127.0.0.1, results and
exceptions sent back on a queue, every child killed and joined before it returns.

Both have a hard timeout, and raise :class:`RankFailures` carrying every failing rank's exception and
traceback.
"""

from __future__ import annotations

import gc
import io
import multiprocessing as mp
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import HashStore  # type: ignore[attr-defined]

from lowband.comm.control import left_pending
from lowband.config import Config
from lowband.launcher import loopback_store
from lowband.runtime import init_thread_rank, shutdown


class RankFailures(AssertionError):
    """One or more ranks failed; ``errors`` maps rank -> formatted traceback."""

    def __init__(self, errors: dict[int, str], world_size: int) -> None:
        self.errors = errors
        body = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"{len(errors)} of {world_size} ranks failed:\n{body}")


def run_threads(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    comm_timeout: float | None = None,
    check: bool = True,
    local_size: int | None = None,
    trace: bool = False,
    fusion_threshold: int | None = None,
    emulate_nccl: bool | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` thread-ranks; returns the results in rank order.

    Each thread is a lowband rank (``lowband.rank()``, collectives, groups all work as in a process).
    ``comm_timeout`` (default: ``timeout``) bounds every communication. If the ranks have not all
    finished after ``timeout`` seconds, their process groups are aborted and the stuck ranks' stacks
    are reported. ``emulate_nccl``: each rank's data groups enforce NCCL's contract
    (:mod:`lowband.comm.nccl_emulator`; default: ``LOWBAND_EMULATE_NCCL=1`` in the environment, so a
    whole test family can be rerun under NCCL's contract); the control groups stay plain gloo.
    """
    if emulate_nccl is None:
        from lowband.comm.nccl_emulator import enabled_from_env

        emulate_nccl = enabled_from_env()
    store = HashStore()
    cfg = Config(
        timeout=comm_timeout if comm_timeout is not None else timeout,
        check=check,
        trace=trace,
        fusion_threshold=Config().fusion_threshold if fusion_threshold is None else fusion_threshold,
    )
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pgs: dict[int, Any] = {}

    def body(rank: int) -> None:
        try:
            ctx = init_thread_rank(store, rank, world_size, cfg, local_size, emulate_nccl)
            pgs[rank] = ctx
            results[rank] = fn(*args)
        except BaseException:
            errors[rank] = traceback.format_exc()
        finally:
            try:
                shutdown()
            except BaseException:
                errors.setdefault(rank, traceback.format_exc())

    threads = [
        threading.Thread(target=body, args=(r,), name=f"lowband-rank{r}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        frames = sys._current_frames()
        for r in stuck:
            ident = threads[r].ident
            stack = "".join(traceback.format_stack(frames[ident])) if ident in frames else "(no frame)"
            errors[r] = f"still running after {timeout:g} s (hard timeout); stack:\n{stack}"
        for ctx in pgs.values():
            for g in [ctx.world, *ctx._groups]:
                for pg in (g.pg, g.ctl):
                    try:
                        pg.abort()
                    except (RuntimeError, AttributeError):
                        pass
        for r in stuck:
            threads[r].join(5.0)
    # A rank that failed, or a mismatch that left a data op pending, can leave process groups whose
    # destructor waits for that op (up to the timeout). Free them here, in the run that made them: a
    # later garbage collection would run that wait on whatever thread allocates next (another test's
    # rank), stalling it.
    if errors or any(left_pending(ctx) for ctx in pgs.values()):
        pgs.clear()
        gc.collect()
    if errors:
        raise RankFailures(errors, world_size)
    return [results[r] for r in range(world_size)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_CONTEXT: Any = None


def _process_context() -> Any:
    """The start method of :func:`run_processes`' ranks: a fork server that imported torch and lowband
    once (a rank starts in ~0.05 s instead of the 2-4 s ``import torch`` costs each spawned process); each
    rank is still a fresh process that never ran any of the caller's code. Where there is no fork server
    (not POSIX), spawn."""
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("forkserver")
            # the server only imports (no torch op, no CUDA, no thread pool): safe to fork from
            _CONTEXT.set_forkserver_preload(["torch", "lowband", "lowband.testing"])
        else:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


def _proc_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    init_kwargs: dict[str, Any],
    q: Any,
    env: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment now, not the fork server's at its start
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
         "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    )  # fmt: skip
    import torch

    import lowband

    torch.set_num_threads(1)
    try:
        lowband.init(**init_kwargs)
        # the result travels as bytes: torch's queue would share tensors by file descriptor, which the
        # parent fetches from this process after it may have exited (EOFError, seen with CUDA ranks)
        buf = io.BytesIO()
        torch.save(fn(*args), buf)
        q.put((rank, True, buf.getvalue()))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    finally:
        try:
            lowband.shutdown()
        except BaseException:
            pass


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    comm_timeout: float | None = None,
    allow_exit: tuple[int, ...] = (),
    **init_kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned processes after ``lowband.init(**init_kwargs)``.

    ``timeout`` is the hard limit for the whole run; ``comm_timeout`` (default: ``timeout``) bounds every
    communication. Returns results in rank order (``None`` for ranks in ``allow_exit``, which may exit
    without a result, e.g. a rank that kills itself in a failure test).
    """
    init_kwargs["timeout"] = comm_timeout if comm_timeout is not None else timeout
    ctx = _process_context()
    q = ctx.Queue()
    store, port = loopback_store()  # the ranks are its clients (as under a launcher)
    env = dict(os.environ)  # as spawn would pass it: the fork server holds the environment it started with
    procs = [
        ctx.Process(target=_proc_main, args=(fn, r, world_size, port, args, init_kwargs, q, env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = q.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and r not in results and r not in errors
                ]
                for r in dead:
                    if r in allow_exit:
                        results[r] = None
                    else:
                        time.sleep(0.2)  # its last message may still be in the pipe
                        if q.empty():
                            errors[r] = f"process exited with code {procs[r].exitcode} and no result"
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        q.close()
        del store
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    for r in missing:
        errors[r] = f"no result within the hard timeout of {timeout:g} s"
    if errors:
        raise RankFailures(errors, world_size)
    return [results[r] for r in range(world_size)]


def nccl_emulated() -> bool:
    """Whether this test process runs its thread ranks under the NCCL emulator (``LOWBAND_EMULATE_NCCL=1``):
    a test of a gloo-only pattern (a two-way unbatched exchange, which NCCL deadlocks) skips itself."""
    from lowband.comm.nccl_emulator import enabled_from_env

    return enabled_from_env()


__all__ = ["RankFailures", "free_port", "nccl_emulated", "run_processes", "run_threads"]
