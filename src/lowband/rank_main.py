"""The main of every rank process that ``lowband run`` and ``lowband bench`` start, and the rank side of
:func:`lowband.launch`: what a launcher needs from a rank to name the one that failed and keep the
terminal short.

``python .../lowband/rank_main.py SCRIPT ARGS`` (or ``... -m MODULE ARGS``) runs the script as
``python SCRIPT ARGS`` would (as ``__main__``, with its ``sys.argv`` and ``sys.path[0]``) inside
:func:`rank_session`, which

- writes the rank's pid file (``$LOWBAND_REPORT_DIR/RANK.pid``: its peers and the launcher look at its
  process state) and, when the script raises, the rank's report (``RANK.json``: the error, where in the
  user's code, its traceback, whether it is a follow-on of another rank's failure, the peers seen
  stopped), read by :mod:`lowband.blame`;
- with ``$LOWBAND_LOG_DIR``, copies the rank's Python output (stdout, stderr) into
  ``DIR/rankRANK.log`` and writes the traceback there only, not on the terminal, where the launcher
  prints one line per distinct cause; a crash in native code (SIGSEGV, SIGABRT) leaves the Python
  stacks of every thread there (:mod:`faulthandler`).

Run by path, not with ``-m``: nothing but the standard library is imported before the script runs
(``-m lowband.rank_main`` would import lowband, hence torch), so a script that sets
``OMP_NUM_THREADS`` or ``CUDA_VISIBLE_DEVICES`` before importing torch works as under ``python``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run by path: lowband's own folder must not shadow any module (config, testing...)

import faulthandler
import json
import signal
import sysconfig
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

#: this file: what a launcher runs in each rank process (``python RANK_MAIN SCRIPT ARGS``)
RANK_MAIN = os.path.abspath(__file__)
#: environment variables a launcher sets for its ranks
REPORT_DIR_ENV = "LOWBAND_REPORT_DIR"
LOG_DIR_ENV = "LOWBAND_LOG_DIR"

# what gloo's and NCCL's errors say when a peer failed (torch raises them as plain RuntimeError)
_PEER_FAILED = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out")


def log_path(log_dir: str, rank: int) -> str:
    """Rank ``rank``'s log file in ``log_dir``."""
    return os.path.join(log_dir, f"rank{rank}.log")


def proc_state(pid: int) -> str | None:
    """The one-letter state of process ``pid`` from ``/proc`` (``T``: stopped), or None if it is gone
    (or there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0] if fields else None


def write_pid(report_dir: str, rank: int) -> None:
    """Record this rank's process id for its peers' :func:`stopped_ranks` and the launcher."""
    tmp = os.path.join(report_dir, f".{rank}.pid")
    with open(tmp, "w", encoding="ascii") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(report_dir, f"{rank}.pid"))


def rank_pids(report_dir: str) -> dict[int, int]:
    """Rank -> process id, from the pid files the ranks wrote."""
    out: dict[int, int] = {}
    for name in os.listdir(report_dir):
        stem, _, ext = name.partition(".")
        if ext == "pid" and stem.isdigit():
            try:
                with open(os.path.join(report_dir, name), encoding="ascii") as f:
                    out[int(stem)] = int(f.read())
            except (OSError, ValueError):
                continue
    return out


def stopped_ranks(report_dir: str) -> list[int]:
    """The ranks whose processes are stopped now (state ``T``), of those that wrote a pid file here."""
    return sorted(r for r, pid in rank_pids(report_dir).items() if proc_state(pid) == "T")


def is_follow_on(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication failure caused by another rank (a dead, stopped or missing
    peer): lowband's :class:`~lowband.errors.CommFailedError`/:class:`~lowband.errors.CommTimeoutError`,
    torch's ``DistError`` family, or gloo's/NCCL's plain ``RuntimeError`` saying a peer went away.
    Looked up in ``sys.modules``: what was never imported cannot have been raised."""
    errors = sys.modules.get("lowband.errors")
    if errors is not None and isinstance(exc, (errors.CommFailedError, errors.CommTimeoutError)):
        return True
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None)
    if isinstance(dist_error, type) and isinstance(exc, dist_error):
        return True
    msg = str(exc).lower()
    backend = "gloo" in msg or "nccl" in msg
    return isinstance(exc, RuntimeError) and backend and any(m in msg for m in _PEER_FAILED)


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {os.path.dirname(os.path.abspath(__file__))}
    dirs.update(
        os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths
    )
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def user_frame(exc: BaseException) -> str | None:
    """``"train.py, line 12"``: the innermost frame of ``exc``'s traceback in the user's own code (not
    lowband, torch, the standard library or an installed package), or None."""
    libs = _library_dirs()
    where = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(frame.filename)
        if not frame.filename.startswith("<") and not path.startswith(libs):
            where = f"{os.path.basename(path)}, line {frame.lineno}"
    return where


def _own_frames_dropped(exc: BaseException) -> Any:
    """``exc``'s traceback without its outer frames of this module and runpy (the user's frames first)."""
    tb = exc.__traceback__
    here = os.path.abspath(__file__)
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (os.path.abspath(name) == here or name == "<frozen runpy>" or name.endswith("runpy.py")):
            break
        tb = tb.tb_next
    return tb


