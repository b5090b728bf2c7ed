"""One checkpoint convention for every strategy: a folder with one file per rank.

:meth:`Strategy.save(folder) <lowband.strategies.Strategy.save>` writes this rank's
:meth:`~lowband.strategies.Strategy.state_dict` to ``folder/rank{r}-of-{n}.pt`` (``r``/``n``: the world rank
and size; the world rank keeps the files of several groups saving into one folder apart), atomically:
``torch.save`` to a temporary file in the folder, flushed to disk, then ``os.replace``, so a crash
mid-save leaves the previous file whole. :meth:`Strategy.load(folder)
<lowband.strategies.Strategy.load>` reads this rank's file with ``torch.load(weights_only=True)``
(tensors, numbers, strings and containers only: nothing unpickled) and loads it.

Both are collective over the strategy's group and the ranks agree on the outcome before returning:
a rank that could not write its file, or finds none to read (saved at another world size, a rank's file
missing), makes every rank raise :class:`~lowband.errors.InvalidArgumentError` naming the rank, the file
and the fix, instead of some ranks loading while others wait. Every rank's file of a folder, in rank
order, is :func:`read_folder` (the input of :func:`~lowband.strategies.reshard_checkpoints` and
:func:`~lowband.strategies.assemble_state_dicts` to resume at another world size).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lowband.errors import InvalidArgumentError
from lowband.runtime import current
from lowband.strategies.digest import exchange_text

if TYPE_CHECKING:
    from lowband.strategies.base import Strategy

_NAME = re.compile(r"rank(\d+)-of-(\d+)\.pt")


def rank_file(folder: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    """The file of world rank ``rank`` of ``world_size`` in ``folder``."""
    return Path(folder) / f"rank{rank}-of-{world_size}.pt"


def _files(folder: Path) -> list[tuple[int, int, Path]]:
    found = []
    if folder.is_dir():
        for p in folder.iterdir():
            m = _NAME.fullmatch(p.name)
            if m:
                found.append((int(m.group(2)), int(m.group(1)), p))
    return sorted(found)


def read_folder(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rank's checkpoint in ``folder`` (``weights_only=True``), in rank order; raises
    :class:`InvalidArgumentError` unless the folder holds the files of exactly one world size, all of it."""
    path = Path(folder)
    files = _files(path)
    sizes = sorted({n for n, _, _ in files})
    if len(sizes) != 1:
        raise InvalidArgumentError(
            f"read_folder({str(folder)!r}): expected the rank files of one world size, found "
            f"{[p.name for _, _, p in files] or 'none'}"
        )
    ranks = [r for _, r, _ in files]
    if ranks != list(range(sizes[0])):
        missing = sorted(set(range(sizes[0])) - set(ranks))
        raise InvalidArgumentError(
            f"read_folder({str(folder)!r}): the files of world ranks {missing} of {sizes[0]} are missing"
        )
    return [torch.load(p, weights_only=True) for _, _, p in files]


def _agree(s: Strategy, what: str, error: str) -> None:
    """Every rank of the strategy's group learns every rank's ``error`` ('' when fine); all raise the
    first rank's, naming it, when any failed."""
    g = s.group
    errors = [error] if g.size == 1 else exchange_text(g, error, what, current(what).config.timeout)
    bad = [(g.ranks[i], e) for i, e in enumerate(errors) if e]
    if not bad:
        return
    if error:
        raise InvalidArgumentError(error)
    r, first = bad[0]
    others = f" (and ranks {[b[0] for b in bad[1:]]})" if len(bad) > 1 else ""
    raise InvalidArgumentError(f"{what}: rank {r} failed{others}: {first}")


def save(s: Strategy, folder: str | os.PathLike[str]) -> Path:
    """:meth:`Strategy.save` (module docstring); returns this rank's file."""
    ctx = current("Strategy.save")
    path = rank_file(folder, s.group.world_rank, ctx.size)
    where = f"strategy {s.name!r}: save({str(folder)!r}) on rank {s.group.world_rank}"
    state = s.state_dict()  # collective for some strategies: before anything can fail locally
    error = ""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        error = f"{where}: cannot write {str(path)!r}: {exc}; give a folder every rank can write"
    _agree(s, f"strategy {s.name!r}: save({str(folder)!r})", error)
    return path


def load(s: Strategy, folder: str | os.PathLike[str]) -> Path:
    """:meth:`Strategy.load` (module docstring); returns this rank's file."""
    ctx = current("Strategy.load")
    path = rank_file(folder, s.group.world_rank, ctx.size)
    where = f"strategy {s.name!r}: load({str(folder)!r}) on rank {s.group.world_rank}"
    error, state = "", None
    if not path.is_file():
        found = [p.name for _, _, p in _files(Path(folder))]
        sizes = sorted({n for n, _, _ in _files(Path(folder))} - {ctx.size})
        fix = (
            f"it was saved at {sizes} ranks: resume at that world size, or re-shard every rank's file "
            "(read_folder, then reshard_checkpoints or assemble_state_dicts) and load_state_dict"
            if sizes
            else "give the folder Strategy.save wrote, visible to every rank"
        )
        error = f"{where}: no file {path.name!r} for world rank {s.group.world_rank} of {ctx.size} (found {found or 'nothing'}); {fix}"
    else:
        try:
            state = torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError) as exc:
            error = f"{where}: cannot read {str(path)!r}: {exc}"
        if state is not None and not isinstance(state, dict):
            error = f"{where}: {str(path)!r} does not hold a strategy's state_dict"
    _agree(s, f"strategy {s.name!r}: load({str(folder)!r})", error)
    assert isinstance(state, dict)
    s.load_state_dict(state)
    return path
