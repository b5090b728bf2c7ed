"""The ``compressed`` strategy: trains as the single-process oracle of compressed data parallelism at
world sizes 1-4 (identity through the default transport, a coarse non-summable format through an
allgather transport, with and without error feedback), refuses bad specs before any communication,
and reports the per-step breakdown of its training thread."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import lowband
from lowband.compress import build_reducer
from lowband.errors import InvalidArgumentError
from lowband.strategies import CompressedStrategy, make_strategy, parse_strategy_spec
from lowband.testing import run_threads
from tests.compress_fixtures import GatherTransport, Grid, flat, loss, model, oracle, sgd

STEPS = 4


def _train(spec: dict[str, Any] | None, residual: bool = True) -> torch.Tensor:
    r = lowband.rank()
    if spec is None:  # the non-summable test format through the test allgather transport, per layer
        red = GatherTransport(Grid(), "residual" if residual else "none")
        s: Any = CompressedStrategy(model(), sgd, lowband.world(), red, bucket_mb=0)
    else:
        s = make_strategy("compressed", model(), sgd, **spec)
    for k in range(STEPS):
        s.train_step(lambda m, k=k: loss(m, r, k))
    s.close()
    return flat(s.local_module)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_identity_equals_averaged_sgd(n: int) -> None:
    """compressor=identity (reducer=auto: the allreduce transport) trains as SGD on the mean loss."""
    res = run_threads(_train, n, {"compressor": "identity", "bucket_mb": 0.0001}, timeout=60)
    ref = oracle(n, STEPS, sgd, None, residual=False)
    for r in range(n):
        assert float((res[r] - ref).abs().max()) < 1e-6, f"rank {r}"
        assert torch.equal(res[r], res[0])


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_non_summable_format_equals_the_oracle(n: int, residual: bool) -> None:
    """A coarse format with (and without) error feedback: bit for bit the oracle's training."""
    res = run_threads(_train, n, None, residual, timeout=60)
    ref = oracle(n, STEPS, sgd, Grid(), residual=residual)
    plain = oracle(n, STEPS, sgd, None, residual=False)
    for r in range(n):
        assert torch.equal(res[r], ref), f"rank {r}: {float((res[r] - ref).abs().max())}"
    assert float((ref - plain).abs().max()) > 1e-4  # the format is coarse enough to matter


def test_nested_spec_parses() -> None:
    name, opts = parse_strategy_spec("compressed:compressor=qsgd:levels=16;bucket=512,reducer=ps,bucket_mb=0")
    assert name == "compressed"
    assert opts == {"compressor": "qsgd:levels=16;bucket=512", "reducer": "ps", "bucket_mb": 0}


BAD = [
    ({"compressor": "nope"}, "unknown compressor 'nope'"),
    ({"reducer": "nope"}, "unknown transport 'nope'"),
    ({"compressor": "fp16:ratio=3"}, "compressor 'fp16': unknown option(s) ['ratio']"),
    ({"reducer": "allreduce:width=2"}, "transport 'allreduce': unknown option(s) ['width']"),
    ({"memory": "forever"}, "'forever'"),
    ({"seed": "x"}, "seed must be an int, got 'x'"),
    ({"bucket_mb": -1}, "bucket_mb must be a number >= 0, got -1"),
    ({"compressor": 3}, "compressor must be a compressor spec (name:key=value;...) of: bf16,"),
    ({"colour": "red"}, "unknown option(s) ['colour']"),
]


def _bad(opts: dict[str, Any]) -> str:
    """Every rank builds the strategy with the same bad options: after the configuration agreement (the
    ranks' options are equal), each rank's own check raises, before any data moves."""
    try:
        make_strategy("compressed", model(), sgd, **opts)
    except InvalidArgumentError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("opts,msg", BAD, ids=[m[:24] for _, m in BAD])
def test_bad_specs_fail_on_every_rank_before_training(opts: dict[str, Any], msg: str) -> None:
    for got in run_threads(_bad, 2, opts, timeout=30, comm_timeout=5):
        assert msg in got, got


def test_non_summable_format_refused_by_allreduce() -> None:
    with pytest.raises(
        InvalidArgumentError, match="here: AllreduceCompressedReducer: compressor 'grid' is not summable"
    ):
        build_reducer(Grid(), "allreduce", where="here")


def _timed(spec: str) -> dict[str, Any]:
    r = lowband.rank()
    name, opts = parse_strategy_spec(spec)
    s = make_strategy(name, model(), sgd, **opts)
    walls = []
    for k in range(3):
        t0 = time.perf_counter()
        s.train_step(lambda m, k=k: loss(m, r, k))
        walls.append(time.perf_counter() - t0)
    rep = s.report()
    s.close()
    return {"report": rep, "walls": walls, "label": s.label()}


@pytest.mark.parametrize("spec", ["compressed:compressor=fp16,bucket_mb=0", "stage:bucket_mb=0"])
def test_report_breakdown_adds_up_to_the_step(spec: str) -> None:
    """Per step: compute + compression + communication = the step's time on the training thread; the
    compression share is the reducer's own timings (none for the plain allreduce)."""
    for out in run_threads(_timed, 2, spec, timeout=60):
        b = out["report"]["breakdown"]
        assert b["first_step"] == 0 and len(b["compute_s"]) == 3
        for k, wall in enumerate(out["walls"]):
            parts = [b[p][k] for p in ("compute_s", "compression_s", "comm_s")]
            assert min(parts) >= 0 and sum(parts) <= wall
            assert sum(parts) > 0.5 * wall
        if spec.startswith("compressed"):
            t = out["report"]["timings"]
            assert out["report"]["compressor"] == "fp16" and out["report"]["transport"] == "allreduce"
            assert t["units"] == 3 * 3 and t["compress_s"] > 0
            # the allreduce transport decodes on the thread that waits: all of it on the critical path
            assert t["decompress_inline_s"] == t["decompress_s"] > 0
            assert sum(b["compression_s"]) == pytest.approx(t["compress_s"] + t["decompress_s"])
            assert (
                out["label"]
                == "compressed(compressor=fp16, reducer=allreduce, memory=residual, bucket_mb=0.0)"
            )
        else:
            assert b["compression_s"] == [0.0, 0.0, 0.0]


def _clock_after_load() -> dict[str, Any]:
    r = lowband.rank()
    s = make_strategy("compressed", model(), sgd, compressor="fp16")
    for k in range(2):
        s.train_step(lambda m, k=k: loss(m, r, k))
    ckpt = s.state_dict()
    t = make_strategy("compressed", model(), sgd, compressor="fp16")
    t.train_step(lambda m: loss(m, r, 9))
    t.load_state_dict(ckpt)
    t.train_step(lambda m: loss(m, r, 2))
    rep = t.report()["breakdown"]
    s.close()
    t.close()
    return rep


def test_breakdown_restarts_at_a_loaded_step() -> None:
    """The breakdown's values are indexed from ``first_step``: after loading a checkpoint of step 2
    the record starts again there (the bench matches values to its timed steps by index)."""
    for rep in run_threads(_clock_after_load, 2, timeout=60):
        assert rep["first_step"] == 2 and len(rep["compute_s"]) == 1
