"""Starting ranks: :func:`launch` for notebooks and tests, and the ``lowband run`` command.

Both are built on torch's elastic launcher (``torch.distributed.run`` / ``elastic_launch``), so
processes, rendezvous, failure detection and clean-up are torch's, not ours: when one rank fails the
agent stops the others, and the failure is reported with the root cause first (the rank whose own error
started it, with its traceback), then the ranks that failed after it.

What listens on the network. A launch has one TCP store (torch's key-value store, through which ranks
rendezvous, and which torch's rendezvous code reads with ``pickle``), then gloo's connections between
ranks. For single-machine launches (:func:`launch`, and ``lowband run`` without a rendezvous endpoint or
master address) lowband opens the store itself on a socket bound to 127.0.0.1 and has torch use it (a
static rendezvous on that address), so nothing on the network can reach it. A multi-host launch
(``lowband run`` or torchrun with ``--rdzv-endpoint``/``--master-addr``) is torch's: the store listens on
all interfaces of the host that serves it and any peer that can reach its port can read and write it,
including values torch unpickles; run such launches only on a trusted network (or a firewalled one
where only the job's hosts reach the store's port). gloo listens on the interface it resolves for this
host (``GLOO_SOCKET_IFNAME`` chooses) and carries tensors, not pickles.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from lowband.blame import (
    LaunchFolders,
    ends_of_failures,
    parent_of,
    proc_state,
    rank_pids,
    read_reports,
    summary,
)
from lowband.blame import failure_report as failure_report  # re-exported: the launch error's text
from lowband.devices import check_ranks
from lowband.errors import InvalidArgumentError, LowbandError
from lowband.rank_main import rank_session

_GUARD = 'if __name__ == "__main__":'


def _entry(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    init_kwargs: dict[str, Any],
    report_dir: str,
    log_dir: str | None = None,
) -> Any:
    import torch

    import lowband

    if os.environ.get("LOWBAND_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["LOWBAND_NUM_THREADS"]))
    rank = int(os.environ.get("RANK", "0"))
    with rank_session(rank, report_dir, log_dir) as session:
        try:
            lowband.init(**init_kwargs)
            return fn(*args, **kwargs)
        except BaseException as exc:
            if not (isinstance(exc, SystemExit) and not exc.code):
                # before shutdown: the peers fail as soon as this rank's connections close, and the agent,
                # seeing them fail, may stop this rank before it exits (out of torch's list of failures)
                session.record(exc)
            raise
        finally:
            lowband.shutdown()


#: torch's loggers that print a failed launch's processes and tracebacks again (lowband's summary says it)
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher")


@contextmanager
def quiet_torch_logs(level: int = logging.CRITICAL) -> Iterator[None]:
    """Torch's launcher logs (the workers it stops, each failure with its traceback) above ``level``
    only, while the block runs: lowband prints one line per cause and the logs hold the tracebacks."""
    names = [*_TORCH_LOGGERS, *(n for n in logging.root.manager.loggerDict if n.startswith(_TORCH_LOGGERS))]
    loggers = [logging.getLogger(name) for name in names]  # torch's get_logger sets each one's level
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, before):
            lg.setLevel(lvl)


class _StoppedWatch:
    """While a launch runs: once a rank's report names stopped ranks, kill them (SIGKILL; torch's agent
    would wait 30 s for a stopped rank to obey its SIGTERM) and remember when they were seen stopped."""

    def __init__(self, report_dir: str, interval: float) -> None:
        self.report_dir, self.interval = report_dir, interval
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lowband-launch-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            named = {int(s) for rep in read_reports(self.report_dir).values() for s in rep.get("stopped", [])}
            if not named:
                continue
            pids = rank_pids(self.report_dir)
            for r in sorted(named - set(self.seen)):
                pid = pids.get(r)
                if pid is not None and proc_state(pid) == "T" and _is_child(pid):
                    self.seen[r] = time.time()
                    os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _is_child(pid: int) -> bool:
    return parent_of(pid) == os.getpid()


def loopback_store() -> tuple[Any, int]:
    """A TCP store server listening on 127.0.0.1 only (a free port), shared with torch's launcher: a
    store torch opens later in this process on the same port (``multi_tenant``) is this one. Returns
    ``(store, port)``; the store listens while it is referenced."""
    import datetime

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = int(sock.getsockname()[1])
        store = TCPStore(
            "127.0.0.1",
            port,
            is_master=True,
            timeout=datetime.timedelta(seconds=600),
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the socket now (it closes it)
    return store, port


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [x for x in sides if isinstance(x, ast.Name) and x.id == "__name__"]
    mains = [x for x in sides if isinstance(x, ast.Constant) and x.value == "__main__"]
    return len(names) == 1 and len(mains) == 1


def _check_main_guard() -> None:
    """Refuse a call made while the main script runs outside ``if __name__ == "__main__":``. Ranks are
    started with the 'spawn' method: each imports the main script again, so such a call would run again
    in every rank and fail there (where the cause is hard to see)."""
    import multiprocessing as mp
    import multiprocessing.spawn as mps

    if getattr(mp.current_process(), "_inheriting", False):
        raise LowbandError(
            "lowband.launch: called while a rank process was importing the main script: the call "
            f"must be under `{_GUARD}` (every rank imports the script again)"
        )
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str):
        return  # interactive, notebook, ``python -c``: spawn does not rerun anything
    data = mps.get_preparation_data("lowband")
    reruns = "init_main_from_path" in data or (
        "init_main_from_name" in data and not str(data["init_main_from_name"]).endswith("__main__")
    )
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back  # type: ignore[assignment]
    if not reruns or frame is None:
        return
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        guard = isinstance(node, ast.If) and _is_main_test(node.test)
        if guard and node.lineno <= line <= (node.end_lineno or node.lineno):  # type: ignore[attr-defined]
            return
    raise InvalidArgumentError(
        f"lowband.launch: called at line {line} of {path} outside an `{_GUARD}` block. Each rank is a "
        "new Python process that imports this script ('spawn'), so the call would run again in every "
        f"rank and fail there. Put the code that launches under `{_GUARD}` (keep fn at module level, "
        "where the ranks can import it)."
    )


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    init_kwargs: dict[str, Any] | None = None,
    monitor_interval: float = 0.1,
    quiet: bool = True,
    log_dir: str | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks (after :func:`lowband.init`) and return the
    ranks' results in rank order.

    ``fn`` must be picklable (defined at module level). ``init_kwargs`` go to :func:`lowband.init` on
    every rank. Each rank's Python output is also copied to ``log_dir/rankR.log`` (default: a new
    temporary folder, removed when every rank succeeded). If a rank fails, the others are stopped and
    :class:`LowbandError` is raised with one line per distinct cause (which ranks, what), the cause
    first (:mod:`lowband.blame`), and the folder whose logs hold every rank's full traceback.
    ``quiet`` hides torch's own launcher logs (which repeat the failures with tracebacks).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise InvalidArgumentError(f"lowband.launch: nprocs must be an int >= 1, got {nprocs!r}")
    if not callable(fn):
        raise InvalidArgumentError(f"lowband.launch: fn must be callable, got {type(fn).__name__}")
    ik = dict(init_kwargs or {})
    check_ranks(nprocs, ik.get("device"), ik.get("backend"), "lowband.launch")
    _check_main_guard()
    store, port = loopback_store()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"lowband-{uuid.uuid4().hex[:12]}",
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"rank": 0},
        max_restarts=0,
        monitor_interval=monitor_interval,
        start_method="spawn",
    )
    folders = LaunchFolders(log_dir, "lowband-launch")
    watch = _StoppedWatch(folders.reports, monitor_interval)
    failure: ChildFailedError | None = None
    try:
        with quiet_torch_logs() if quiet else contextlib.nullcontext():
            results = elastic_launch(config, _entry)(
                fn, tuple(args), dict(kwargs or {}), ik, folders.reports, folders.logs
            )
    except ChildFailedError as exc:
        failure = exc
    finally:
        watch.close()
        del store
    if failure is None:
        folders.close()
        return [results[r] for r in sorted(results)]
    ends = ends_of_failures(failure.failures)
    lines = summary(ends, read_reports(folders.reports), watch.seen, "lowband.launch", folders.logs)
    folders.close(ends)
    raise LowbandError("\n".join(lines))
