"""Each strategy's cost model (Strategy.predict) on a synthetic two-layer profile, by hand.

The profile, forward order: layer0 (1-D, 250,000 float32 = 1 MB; fwd 1 ms, bwd 2 ms) and layer1 (a
1000 x 1000 matrix, 4 MB; fwd 1 ms, bwd 4 ms); optimizer step 1 ms. So compute = 9 ms, backward runs
layer1 (0-4 ms) then layer0 (4-6 ms). Links: 4 ranks at 100 Mbit/s = 12.5 MB/s, no latency, so a ring
allreduce of B bytes takes 6 * (B / 4) / 12.5e6 s and sends 1.5 B.
"""

from __future__ import annotations

import pytest

from lowband.localsgd.costmodel import CostProfile
from lowband.plan.links import Links
from lowband.plan.planner import Acceptance, make_plan, predict_spec, recommend
from lowband.plan.prediction import Prediction
from lowband.plan.profile import CompressorCost, OpCosts, PlanProfile

MS = 1e-3


class FixedOps(OpCosts):
    """Operation costs fixed by the test: PowerSGD's products 0.5 ms per bucket; identity free; any other
    compressor 1 ms to compress, 0.5 ms to decompress, 1 % of the bytes."""

    def powersgd(self, shapes: tuple[tuple[int, int], ...], rank: int) -> float:
        return 0.5 * MS

    def compressor(self, spec: str, numel: int) -> CompressorCost:
        if spec == "identity":
            return CompressorCost(0.0, 0.0, numel * 4)
        return CompressorCost(1 * MS, 0.5 * MS, numel * 4 // 100)


def profile() -> PlanProfile:
    cost = CostProfile.from_lists(
        [1 * MS, 1 * MS],
        [2 * MS, 4 * MS],
        [0.0, 0.0],
        names=["layer0", "layer1"],
        nbytes=[1_000_000, 4_000_000],
    )
    return PlanProfile("synthetic", 8, cost, (((250_000,),), ((1000, 1000),)), (4, 4), 1 * MS, FixedOps())


LINKS = Links(4, 12.5e6)


def ar(nbytes: float) -> float:
    return 6 * nbytes / 4 / 12.5e6


def check(
    p: Prediction | None, iteration: float, comm: float, sent: float, compress: float = 0.0
) -> Prediction:
    assert p is not None
    assert p.compute_s == pytest.approx(9 * MS, abs=2e-4)
    assert p.iteration_s == pytest.approx(iteration, rel=1e-6)
    assert p.comm_s == pytest.approx(comm, rel=1e-6, abs=1e-9)
    assert p.compress_s == pytest.approx(compress, rel=1e-6, abs=1e-9)
    assert p.bytes_per_step == pytest.approx(sent)
    assert p.iteration_s == pytest.approx(p.compute_s + p.compress_s + p.comm_s)
    return p


def test_ddp_buckets_overlap_backward() -> None:
    # buckets: {layer1} (4 MB >= DDP's 1 MiB first bucket) ready at 4 ms, {layer0} ready at 6 ms
    end = 4 * MS + ar(4e6) + ar(1e6)  # the link is busy from 4 ms on
    p = check(predict_spec("ddp", profile(), LINKS), 2 * MS + end + 1 * MS, end - 6 * MS, 1.5 * 5e6)
    assert p.flags == {}
    # fast links: the first bucket ends during layer0's backward, the second after it
    fast = Links(4, 1.25e9)
    end = 4 * MS + 6 * 1e6 / 1.25e9 + 6 * 0.25e6 / 1.25e9
    check(predict_spec("ddp", profile(), fast), 2 * MS + end + 1 * MS, end - 6 * MS, 1.5 * 5e6)
    # fp16 on the wire: half the bytes
    half = predict_spec("ddp:hook=fp16", profile(), LINKS)
    assert half is not None and half.bytes_per_step == pytest.approx(1.5 * 2.5e6) and half.compression == 2


def test_powersgd_p_and_q_per_matrix() -> None:
    # layer1 (1000 x 1000, rank 2): P and Q of 1000 * 2 floats, two allreduces + 0.5 ms of products;
    # layer0 is a vector: allreduced as is
    b1 = 0.5 * MS + 2 * ar(8000)
    end = max(4 * MS + b1, 6 * MS) + ar(1e6)
    exposed = end - 6 * MS
    p = check(
        predict_spec("powersgd:rank=2", profile(), LINKS), 9 * MS + exposed, exposed - 0.5 * MS,
        1.5 * (8000 + 8000 + 1e6), compress=0.5 * MS,
    )  # fmt: skip
    assert p.compression == pytest.approx(5e6 / (16000 + 1e6))
    r1 = predict_spec("powersgd:rank=1", profile(), LINKS)
    assert r1 is not None and r1.bytes_per_step == pytest.approx(1.5 * (8000 + 1e6))


def test_compressed_topk_allgather() -> None:
    # topk does not sum on the wire: allgather of 1 % of each unit; every rank decodes 4 payloads
    u1 = 1 * MS + 4 * 0.5 * MS + 3 * 40_000 / 12.5e6
    u0 = 1 * MS + 4 * 0.5 * MS + 3 * 10_000 / 12.5e6
    end = 4 * MS + u1 + u0
    exposed = end - 6 * MS
    p = check(
        predict_spec("compressed:compressor=topk:ratio=0.01", profile(), LINKS), 9 * MS + exposed,
        exposed - 6 * MS, 3 * 50_000, compress=6 * MS,
    )  # fmt: skip
    assert p.compression == pytest.approx(100)
    # a transport without a model
    assert predict_spec("compressed:compressor=topk:ratio=0.01,reducer=ps", profile(), LINKS) is None


def test_localsgd_amortises_one_allreduce() -> None:
    p = check(predict_spec("localsgd:period=5", profile(), LINKS), 9 * MS + ar(5e6) / 5, ar(5e6) / 5, 1.5e6)
    assert p.flags == {"local_steps": 5}


def test_flsgd_overlap_schedule() -> None:
    # DreamDDP's model, scheduler "full": H - 1 local iterations, then one averaging every layer,
    # each layer's allreduce starting when its backward ends (layer1 at 4 ms, layer0 queued after it)
    last = 2 * MS + max(6 * MS, 4 * MS + ar(4e6) + ar(1e6))
    period = 4 * 8 * MS + last
    check(
        predict_spec("flsgd-overlap:period=5", profile(), LINKS), period / 5 + 1 * MS,
        period / 5 + 1 * MS - 9 * MS, 1.5 * 5e6 / 5,
    )  # fmt: skip


def test_dreamddp_overlaps_at_least_as_well_as_localsgd() -> None:
    for h in (2, 5, 20):
        d = predict_spec(f"dreamddp:period={h}", profile(), LINKS)
        f = predict_spec(f"localsgd:period={h}", profile(), LINKS)
        assert d is not None and f is not None
        assert d.iteration_s <= f.iteration_s + 1e-9
        assert d.local_steps == h


def test_diloco_exchange_every_h_and_delay() -> None:
    p = check(
        predict_spec("diloco:inner_steps=10", profile(), LINKS), 9 * MS + 0.1 * MS + ar(5e6) / 10,
        ar(5e6) / 10, 1.5 * 5e6 / 10,
    )  # fmt: skip
    assert p.flags == {"local_steps": 10}
    # two fragments, each one step late: each exchange hides behind one inner step
    q = predict_spec("diloco:inner_steps=10,fragments=2,delay=1", profile(), LINKS)
    assert q is not None and q.staleness == 1
    hidden = q.compute_s - 0.1 * MS  # one inner step
    assert q.comm_s == pytest.approx((ar(2.5e6) - hidden) * 2 / 10)
    assert predict_spec("diloco:inner_steps=10,inner=ddp", profile(), LINKS) is None


def test_world_of_one_is_compute_only() -> None:
    one = Links(1, 12.5e6)
    for spec in ("ddp", "localsgd:period=5", "dreamddp:period=5", "flsgd-overlap:period=5"):
        p = predict_spec(spec, profile(), one)
        assert p is not None and p.comm_s == pytest.approx(0.0, abs=1e-12), spec
        assert p.bytes_per_step == 0


def test_no_model_and_ranking() -> None:
    assert predict_spec("atc", profile(), LINKS) is None  # the protocol's default
    assert predict_spec("ddp-sparse", profile(), LINKS) is None  # overridden: sparse gradients
    assert predict_spec("ddp:accumulate=2", profile(), LINKS) is None  # the models are of one pass per step
    plan = make_plan(["atc", "ddp", "localsgd:period=5", "powersgd:rank=2"], profile(), LINKS)
    assert [e.spec for e in plan] == ["localsgd:period=5", "powersgd:rank=2", "ddp", "atc"]
    assert recommend(plan, Acceptance()) == "localsgd:period=5"
    assert recommend(plan, Acceptance(max_local_steps=1)) == "powersgd:rank=2"
    assert recommend(plan, Acceptance(max_local_steps=1, max_compression=1)) == "ddp"
    assert plan[-1].to_json() == {"spec": "atc", "predicted_ms": None, "model": False}
