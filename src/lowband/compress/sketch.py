"""CountSketch (pure): a linear map of a length-``d`` vector into an ``rows x cols`` table.

Row ``j`` adds ``sign_j(i) * x_i`` into column ``bucket_j(i)``; the estimate of ``x_i`` is the median over
rows of ``sign_j(i) * table[j, bucket_j(i)]`` (one row: unbiased), and the squared norm is estimated by
the median over rows of the row's sum of squares. The map is linear, ``S(a + b) = S(a) + S(b)``: sketches
of different ranks are summed on the wire (tree or allreduce), exactly for integer-valued inputs.

Hashes. Every rank must use the same buckets and signs with no communication. They are *seeded tables*
drawn from a ``torch.Generator`` seeded with ``seed`` (one ``randint`` per table, int32 buckets and int8
signs: 10 M coordinates x 5 rows in ~0.4 s on one core), not a polynomial hash evaluated in Python, and
not the ``a * i mod p`` hash of the published code, which overflows int64 for large ``a``. torch's CPU
generator draws the same numbers on every process, thread count and machine; :meth:`CountSketch.checksum`
summarises the tables (a crc of their sizes and of a strided sample) so that a transport can agree on it
across ranks once, at construction (:func:`lowband.comm.agree`).

Devices. The tables are drawn on the CPU (the generator's stream, hence the tables, are then the same
on every rank whatever its device) and kept there (the checksum reads them); :meth:`CountSketch.tables`
moves them once to each device a vector comes on, and every table and estimate is on its input's device.

Medians. With an even number of rows the estimate is the lower of the two middle values (as ``torch.median``);
the default of the sketched reducers is 5 rows.
"""

from __future__ import annotations

import zlib

import torch

from lowband.errors import InvalidArgumentError

Tensor = torch.Tensor

#: up to this many rows the median is taken by a selection network (twice as fast as torch.median)
_NETWORK_ROWS = 9
#: sample stride of :meth:`CountSketch.checksum` (the sizes and every 4099th entry of both tables)
_CHECK_STRIDE = 4099


