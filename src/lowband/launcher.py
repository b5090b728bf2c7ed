"""Starting ranks: :func:`launch` for notebooks and tests, and the ``lowband run`` command.

Both are built on torch's elastic launcher (``torch.distributed.run`` / ``elastic_launch``), so
processes, rendezvous, failure detection and clean-up are torch's, not ours: when one rank fails the
agent stops the others and the failure is reported with that rank's traceback.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from lowband.errors import InvalidArgumentError, LowbandError


def _entry(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], init_kwargs: dict[str, Any]
) -> Any:
    import torch

    import lowband

    if os.environ.get("LOWBAND_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["LOWBAND_NUM_THREADS"]))
    lowband.init(**init_kwargs)
    try:
        return fn(*args, **kwargs)
    finally:
        lowband.shutdown()


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    init_kwargs: dict[str, Any] | None = None,
    monitor_interval: float = 0.1,
    quiet: bool = True,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks (after :func:`lowband.init`) and return the
    ranks' results in rank order.

    ``fn`` must be picklable (defined at module level). ``init_kwargs`` go to :func:`lowband.init` on
    every rank. If a rank fails, the others are stopped and :class:`LowbandError` is raised with the
    failed ranks' errors.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise InvalidArgumentError(f"lowband.launch: nprocs must be an int >= 1, got {nprocs!r}")
    if not callable(fn):
        raise InvalidArgumentError(f"lowband.launch: fn must be callable, got {type(fn).__name__}")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"lowband-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=monitor_interval,
        start_method="spawn",
    )
    env_backup = os.environ.get("LOGLEVEL")
    if quiet:
        import logging

        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
        logging.getLogger("torch.distributed.launcher").setLevel(logging.ERROR)
    try:
        results = elastic_launch(config, _entry)(fn, tuple(args), dict(kwargs or {}), dict(init_kwargs or {}))
    except ChildFailedError as exc:
        lines = []
        for local_rank, failure in sorted(exc.failures.items()):
            msg = failure.message if isinstance(failure.message, str) else str(failure.message)
            lines.append(f"rank {local_rank} (exit code {failure.exitcode}): {msg}")
        raise LowbandError("lowband.launch: " + "; ".join(lines)) from exc
    finally:
        if env_backup is not None:
            os.environ["LOGLEVEL"] = env_backup
    return [results[r] for r in sorted(results)]


def run_command(argv: Sequence[str]) -> int:
    """``lowband run -n N [torchrun options] script.py [args]``: torchrun with lowband's defaults
    (``--standalone`` when no rendezvous endpoint is given)."""
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torch_run

    argv = list(argv)
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-n", "--np", "--nprocs"):
            out += ["--nproc-per-node", argv[i + 1]]
            i += 2
            continue
        if a.startswith("-n") and a[2:].isdigit():
            out += ["--nproc-per-node", a[2:]]
            i += 1
            continue
        if not a.startswith("-"):
            out += argv[i:]
            break
        out.append(a)
        i += 1
    if not any(
        x.startswith("--rdzv-endpoint") or x.startswith("--rdzv_endpoint") or x == "--standalone" for x in out
    ):
        out.insert(0, "--standalone")
    args = get_args_parser().parse_args(out)
    try:
        torch_run(args)  # type: ignore[no-untyped-call]
    except Exception as exc:  # ChildFailedError prints its own report
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if isinstance(exc, ChildFailedError):
            return 1
        raise LowbandError(f"lowband run: {exc}") from exc
    return 0
