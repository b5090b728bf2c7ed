"""Checkpoints a crash cannot tear: :class:`Checkpointer` saves a strategy every K steps (and when the job
is asked to stop) and resumes from the newest complete set, at the world size that came back.

The documented training loop::

    ckpt = lowband.checkpoint.Checkpointer("ckpt", every=100)
    start = ckpt.resume(strategy)                # 0 when there is nothing to resume
    for step in range(start, total_steps):
        strategy.train_step(lambda m: loss_of(m, batch(step)))
        ckpt.maybe_save(strategy, step + 1)      # step + 1 steps are complete

A *set* is one folder ``step-{S:09d}`` holding one file per rank (``rank{r}-of-{n}.pt``, written by
:meth:`Strategy.save <lowband.strategies.Strategy.save>`: a temporary file, fsync, rename) and
``manifest.json``, written by world rank 0 only after every rank's file is on disk (the same temporary
file, fsync, rename, then the folder's fsync). The manifest names the format, the step, the world size,
the strategy and its settings, the lowband version and commit, and every rank's file with its size and
SHA-256. A set without a manifest is incomplete (a crash during the save) and is never loaded; after
each new set the oldest beyond ``keep`` (default 2) are removed, manifest first.

:meth:`Checkpointer.resume` is collective: every rank lists the complete sets it sees, the ranks take
the newest set every rank sees, and check the files they need against the manifest (size and SHA-256)
before anything is loaded; a truncated or altered file makes every rank move on to the previous set,
naming the rank and the file in a warning. At the saved world size each rank loads its own file; at
another world size every rank reads every file and re-shards what is sharded
(:func:`~lowband.strategies.assemble_state_dicts`, :func:`~lowband.strategies.reshard_checkpoints`);
state that is per rank and cannot be re-split (local SGD's per-rank momenta, say) is refused with the
fix named; state equal on every rank loads as it is. Files load with ``weights_only=True``.

A set of another strategy, or a manifest of a newer format, raises
:class:`~lowband.errors.InvalidArgumentError` on every rank (nothing is overwritten). Stop requests:
with ``sigterm=True`` (the default) a SIGTERM (what torchrun and schedulers send before killing) is
recorded; at the next :meth:`~Checkpointer.maybe_save` the ranks agree (one small allreduce on the
control group, every call) and, if any rank was asked to stop, all save and exit with status 143.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lowband.errors import InvalidArgumentError
from lowband.runtime import current

if TYPE_CHECKING:
    from lowband.strategies.base import Strategy

FORMAT = 1
MANIFEST = "manifest.json"
_PREFIX = "step-"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_COMMIT: str | None = None


def build_id() -> str:
    """lowband's version, and its git commit where lowband runs from a checkout."""
    global _COMMIT
    if _COMMIT is None:
        from lowband import __version__

        commit = ""
        try:
            here = Path(__file__).resolve().parent
            out = subprocess.run(
                ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            commit = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):
            pass
        _COMMIT = f"{__version__}+{commit}" if commit else __version__
    return _COMMIT


def read_manifest(folder: Path) -> dict[str, Any]:
    """A set's manifest (raises :class:`InvalidArgumentError` for a newer format or a broken one)."""
    path = folder / MANIFEST
    try:
        man: Any = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"checkpoint manifest {str(path)!r} cannot be read: {exc}") from exc
    if not isinstance(man, dict):
        raise InvalidArgumentError(f"checkpoint manifest {str(path)!r} is not a JSON object")
    fmt = man.get("format")
    if not isinstance(fmt, int) or fmt > FORMAT:
        raise InvalidArgumentError(
            f"checkpoint manifest {str(path)!r} has format {fmt!r}; this lowband ({build_id()}) reads format "
            f"{FORMAT} and older: resume with the lowband that wrote it"
        )
    return man


def complete_sets(folder: str | os.PathLike[str]) -> list[int]:
    """The steps of the sets in ``folder`` whose manifest exists and whose files all exist with the
    manifest's sizes, newest first (a local look: no hashing, no communication)."""
    found = []
    root = Path(folder)
    if not root.is_dir():
        return []
    for d in root.iterdir():
        if not (d.is_dir() and d.name.startswith(_PREFIX) and (d / MANIFEST).is_file()):
            continue
        try:
            man = read_manifest(d)
        except InvalidArgumentError:
            continue
        files = man.get("files", [])
        if len(files) == man.get("world_size") and all(
            (d / f["file"]).is_file() and (d / f["file"]).stat().st_size == f["bytes"] for f in files
        ):
            found.append(int(man["step"]))
    return sorted(found, reverse=True)