def _pos_int(where: str, what: str, v: object, low: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise InvalidArgumentError(f"{where}: {what} must be an int >= {low}, got {v!r}")
    return v


def lower_median(values: list[Tensor]) -> Tensor:
    """Elementwise lower median of equally shaped tensors (``torch.median`` over a stacked dim), by the
    passes of a bubble sort that place the upper half: ``r - (r - 1) // 2`` passes of min/max."""
    a = list(values)
    r = len(a)
    for p in range(r - (r - 1) // 2):
        for j in range(r - 1 - p):
            a[j], a[j + 1] = torch.minimum(a[j], a[j + 1]), torch.maximum(a[j], a[j + 1])
    return a[(r - 1) // 2]


class CountSketch:
    """The hash tables of an ``rows x cols`` CountSketch of length-``d`` vectors; see the module docstring.

    Tables are built once (``buckets``: ``(rows, d)`` int32 in ``[0, cols)``; ``signs``: ``(rows, d)``
    int8 in ``{-1, +1}``); :meth:`sketch`, :meth:`estimate` and :meth:`norm_sq` are pure functions of a
    table and a vector.
    """

    def __init__(self, d: int, rows: int, cols: int, *, seed: int = 0) -> None:
        where = "CountSketch"
        self.d = _pos_int(where, "d", d, 0)
        self.rows = _pos_int(where, "rows", rows)
        self.cols = _pos_int(where, "cols", cols)
        if cols >= 2**31:
            raise InvalidArgumentError(f"{where}: cols must be < 2**31, got {cols}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgumentError(f"{where}: seed must be an int, got {seed!r}")
        self.seed = seed
        g = torch.Generator(device="cpu")
        g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        # drawn on the CPU: device-independent tables (module docstring); copies per device in _on
        self.buckets = torch.randint(0, cols, (rows, d), generator=g, dtype=torch.int32, device="cpu")
        self.signs = (
            torch.randint(0, 2, (rows, d), generator=g, dtype=torch.int8, device="cpu").mul_(2).sub_(1)
        )
        self._on: dict[torch.device, tuple[Tensor, Tensor]] = {
            self.buckets.device: (self.buckets, self.signs)
        }

    def tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(buckets, signs)`` on ``device`` (moved there the first time)."""
        got = self._on.get(device)
        if got is None:
            got = self._on[device] = (self.buckets.to(device), self.signs.to(device))
        return got

    @property
    def numel(self) -> int:
        """The number of values in a table (``rows * cols``)."""
        return self.rows * self.cols

    def checksum(self) -> int:
        """A 31-bit summary of the tables (sizes, seed and a strided sample of both tables)."""
        b = self.buckets.reshape(-1)[::_CHECK_STRIDE].to(torch.int64)
        s = self.signs.reshape(-1)[::_CHECK_STRIDE].to(torch.int64)
        head = f"{self.d}/{self.rows}/{self.cols}/{self.seed}/{int(b.sum())}/{int((s * b).sum())}".encode()
        return zlib.crc32(b.numpy().tobytes() + s.numpy().tobytes(), zlib.crc32(head)) & 0x7FFFFFFF

    def _check(self, where: str, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() != 1 or x.numel() != self.d or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise InvalidArgumentError(
                f"CountSketch.{where}: expected a flat floating-point tensor of {self.d} elements, got {shape}"
            )
        return x

    def zeros(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Tensor:
        """An empty table, ``(rows, cols)``, on ``device``."""
        return torch.zeros(self.rows, self.cols, dtype=dtype, device=device)

    def accumulate(self, table: Tensor, x: Tensor) -> Tensor:
        """Add the sketch of ``x`` into ``table`` (in place) and return it."""
        x = self._check("accumulate", x)
        if table.shape != (self.rows, self.cols) or table.dtype != x.dtype:
            raise InvalidArgumentError(
                f"CountSketch.accumulate: table must be ({self.rows}, {self.cols}) of {x.dtype}, got "
                f"{tuple(table.shape)} of {table.dtype}"
            )
        if table.device != x.device:
            raise InvalidArgumentError(
                f"CountSketch.accumulate: table on {table.device}, vector on {x.device}"
            )
        buckets, signs = self.tables(x.device)
        for j in range(self.rows):  # a handful of rows; each row is one vectorised scatter-add
            table[j].index_add_(0, buckets[j], x * signs[j])
        return table

    def sketch(self, x: Tensor) -> Tensor:
        """The sketch of ``x``: a new ``(rows, cols)`` table of ``x``'s dtype."""
        x = self._check("sketch", x)
        return self.accumulate(self.zeros(x.dtype, x.device), x)

    def row_estimates(self, table: Tensor) -> Tensor:
        """``(rows, d)``: every row's estimate of every coordinate (each one unbiased)."""
        buckets, signs = self.tables(table.device)
        return torch.stack([table[j].index_select(0, buckets[j]) * signs[j] for j in range(self.rows)])

    def estimate(self, table: Tensor) -> Tensor:
        """The estimate of every coordinate: the median over rows (``d`` values)."""
        buckets, signs = self.tables(table.device)
        rows = [table[j].index_select(0, buckets[j]) * signs[j] for j in range(self.rows)]
        if self.rows <= _NETWORK_ROWS:
            return lower_median(rows)
        return torch.stack(rows).median(dim=0).values

    def norm_sq(self, table: Tensor) -> float:
        """The estimate of ``||x||^2``: the median over rows of each row's sum of squares."""
        return float(self.norm_sq_tensor(table))

    def norm_sq_tensor(self, table: Tensor) -> Tensor:
        """:meth:`norm_sq` as a 0-dim float64 tensor on the table's device (no host synchronisation)."""
        return table.double().pow(2).sum(dim=1).median()

    def __repr__(self) -> str:
        return f"CountSketch(d={self.d}, rows={self.rows}, cols={self.cols}, seed={self.seed})"
