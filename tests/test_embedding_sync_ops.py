"""The micro-benchmark's ops (one embedding gradient synchronised four ways, ``lowband bench
--collectives``): the bytes each rank sends per op equal the byte model of :mod:`lowband.sparse.costs`
(the column-partitioned AlltoAll exchange included), at 1-4 ranks and uneven column splits, and the
options are checked."""

from __future__ import annotations

import pytest
import torch

import lowband
from lowband.bench.collectives import build_ops
from lowband.bench.embedding_ops import table_rows, touched_rows
from lowband.sparse import costs
from lowband.sparse.rows import RowPartition
from lowband.testing import run_threads

SIZE = 40_000  # bytes: 10,000 float32


def _op_bytes(spec: str, dim: int, density: float) -> tuple[dict[str, int], int]:
    r, n = lowband.rank(), lowband.size()
    group = lowband.world().unchecked()
    ((_, fn),) = build_ops([spec], group)
    buf = torch.ones(SIZE // 4)
    lowband.reset_trace()
    fn(buf, 5)
    got = {op: c["bytes_sent"] for op, c in lowband.counters().items()}
    v = table_rows(SIZE, dim)
    sets = [touched_rows(v, density, q, 5 % 4) for q in range(n)]
    k = [s.numel() for s in sets]
    if spec.startswith("emb_allgather"):
        want = costs.sparse_allgather_bytes(k, dim, 4)
    elif spec.startswith("emb_alltoall"):
        dims = costs.column_split(dim, n)
        want = costs.column_lookup_bytes(k, dims, r, 4) + costs.column_gradient_bytes(k[r], dims, r, 4)
    elif spec.startswith("emb_ps"):
        part = RowPartition(spec.split("partition=")[1], v, n)
        counts = [part.by_owner(s)[1] for s in sets]
        want = costs.ps_push_bytes(counts[r], r, dim, 4) + costs.ps_reply_bytes(
            [counts[q][r] for q in range(n)], r, dim, 4
        )
    else:
        want = costs.allreduce_bytes(SIZE // 4, 4, n)
    return got, want


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "spec",
    [
        "allreduce",
        "emb_allgather:density=0.05,dim=10",
        "emb_alltoall:density=0.05,dim=10",  # 10 columns: uneven at 3 and 4 ranks
        "emb_ps:density=0.05,dim=10,partition=modulo",
        "emb_ps:density=0.3,dim=7,partition=range",
    ],
)
def test_bytes_per_op_match_the_model(spec: str, n: int) -> None:
    dim = int(spec.split("dim=")[1].split(",")[0]) if "dim=" in spec else 1
    density = float(spec.split("density=")[1].split(",")[0]) if "density=" in spec else 1.0
    for r, (got, want) in enumerate(run_threads(_op_bytes, n, spec, dim, density, trace=True)):
        assert sum(got.values()) == want, f"{spec} rank {r} of {n}: {got}, model {want}"


def test_alltoall_bytes_equal_table2_volume_when_columns_divide() -> None:
    # D divisible by N and equal rows per rank: the exchange moves Table 2's 2 (N-1) alpha M / N
    n, dim, rows, k = 4, 8, 1000, 37
    dims = costs.column_split(dim, n)
    sent = costs.column_lookup_bytes([k] * n, dims, 1, 4) + costs.column_gradient_bytes(k, dims, 1, 4)
    b, _ = costs.table2_terms("alltoall", n, n, k / rows, rows * dim * 4)
    assert sent == pytest.approx(b)


def test_options_are_checked() -> None:
    def build() -> None:
        g = lowband.world()
        for bad, match in (
            ("emb_allgather:density=2", "density"),
            ("emb_alltoall:dim=1", "dim=1"),
            ("emb_ps:partition=hash", "partition"),
            ("emb_ps:colour=red", r"collective 'emb_ps': unknown option\(s\) \['colour'\]"),
        ):
            with pytest.raises(lowband.InvalidArgumentError, match=match):
                build_ops([bad], g)

    run_threads(build, 2)