def format_error(exc: BaseException) -> str:
    """``exc``'s full traceback as Python prints it, without this module's and runpy's frames."""
    return "".join(traceback.format_exception(type(exc), exc, _own_frames_dropped(exc)))


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def write_report(report_dir: str, rank: int, exc: BaseException) -> None:
    """Write this rank's report (see the module docstring) for ``exc``; called from an ``except``, before
    the rank closes its connections (its peers fail then, and a launcher may stop it)."""
    follow_on = is_follow_on(exc)
    report = {
        "error": _error_text(exc),
        "where": user_frame(exc),
        "traceback": format_error(exc),
        "time": time.time(),
        "follow_on": follow_on,
        "stopped": [r for r in stopped_ranks(report_dir) if r != rank] if follow_on else [],
    }
    tmp = os.path.join(report_dir, f".{rank}.json")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f)
    os.replace(tmp, os.path.join(report_dir, f"{rank}.json"))


class _Tee:
    """A text stream that writes to ``stream`` and to ``log``; everything else is ``stream``'s."""

    def __init__(self, stream: IO[str], log: IO[str]) -> None:
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        try:
            self._log.write(text)
        except (OSError, ValueError):
            pass  # the log closed (interpreter exit) or its disk is full: the terminal goes on
        return n

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._stream.flush()
        try:
            self._log.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def _sigterm_deferred() -> Iterator[None]:
    """SIGTERM waits until the block ends, then acts as it would have. A Python handler notes it: the
    process has other threads (gloo's, torch's), and a signal the main thread masks goes to one of them
    and ends the process there. Off the main thread (no handler can be set) the thread masks it."""
    got: list[int] = []
    try:
        old = signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
    except ValueError:  # not the main thread
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)
        if got:
            signal.raise_signal(signal.SIGTERM)


class RankSession:
    """What :func:`rank_session` yields: :meth:`record` the rank's error before shutting down."""

    def __init__(self, rank: int, report_dir: str | None, log: IO[str] | None) -> None:
        self.rank, self.report_dir, self.log = rank, report_dir, log
        self._recorded: BaseException | None = None

    def record(self, exc: BaseException) -> None:
        """Write the report and the traceback (to the log, or stderr without one) once per error; SIGTERM
        (a launcher stopping the ranks once one failed) waits until both are written."""
        if exc is self._recorded:
            return
        self._recorded = exc
        with _sigterm_deferred():
            if self.report_dir is not None:
                try:
                    write_report(self.report_dir, self.rank, exc)
                except OSError:
                    pass  # the launcher removed the folder: it is gone already
            if isinstance(exc, SystemExit):
                text = f"lowband: rank {self.rank} ended with sys.exit({exc.code!r})\n"
            else:
                text = format_error(exc)
            out = self.log if self.log is not None else sys.stderr
            if out is not None:
                out.write(text)
                out.flush()


@contextmanager
def rank_session(rank: int, report_dir: str | None, log_dir: str | None) -> Iterator[RankSession]:
    """Around one rank's work: the pid file, the log (``log_dir``: Python's output copied there), and on
    an exception the report and traceback (:meth:`RankSession.record`), then ``SystemExit(1)`` with
    nothing more on the terminal. ``SystemExit`` passes (a non-zero code reported as the rank's error);
    KeyboardInterrupt ends the process by SIGINT, as Python does."""
    log: IO[str] | None = None
    saved = sys.stdout, sys.stderr
    if log_dir is not None:
        try:
            os.makedirs(log_dir, exist_ok=True)
            log = open(log_path(log_dir, rank), "a", encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115
        except OSError as exc:  # the rank runs on without its log (the terminal still has its output)
            print(f"lowband: rank {rank}: no log in {log_dir}: {exc}", file=sys.stderr)
    if log is not None:
        sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)  # type: ignore[assignment]
        faulthandler.enable(file=log, all_threads=True)
    if report_dir is not None:
        try:
            write_pid(report_dir, rank)
        except OSError:
            report_dir = None  # no folder to report to (not started by a launcher that reads it)
    session = RankSession(rank, report_dir, log)
    try:
        yield session
    except SystemExit as exc:
        if exc.code not in (None, 0):
            session.record(exc)
        raise
    except KeyboardInterrupt as exc:
        session.record(exc)
        _close(log, saved)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    except BaseException as exc:
        session.record(exc)
        raise SystemExit(1) from None
    finally:
        _close(log, saved)


def _close(log: IO[str] | None, saved: tuple[Any, Any]) -> None:
    if log is None or log.closed:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout, sys.stderr = saved
    faulthandler.disable()
    log.close()


def main(argv: list[str]) -> int:
    """``rank_main.py SCRIPT ARGS`` or ``rank_main.py -m MODULE ARGS``: run it as Python would, inside
    :func:`rank_session` (rank from ``$RANK``, folders from ``$LOWBAND_REPORT_DIR``/``$LOWBAND_LOG_DIR``)."""
    import runpy

    module = argv[:1] == ["-m"]
    if len(argv) < (2 if module else 1):
        print("usage: rank_main.py SCRIPT [ARGS] | -m MODULE [ARGS]", file=sys.stderr)
        return 2
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    env = os.environ.get
    with rank_session(rank, env(REPORT_DIR_ENV) or None, env(LOG_DIR_ENV) or None):
        sys.argv = [target, *args]
        sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(target)))
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
