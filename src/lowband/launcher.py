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
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from lowband.blame import (
    child_ranks,
    parent_of,
    proc_state,
    rank_pids,
    read_reports,
    signal_cause,
    write_pid,
    write_report,
)
from lowband.blame import failure_report as failure_report  # re-exported: the launch error's text
from lowband.devices import check_ranks
from lowband.errors import InvalidArgumentError, LowbandError

_GUARD = 'if __name__ == "__main__":'


def _entry(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    init_kwargs: dict[str, Any],
    report_dir: str,
) -> Any:
    import torch

    import lowband

    if os.environ.get("LOWBAND_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["LOWBAND_NUM_THREADS"]))
    rank = int(os.environ.get("RANK", "0"))
    write_pid(report_dir, rank)
    try:
        lowband.init(**init_kwargs)
        return fn(*args, **kwargs)
    except BaseException as exc:
        if not (isinstance(exc, SystemExit) and not exc.code):
            # before shutdown: the peers fail as soon as this rank's connections close, and the agent,
            # seeing them fail, may stop this rank before it exits (out of torch's list of failures)
            write_report(report_dir, rank, exc)
        raise
    finally:
        lowband.shutdown()


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


class _ChildWatch:
    """``lowband run`` (torchrun's agent runs in this process, its workers are our children): once a
    worker has ended while another is stopped (state T), kill the stopped one (the agent would wait 30 s
    for it to obey its SIGTERM) and remember it: it is the cause of the others' timeouts."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lowband-run-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        known: dict[int, int] = {}
        while not self._stop.wait(self.interval):
            known.update(child_ranks(os.getpid()))
            states = {r: proc_state(pid) for r, pid in known.items()}
            if not any(st in (None, "Z") for st in states.values()):
                continue  # every worker still runs (or is stopped by choice: nobody waits on it yet)
            for r, st in sorted(states.items()):
                if st == "T" and r not in self.seen and _is_child(known[r]):
                    self.seen[r] = time.time()
                    os.kill(known[r], signal.SIGKILL)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


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
    if quiet:
        import logging

        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
        logging.getLogger("torch.distributed.launcher").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="lowband-launch-") as report_dir:
        watch = _StoppedWatch(report_dir, monitor_interval)
        try:
            results = elastic_launch(config, _entry)(
                fn, tuple(args), dict(kwargs or {}), dict(init_kwargs or {}), report_dir
            )
        except ChildFailedError as exc:
            watch.close()
            raise LowbandError(failure_report(exc.failures, read_reports(report_dir), watch.seen)) from exc
        finally:
            watch.close()
            del store
    return [results[r] for r in sorted(results)]


_NPROCS = ("-n", "--np", "--nprocs")
_MULTI_HOST = (
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
)


def _nprocs(flag: str, value: str | None) -> str:
    if value is None or not value.isdigit() or int(value) < 1:
        got = "no value" if value is None else repr(value)
        raise InvalidArgumentError(f"lowband run: {flag} needs a number of ranks >= 1, got {got}")
    return value


def run_command(argv: Sequence[str]) -> int:
    """``lowband run -n N [torchrun options] script.py [args]``: torchrun with lowband's defaults. Without a
    rendezvous endpoint or master address (or with ``--standalone``) it is a single-machine launch, its
    store on 127.0.0.1 (see the module docstring); with one, torchrun's multi-host rendezvous as given."""
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torch_run

    parser = get_args_parser()
    takes_value = {o for action in parser._actions for o in action.option_strings if action.nargs != 0}
    argv = list(argv)
    opts: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _NPROCS:
            opts += ["--nproc-per-node", _nprocs(a, argv[i + 1] if i + 1 < len(argv) else None)]
            i += 2
            continue
        if a.startswith("-n") and not a.startswith("--") and len(a) > 2:
            opts += ["--nproc-per-node", _nprocs("-n", a[2:].lstrip("="))]
            i += 1
            continue
        if a.startswith(("--nproc-per-node", "--nproc_per_node")):
            value = a.partition("=")[2] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else None)
            if value is None or (value.lstrip("-").isdigit() and int(value) < 1):
                _nprocs(a.partition("=")[0], value)
        if not a.startswith("-"):
            rest = argv[i:]
            break
        if a in takes_value and i + 1 < len(argv):  # ``--nnodes 2``: the value is not the script
            opts += [a, argv[i + 1]]
            i += 2
            continue
        opts.append(a)
        i += 1
    store = None
    if not any(x.startswith(_MULTI_HOST) for x in opts):  # one machine (``--standalone`` or nothing said)
        store, port = loopback_store()
        opts = [x for x in opts if x != "--standalone"]
        opts += ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        opts += ["--nnodes", "1", "--node-rank", "0"]
    out = opts + rest
    args = parser.parse_args(out)
    watch = _ChildWatch()
    try:
        torch_run(args)  # type: ignore[no-untyped-call]
    except Exception as exc:  # ChildFailedError: the ranks printed their own errors
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if isinstance(exc, ChildFailedError):
            watch.close()
            cause = signal_cause(exc.failures, watch.seen)
            if cause is not None:
                print(f"lowband run: {cause}", file=sys.stderr, flush=True)
            return 1
        raise LowbandError(f"lowband run: {type(exc).__name__}: {exc}") from exc
    finally:
        watch.close()
        del store
    return 0