class Checkpointer:
    """Saves every ``every`` steps into ``folder`` and resumes from it (module docstring)."""

    def __init__(
        self, folder: str | os.PathLike[str], every: int, *, keep: int = 2, sigterm: bool = True
    ) -> None:
        for what, v in (("every", every), ("keep", keep)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"Checkpointer: {what} must be an int >= 1, got {v!r}")
        self.folder, self.every, self.keep, self.sigterm = Path(folder), every, keep, sigterm
        self.stop_requested = False
        self.saved: list[int] = []
        self._warned: tuple[int, ...] | None = None  # the membership _reduced warned about
        if sigterm and threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)

            def on_term(signum: int, frame: Any) -> None:
                self.stop_requested = True
                if callable(previous):  # a handler of the program's own (SIG_DFL would end it now)
                    previous(signum, frame)

            signal.signal(signal.SIGTERM, on_term)

    def set_dir(self, step: int) -> Path:
        return self.folder / f"{_PREFIX}{step:09d}"

    # -- saving -------------------------------------------------------------------------------------
    def maybe_save(self, strategy: Strategy, step: int) -> Path | None:
        """Collective, after ``step`` complete steps: saves when ``step`` is a multiple of ``every``, or
        when any rank was sent SIGTERM (then every rank exits with status 143 after the save)."""
        stop = False
        if (
            self.sigterm
        ):  # (a lost rank met here is noticed, under on_peer_loss=continue, and this rank's own)
            stop = strategy.side_collective(
                lambda: self._agree_stop(strategy),
                "Checkpointer's stop agreement",
                lambda: self.stop_requested,
            )
        due = stop or step % self.every == 0
        if due and self._reduced(strategy, step):
            due = False
        if stop:
            if due:
                self.save(strategy, step)
            raise SystemExit(128 + signal.SIGTERM)
        return self.save(strategy, step) if due else None

    def _reduced(self, strategy: Strategy, step: int) -> bool:
        """Whether the strategy trains on fewer ranks than the world, or has noticed a lost rank whose
        membership is not agreed yet (``on_peer_loss=continue``): a set would name ranks that are gone,
        so it is skipped, with a warning once per membership, until a replacement (``lowband run
        --replacements``) makes the membership whole."""
        g, size = strategy.group, current("Checkpointer.maybe_save").size
        if g.size == size and strategy.membership_settled():
            return False
        if self._warned != g.ranks:
            self._warned = g.ranks
            warnings.warn(
                f"Checkpointer.maybe_save on rank {g.world_rank}: not saving at step {step} or later: "
                + (
                    f"the strategy trains on ranks {list(g.ranks)} of the world's {size}"
                    if g.size < size
                    else "a lost rank was noticed and the membership is not agreed yet"
                )
                + "; checkpoints of a reduced membership are not supported yet, and saving resumes once a "
                "replacement has joined",
                stacklevel=3,
            )
        return True

    def _agree_stop(self, strategy: Strategy) -> bool:
        from lowband.comm.control import control_allreduce

        g = strategy.group
        flag = torch.tensor([1 if self.stop_requested else 0], dtype=torch.int32, device="cpu")
        where = f"Checkpointer.maybe_save on rank {g.world_rank}"
        return bool(control_allreduce(g, flag, "max", current(where).config.timeout, where)[0])

    def save(self, strategy: Strategy, step: int) -> Path:
        """Collective: the set of ``step`` (module docstring); returns its folder."""
        from lowband.strategies.checkpoint import _agree
        from lowband.strategies.digest import exchange_text

        ctx = current("Checkpointer.save")
        d = self.set_dir(step)
        path = strategy.save(d)  # every rank's file on disk, or an error on every rank
        info = json.dumps(
            {"rank": ctx.rank, "file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}
        )
        g = strategy.group
        infos = [info] if g.size == 1 else exchange_text(g, info, "Checkpointer.save", ctx.config.timeout)
        error = ""
        if g.rank == 0:
            try:
                man = {
                    "format": FORMAT, "step": step, "world_size": ctx.size, "strategy": strategy.name,
                    "label": strategy.label(), "lowband": build_id(),
                    "files": sorted((json.loads(i) for i in infos), key=lambda f: f["rank"]),
                }  # fmt: skip
                _write_atomic(d / MANIFEST, json.dumps(man, indent=1))
                self._prune(step)
            except OSError as exc:
                error = (
                    f"Checkpointer.save on rank {ctx.rank}: cannot write the manifest of {str(d)!r}: {exc}"
                )
        _agree(strategy, f"Checkpointer.save({str(d)!r})", error)
        self.saved.append(step)
        return d

    def _prune(self, newest: int) -> None:
        keep = set(complete_sets(self.folder)[: self.keep]) | {newest}
        for d in sorted(self.folder.iterdir()):
            if not (d.is_dir() and d.name.startswith(_PREFIX)):
                continue
            try:
                step = int(d.name[len(_PREFIX) :])
            except ValueError:
                continue
            if step in keep or step > newest:  # a newer folder: someone else's save in progress
                continue
            (d / MANIFEST).unlink(missing_ok=True)  # incomplete first, then gone
            shutil.rmtree(d, ignore_errors=True)

    # -- resuming -----------------------------------------------------------------------------------
    def resume(self, strategy: Strategy) -> int:
        """Collective: loads the newest complete set every rank sees and returns its step (0 if none).
        On a replacement of a lost rank (``LOWBAND_JOIN=1``) it loads nothing and returns
        ``strategy.steps``: the strategy took a live member's state when it was admitted, and the
        members, past their own resume, do not meet it here."""
        from lowband.strategies.digest import exchange_text

        ctx = current("Checkpointer.resume")
        if ctx.joining:
            return strategy.steps
        g = strategy.group
        mine = complete_sets(self.folder)
        seen = (
            [json.dumps(mine)]
            if g.size == 1
            else exchange_text(g, json.dumps(mine), "resume", ctx.config.timeout)
        )
        common = set(json.loads(seen[0])).intersection(*(json.loads(s) for s in seen[1:]))
        for step in sorted(common, reverse=True):
            d = self.set_dir(step)
            man = read_manifest(d)
            if man.get("strategy") != strategy.name:
                raise InvalidArgumentError(
                    f"Checkpointer.resume: the newest checkpoint {str(d)!r} is of strategy {man.get('strategy')!r}, "
                    f"this run's is {strategy.name!r}: give another folder (nothing was loaded or overwritten)"
                )
            problem = self._verify(d, man, ctx.rank, ctx.size)
            errors = [problem] if g.size == 1 else exchange_text(g, problem, "resume", ctx.config.timeout)
            bad = [(r, e) for r, e in enumerate(errors) if e]
            if bad:
                warnings.warn(
                    f"Checkpointer.resume: skipping {str(d)!r}: rank {bad[0][0]}: {bad[0][1]}", stacklevel=2
                )
                continue
            load_set(strategy, d, man, ctx.rank, ctx.size)
            return int(man["step"])
        return 0

    @staticmethod
    def _verify(d: Path, man: dict[str, Any], rank: int, size: int) -> str:
        """'' if the files this rank will read match the manifest, else what is wrong (rank and file)."""
        files = man["files"]
        need = [f for f in files if f["rank"] == rank] if man["world_size"] == size else files
        for f in need:
            p = d / f["file"]
            try:
                if p.stat().st_size != f["bytes"] or _sha256(p) != f["sha256"]:
                    return f"{str(p)!r} (world rank {f['rank']}'s file) does not match its manifest (truncated or altered)"
            except OSError as exc:
                return f"{str(p)!r} (world rank {f['rank']}'s file) cannot be read: {exc}"
        return ""


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def restate(states: list[dict[str, Any]], size: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state at world size ``size`` from every rank's state saved at another size:
    sharded state assembled, compressed stages' memories re-split, replicated state taken as it is;
    per-rank state that cannot be re-split is refused."""
    from lowband.strategies import assemble_state_dicts, reshard_checkpoints
    from lowband.strategies.compressed_state import RESHARDABLE

    name = states[0].get("strategy")
    if all(s.get("sharding") is not None for s in states):
        return assemble_state_dicts(states)
    if name in RESHARDABLE:
        return reshard_checkpoints(states, size)[rank]
    if all(_equal(s, states[0]) for s in states[1:]):
        return states[0]
    raise InvalidArgumentError(
        f"Checkpointer.resume: strategy {name!r} was saved at {len(states)} ranks with per-rank state that "
        f"does not re-split to {size} ranks (per-rank optimizer state or replicas, which differ between "
        f"ranks): resume at {len(states)} ranks"
    )


def load_set(strategy: Strategy, d: Path, man: dict[str, Any], rank: int, size: int) -> None:
    """Collective: load the verified set ``d`` into ``strategy`` at this world size."""
    if man["world_size"] == size:
        strategy.load(d)
        return
    states = [torch.load(d / f["file"], weights_only=True) for f in man["files"]]
    strategy.load_state_dict(restate(states, size, rank))
