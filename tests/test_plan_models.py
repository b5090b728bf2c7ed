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
    compressor 1 ms to compress, 0.5 ms to decompress, 1 % of the bytes; a sketch 1 ms, its recovery 0.5 ms."""

    def powersgd(self, shapes: tuple[tuple[int, int], ...], rank: int) -> float:
        return 0.5 * MS

    def compressor(self, spec: str, numel: int) -> CompressorCost:
        if spec == "identity":
            return CompressorCost(0.0, 0.0, numel * 4)
        return CompressorCost(1 * MS, 0.5 * MS, numel * 4 // 100)

    def sketch(self, numel: int, rows: int, cols: int, m: int) -> tuple[float, float]:
        return 1 * MS, 0.5 * MS


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
    assert predict_spec("compressed:compressor=topk:ratio=0.01,reducer=twostage", profile(), LINKS) is None


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
    assert predict_spec("hierarchical-atc", profile(), LINKS) is None  # the protocol's default
    assert predict_spec("ddp-sparse", profile(), LINKS) is None  # overridden: sparse gradients
    assert predict_spec("ddp:accumulate=2", profile(), LINKS) is None  # the models are of one pass per step
    plan = make_plan(["slimgc", "ddp", "localsgd:period=5", "powersgd:rank=2"], profile(), LINKS)
    assert [e.spec for e in plan] == ["localsgd:period=5", "powersgd:rank=2", "ddp", "slimgc"]
    assert recommend(plan, Acceptance()) == "localsgd:period=5"
    assert recommend(plan, Acceptance(max_local_steps=1)) == "powersgd:rank=2"
    assert recommend(plan, Acceptance(max_local_steps=1, max_compression=1)) == "ddp"
    assert plan[-1].to_json() == {"spec": "slimgc", "predicted_ms": None, "model": False}


# -- the decentralised strategies, gs-SGD and parameter servers ------------------------------------------
def gossip(nbytes: float, peers: int = 1) -> float:
    return peers * nbytes / 12.5e6


def test_atc_combinations_wait_for_the_next_forward() -> None:
    # dynamic-exp2: one copy per layer; layer1's starts when its backward ends (6 ms), layer0's after it
    # (8 ms, queued behind): done at 6 ms + 320 + 80 ms; the next step's layer0 forward (at 9 ms) stalls
    done = 6 * MS + gossip(4e6) + gossip(1e6)
    p = check(predict_spec("atc", profile(), LINKS), 9 * MS + done - 9 * MS, done - 9 * MS, 5e6)
    assert p.flags == {}
    exp2 = predict_spec("atc:topology=exp2", profile(), LINKS)  # two copies at once at 4 ranks
    assert exp2 is not None and exp2.bytes_per_step == pytest.approx(2 * 5e6)
    assert exp2.comm_s == pytest.approx(6 * MS + 2 * gossip(5e6) - 9 * MS)
    h = predict_spec("atc:period=5", profile(), LINKS)
    assert h is not None and h.comm_s == pytest.approx(p.comm_s / 5) and h.local_steps == 5


def test_awc_combinations_start_in_forward() -> None:
    # layer0's from 0 ms, layer1's from 1 ms queued behind it: done at 400 ms, waited after backward (8 ms)
    done = gossip(1e6) + gossip(4e6)
    check(predict_spec("awc", profile(), LINKS), 9 * MS + done - 8 * MS, done - 8 * MS, 5e6)
    # every second communication a ring allreduce of each layer instead: averaged
    ar_done = max(ar(1e6), 1 * MS) + ar(4e6)
    q = check(
        predict_spec("awc:allreduce_every=2", profile(), LINKS), 9 * MS + (done + ar_done) / 2 - 8 * MS,
        (done + ar_done) / 2 - 8 * MS, (5e6 + 1.5 * 5e6) / 2,
    )  # fmt: skip
    assert q.flags == {}


def test_winput_puts_overlap_backward_only() -> None:
    # exp2 at 4 ranks: two out-neighbors; each tensor put after the forward, waited after backward
    puts = gossip(1e6, 2) + gossip(4e6, 2)
    check(predict_spec("winput", profile(), LINKS), 9 * MS + puts - 6 * MS, puts - 6 * MS, 2 * 5e6)
    ring = predict_spec("winput:topology=ring", profile(), LINKS.at(64))
    assert ring is not None and ring.bytes_per_step == pytest.approx(2 * 5e6)  # 2 peers at any size


def test_gradient_allreduce_is_ddp_with_a_bucket_per_layer() -> None:
    end = 4 * MS + ar(4e6) + ar(1e6)
    check(predict_spec("gradient-allreduce", profile(), LINKS), 3 * MS + end, end - 6 * MS, 1.5 * 5e6)


def test_gs_sgd_tree_of_sketches() -> None:
    # buckets {layer1} (d = 1e6) and {layer0} (d = 250,000); density 0.01: k = 10,000 and 2,500, sketches of
    # 5 x 10 k float32; 2 ceil(log2 4) = 4 rounds each, then an allreduce of the k exact values
    t1, t0 = 5 * 100_000 * 4, 5 * 25_000 * 4
    comm = 4 * (t1 + t0) / 12.5e6 + ar(40_000) + ar(10_000)
    sent = 1.5 * (t1 + t0) + 1.5 * (40_000 + 10_000)
    p = check(predict_spec("gs-sgd", profile(), LINKS), 9 * MS + 3 * MS + comm, comm, sent, compress=3 * MS)
    assert p.compression == pytest.approx(5e6 / (t1 + t0 + 50_000))
    q = predict_spec("gs-sgd:reduce=allreduce", profile(), LINKS)
    assert q is not None and q.comm_s == pytest.approx(ar(t1) + ar(t0) + ar(40_000) + ar(10_000))
    one = predict_spec("gs-sgd", profile(), Links(1, 12.5e6))
    assert one is not None and one.comm_s == 0 and one.bytes_per_step == 0


def test_compressed_over_parameter_servers() -> None:
    # per bucket: 4 shards compressed (1 ms each) and 8 decodes (0.5 ms), an all-to-all of 3 payloads of
    # 1 % of a shard, backward stalled for it; then the allgather of the float32 shards, overlapped
    s1 = 8 * MS + 3 * 10_000 / 12.5e6
    s0 = 8 * MS + 3 * 2_500 / 12.5e6
    end = max(2 * MS + 4 * MS + s1 + 3 * 250_000 * 4 / 12.5e6, 2 * MS + 6 * MS + s1 + s0)
    end += 3 * 62_500 * 4 / 12.5e6
    exposed = s1 + s0 + end - (2 * MS + 6 * MS + s1 + s0)
    check(
        predict_spec("compressed:compressor=fp16,reducer=ps", profile(), LINKS), 9 * MS + exposed,
        exposed - 16 * MS, 3 * (10_000 + 2_500) + 3 * (250_000 + 62_500) * 4, compress=16 * MS,
    )  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [
        "atc",
        "awc",
        "atc:topology=exp2",
        "winput",
        "gradient-allreduce",
        "gs-sgd",
        "compressed:compressor=fp16,reducer=ps",
    ],
)
def test_new_models_never_negative_and_free_at_one_rank(spec: str) -> None:
    for n in (1, 2, 3, 5, 64, 1024):
        p = predict_spec(spec, profile(), LINKS.at(n))
        assert p is not None
        assert min(p.comm_s, p.compress_s, p.bytes_per_step) >= 0
        assert p.iteration_s >= p.compute_s
        if n == 1 and spec != "gs-sgd" and "ps" not in spec:
            assert p.iteration_s == pytest.approx(p.compute_s) and p.bytes_per_step == 0


def test_unmodelled_topologies() -> None:
    assert predict_spec("atc:topology=inner-outer-exp2", profile(), LINKS) is None
    assert predict_spec("hierarchical-atc", profile(), LINKS) is None


def test_measured_interference_is_counted_by_the_overlap_models() -> None:
    from lowband.plan.overlap import overlapped_exposed

    quiet = profile()
    cost = quiet.cost.with_interference(2.0, 2.0)  # computation and averaging each 3x slower together
    loud = PlanProfile("synthetic", 8, cost, quiet.shapes, quiet.elem_sizes, quiet.step_s, FixedOps())
    buckets = [[0], [1]]
    for bw in (12.5e6, 125e6):
        links = Links(4, bw)
        a = overlapped_exposed(
            quiet.cost, buckets, lambda k, ln=links: ln.allreduce(quiet.cost.layers[k].nbytes)
        )
        b = overlapped_exposed(cost, buckets, lambda k, ln=links: ln.allreduce(cost.layers[k].nbytes))
        assert b > a
    for spec in ("ddp", "dreamddp:period=5"):
        p, q = predict_spec(spec, quiet, LINKS), predict_spec(spec, loud, LINKS)
        assert p is not None and q is not None and q.iteration_s > p.iteration_s
    # what lowband plan writes and auto saves carries it
    back = PlanProfile.from_json(loud.to_json())
    assert (back.cost.kappa, back.cost.sigma) == (2.0, 2.0)


def test_near_ties_go_to_the_fewest_bytes() -> None:
    from lowband.plan.planner import Entry

    def entry(spec: str, ms: float, sent: float) -> Entry:
        h = 20 if "period=20" in spec else 1
        return Entry(spec, Prediction.of(ms / 1e3, 0.0, 0.0, sent, local_steps=h))

    gossip, local, slow = (
        entry("atc", 71.2, 4e6),
        entry("localsgd:period=20", 72.7, 1.6e5),
        entry("x", 80.0, 0),
    )
    plan = [gossip, local, slow]
    assert recommend(plan, Acceptance()) == "localsgd:period=20"  # 2 % slower, 25x fewer bytes
    assert recommend(plan, Acceptance(), tie=0.0) == "atc"
    assert recommend([gossip, slow], Acceptance()) == "atc"  # 12 % is no tie
    equal = entry("dreamddp:period=20", 72.0, 1.6e5)
    assert recommend([gossip, equal, local], Acceptance()) == "dreamddp:period=20"  # the first of equals
    assert recommend([gossip, local], Acceptance(max_local_steps=1)) == "atc"
