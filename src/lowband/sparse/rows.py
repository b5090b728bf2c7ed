"""Rows of embedding tables (pure): finding a model's tables, row partitions over ranks (range and
modulo, Parallax's two), and coalesced sparse rows packed with their indices as one byte buffer.

A *table* is an ``nn.Embedding`` module of the model, called as a module on id tensors (the
workloads' contract); its gradient touches only the rows of the ids it was called on. Coalescing
sums duplicate ids into one row (the rows of ``unique(ids)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowband.errors import InvalidArgumentError

Tensor = torch.Tensor

#: row partitions of a table over ranks
PARTITIONS = ("range", "modulo")


def embedding_tables(model: nn.Module) -> list[tuple[str, nn.Embedding]]:
    """The model's ``nn.Embedding`` modules (``(name, module)``, registration order), each weight once."""
    seen: set[int] = set()
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding) and id(mod.weight) not in seen:
            seen.add(id(mod.weight))
            out.append((name, mod))
    return out


@dataclass(frozen=True)
class RowPartition:
    """Which rank owns which rows of a ``rows``-row table: ``range`` (contiguous blocks, the first
    ``rows % n`` one row longer) or ``modulo`` (row ``r`` on rank ``r % n``)."""

    kind: str
    rows: int
    n: int

    def __post_init__(self) -> None:
        if self.kind not in PARTITIONS:
            raise InvalidArgumentError(
                f"RowPartition: partition must be one of {PARTITIONS}, got {self.kind!r}"
            )
        if self.rows < 0 or self.n < 1:
            raise InvalidArgumentError(f"RowPartition: need rows >= 0 and n >= 1, got {self.rows}, {self.n}")

    def _starts(self) -> list[int]:
        q, r = divmod(self.rows, self.n)
        starts = [0]
        for j in range(self.n):
            starts.append(starts[-1] + q + (j < r))
        return starts

    def owned(self, rank: int, device: torch.device | str = "cpu") -> Tensor:
        """The rows rank ``rank`` owns, increasing (int64), on ``device`` (the table's, to index it)."""
        if self.kind == "modulo":
            return torch.arange(rank, max(rank, self.rows), self.n, dtype=torch.int64, device=device)
        s = self._starts()
        return torch.arange(s[rank], s[rank + 1], dtype=torch.int64, device=device)

    def counts(self) -> list[int]:
        """Rows owned per rank."""
        if self.kind == "modulo":
            return [len(range(j, self.rows, self.n)) for j in range(self.n)]
        s = self._starts()
        return [s[j + 1] - s[j] for j in range(self.n)]

    def owner(self, ids: Tensor) -> Tensor:
        """Each id's owner rank."""
        if self.kind == "modulo":
            return ids % self.n
        bounds = torch.tensor(self._starts()[1:-1], dtype=torch.int64, device=ids.device)
        return torch.bucketize(ids, bounds, right=True)

    def local(self, ids: Tensor) -> Tensor:
        """Each id's position in its owner's block."""
        if self.kind == "modulo":
            return ids // self.n
        starts = torch.tensor(self._starts()[:-1], dtype=torch.int64, device=ids.device)
        return ids - starts[self.owner(ids)]

    def by_owner(self, ids: Tensor) -> tuple[Tensor, list[int]]:
        """``ids`` reordered by owner (stable: increasing ids stay increasing) and the count per owner."""
        own = self.owner(ids)
        order = torch.argsort(own, stable=True)
        # host sync (one): the counts are the all-to-all's splits, which the host must know
        counts = torch.bincount(own, minlength=self.n).tolist()
        return ids[order], counts


def coalesce(ids: list[Tensor], device: torch.device | str = "cpu") -> Tensor:
    """The distinct ids of every call, increasing (int64), on their device; with no call, empty on
    ``device`` (pass the table's)."""
    if not ids:
        return torch.empty(0, dtype=torch.int64, device=device)
    out: Tensor = torch.unique(torch.cat([i.reshape(-1) for i in ids]).to(torch.int64))
    return out


def pack_rows(ids: Tensor, values: Tensor) -> Tensor:
    """Rows of ``(int64 id, values...)`` as one ``uint8`` tensor of shape ``(k, 8 + dim * itemsize)``."""
    k = ids.numel()
    idx = ids.to(torch.int64).contiguous().view(torch.uint8).reshape(k, 8)
    vals = values.contiguous().view(torch.uint8).reshape(k, values.shape[1] * values.element_size())
    return torch.cat([idx, vals], dim=1)


def unpack_rows(buf: Tensor, dim: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`pack_rows`: ``(ids, values (k, dim))``."""
    k = buf.shape[0]
    ids = buf[:, :8].reshape(-1).view(torch.int64)
    vals = buf[:, 8:].reshape(-1).view(dtype).view(k, dim)
    return ids, vals


def row_bytes(dim: int, dtype: torch.dtype) -> int:
    """Bytes of one packed row."""
    return 8 + dim * dtype.itemsize
