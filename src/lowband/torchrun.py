"""``lowband run`` without a link option: torchrun with lowband's defaults.

One machine (no rendezvous endpoint or master address, or ``--standalone``): the store listens on
127.0.0.1 only (:func:`lowband.launcher.loopback_store`); otherwise torchrun's multi-host rendezvous as
given. Each worker runs the script through :mod:`lowband.rank_main` (its report, and its Python output
and traceback in ``LOG_DIR/rankR.log``), and a failed run ends with one line per distinct cause
(:mod:`lowband.blame`), not every rank's traceback nor torch's own failure table.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from lowband.blame import (
    LaunchFolders,
    child_ranks,
    ends_of_failures,
    parent_of,
    proc_state,
    read_reports,
    summary,
)
from lowband.errors import InvalidArgumentError, LowbandError
from lowband.launcher import loopback_store, quiet_torch_logs
from lowband.rank_main import RANK_MAIN

_NPROCS = ("-n", "--np", "--nprocs")
_MULTI_HOST = (
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
)
#: torchrun's options that run something other than ``python SCRIPT`` (no rank_main around it)
_RAW = ("--no-python", "--no_python", "--run-path", "--run_path")


class _ChildWatch:
    """While torchrun's agent runs in this process (its workers are our children): once a worker has
    ended while another is stopped (state T), kill the stopped one (the agent would wait 30 s for it
    to obey its SIGTERM) and remember it: it is the cause of the others' timeouts."""

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
                if st == "T" and r not in self.seen and parent_of(known[r]) == os.getpid():
                    self.seen[r] = time.time()
                    os.kill(known[r], signal.SIGKILL)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _nprocs(flag: str, value: str | None) -> str:
    if value is None or not value.isdigit() or int(value) < 1:
        got = "no value" if value is None else repr(value)
        raise InvalidArgumentError(f"lowband run: {flag} needs a number of ranks >= 1, got {got}")
    return value


def split_torchrun_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(torchrun's options, [script, *args])`` with ``-n``/``--np``/``--nprocs`` as torchrun's
    ``--nproc-per-node`` (checked: a number >= 1)."""
    from torch.distributed.run import get_args_parser

    takes_value = {o for a in get_args_parser()._actions for o in a.option_strings if a.nargs != 0}
    argv = list(argv)
    opts: list[str] = []
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
            return opts, argv[i:]
        if a in takes_value and i + 1 < len(argv):  # ``--nnodes 2``: the value is not the script
            opts += [a, argv[i + 1]]
            i += 2
            continue
        opts.append(a)
        i += 1
    return opts, []


def run_command(
    argv: Sequence[str], *, log_dir: str | None = None, env: Mapping[str, str] | None = None
) -> int:
    """``lowband run -n N [torchrun options] script.py [args]``: torchrun with lowband's defaults (see the
    module docstring); ``env`` is added to the workers' environment (``OMP_NUM_THREADS``); ``log_dir``
    receives ``rankR.log`` (default: a temporary folder, kept and named when a rank failed). Returns
    the exit status: 0, or 1 after printing one line per cause when a rank failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torch_run

    opts, rest = split_torchrun_argv(argv)
    store = None
    if not any(x.startswith(_MULTI_HOST) for x in opts):  # one machine (``--standalone`` or nothing said)
        store, port = loopback_store()
        opts = [x for x in opts if x != "--standalone"]
        opts += ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        opts += ["--nnodes", "1", "--node-rank", "0"]
    wrapped = not any(x.partition("=")[0] in _RAW for x in opts)
    if wrapped and rest:
        module = [x for x in opts if x in ("-m", "--module")]
        opts = [x for x in opts if x not in ("-m", "--module")]
        rest = [RANK_MAIN, *(["-m"] if module else []), *rest]
    args = get_args_parser().parse_args(opts + rest)
    folders = LaunchFolders(log_dir, "lowband-run")
    extra = {**(env or {}), **(folders.env() if wrapped else {})}
    before = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    watch = _ChildWatch()
    failure: ChildFailedError | None = None
    try:
        with quiet_torch_logs():
            torch_run(args)  # type: ignore[no-untyped-call]
    except ChildFailedError as exc:
        failure = exc
    except SignalException as exc:  # Ctrl-C or SIGTERM: torch's agent stopped the workers
        folders.close()
        print(f"lowband run: interrupted ({exc.sigval.name}); every rank stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    except Exception as exc:
        folders.close()
        raise LowbandError(f"lowband run: {type(exc).__name__}: {exc}") from exc
    finally:
        watch.close()
        del store
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if failure is None:
        folders.close()
        return 0
    ends = ends_of_failures(failure.failures)
    reports = read_reports(folders.reports)
    logs = folders.logs if wrapped else None
    for line in summary(ends, reports, watch.seen, "lowband run", logs, launcher="torchrun's agent"):
        print(line, file=sys.stderr, flush=True)
    folders.close(ends)
    return 1
