"""DreamDDP's online choice among schedules the cost model cannot tell apart (lowband.localsgd.trials):
the pure bookkeeping and decisions, the robustness property issue 30 asks for (two noisy profiles of one
model on one machine never end in schedules whose measured times differ by more than 10 %), and the
strategy measuring its contenders on thread ranks, switching schedules at period boundaries, against a
single-process simulation of Algorithm 1 with the units each step averaged."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.errors import InvalidArgumentError
from lowband.localsgd.costmodel import CostProfile, LayerCost
from lowband.localsgd.runtime import LayerAverager
from lowband.localsgd.trials import MISMATCH, ScheduleTrial, contender_pair, contenders, decide
from lowband.localsgd.units import UnitSpec, candidate_splits, plan_units, unit_profile
from lowband.strategies import make_strategy
from lowband.testing import run_threads

# -- pure ----------------------------------------------------------------------------------------


def test_contenders_and_decide() -> None:
    assert contenders([1.0, 1.2, 1.3, 0.9], margin=0.25) == [3, 0]
    assert contenders([1.0], margin=0.25) == [0]
    assert contenders([2.0, 1.0, 1.0], margin=0.0) == [1, 2]  # ties: all of them, the first as best
    with pytest.raises(InvalidArgumentError):
        contenders([])
    assert decide([1.0, 0.5]) == 1
    assert decide([1.0, 0.98]) == 0  # within the tie: the predicted best stays
    assert decide([1.0, 1.5, 0.7]) == 2
    # the pair: the predicted best and the best of the other kind (whole layers = limit 0) within margin
    assert contender_pair([0, 400, 200, 100], [1.1, 1.0, 1.02, 1.3]) == [1, 0]
    assert contender_pair([0, 400, 200], [1.0, 1.1, 1.05]) == [0, 2]
    assert contender_pair([0, 400], [1.0, 2.0]) == [0]  # the other kind predicted far slower
    assert contender_pair([400, 200], [1.0, 1.01]) == [0]  # no other kind


def test_trial_drops_pauses_and_fills_what_it_lost() -> None:
    """A step that took a pause (an evaluation, another job's round) in one of a contender's periods is
    dropped by the minimum; an iteration left without a sample counts the other contenders' figure for it
    (neither wins nor loses by it)."""
    t = ScheduleTrial(2, 2, 2)
    for c0_first in (9.0, 1.4):  # contender 0, iteration 0: a pause, then its real time
        t.record(0, c0_first)
        t.record(1, 1.0)
        t.advance()
        t.record(1, 1.2)  # contender 1: iteration 0 never recorded (the step after a switch, say)
        t.advance()
    assert t.current() is None
    assert t.measured() == [1.4 + 1.0, 1.4 + 1.2]


def test_a_slow_step_every_period_is_the_schedule_s_own_time() -> None:
    """A schedule that averages a whole large layer in one iteration is slow there in every period: that
    step is its cost, not a pause (it was dropped as an outlier before, and a whole-layer schedule then
    measured faster than its chunked rival and lost 25 % in training). So is the wait at the period's end
    for averagings still in flight."""
    t = ScheduleTrial(2, 5, 2)
    for _ in range(2):
        for h in range(5):
            t.record(h, 0.35 + 0.05 if h == 4 else 0.07)  # whole layers: one heavy iteration + its tail
        t.advance()
        for h in range(5):
            t.record(h, 0.11)  # chunks: spread evenly
        t.advance()
    got = t.measured()
    assert got[0] == pytest.approx(4 * 0.07 + 0.35 + 0.05) and got[1] == pytest.approx(5 * 0.11)
    assert decide(got) == 1


def test_trial_bookkeeping_and_json() -> None:
    t = ScheduleTrial(2, 3, 2)
    seen = []
    for period in range(4):
        c = t.current()
        seen.append(c)
        for h in range(3):
            t.record(h, (1.0 if c == 0 else 2.0) + (5.0 if (period, h) == (2, 1) else 0.0))  # one pause
        nxt = t.advance()
        if period < 3:
            assert nxt is not None
    assert seen == [0, 1, 0, 1] and t.current() is None and t.advance() is None
    assert t.measured() == [3.0, 6.0]  # the pause (period 2, iteration 1) dropped by the minimum
    back = ScheduleTrial.from_json(t.to_json())
    assert back == t
    with pytest.raises(InvalidArgumentError):
        ScheduleTrial(0, 3)
    with pytest.raises(InvalidArgumentError):
        ScheduleTrial.from_json({"n": 2, "period": 3, "periods_each": 1, "done": 0, "samples": [[[]]]})


# -- the property: profiles that differ within their uncertainty end in equally fast schedules ------


def _cnn_like(kappa: float, sigma: float, noise: random.Random) -> CostProfile:
    """A demo-CNN-like profile (one fully connected layer holds most of the bytes), its timings jittered
    by ``noise`` (+-10 %, the latency 1-12 ms) as two profiles of one model on one machine are."""
    shapes = [("conv1", 800, 0.008, 0.016), ("conv2", 51_000, 0.008, 0.016), ("fc1", 2_000_000, 0.003, 0.006),
              ("fc2", 5_000, 0.001, 0.002)]  # fmt: skip
    # ~100 Mbit/s ring allreduce at 4 ranks; the per-message latency of a fit on oversubscribed cores
    # (a 4 ms scheduler tick) is the noisiest part of the profile
    alpha, beta = noise.uniform(1e-3, 12e-3), 1.2e-7
    layers = []
    for name, nb, f, b in shapes:
        j = 1.0 + noise.uniform(-0.1, 0.1)
        layers.append(LayerCost(name, f * j, b * j, alpha + beta * nb, nb))
    return CostProfile(tuple(layers), alpha, beta, kappa, sigma)


def _plan(profile: CostProfile) -> Callable[[int], list[UnitSpec]]:
    numels = [lc.nbytes // 4 for lc in profile.layers]
    return lambda c: plan_units(profile, numels, [4] * len(numels), c)


#: the "machine": what a candidate really takes per period. The truth is the event model at one fixed
#: interference plus a structural error the model does not know (whole layers 33 % slower, as measured
#: on the demo), so no single profile predicts it.
TRUE = _cnn_like(0.36, 0.54, random.Random(0))


def _true_period(split: int, H: int) -> float:
    from lowband.localsgd.schedulers import make_schedule

    units = _plan(TRUE)(split)
    p = make_schedule("dreamddp", unit_profile(TRUE, units), H).predicted_period
    return p * (1.33 if split == 0 else 1.0)


def _final_choice(profile: CostProfile, H: int, *, online: bool, noise: random.Random) -> int:
    """The split one run keeps: the predicted best (``online=False``) or the trial's winner."""
    cands = candidate_splits(profile, _plan(profile), H, "auto", "dreamddp")
    order = contender_pair([c for c, _ in cands], [s.predicted_period for _, s in cands])
    if not online or len(order) == 1:
        return cands[order[0]][0]
    trial = ScheduleTrial(len(order), H)
    while (c := trial.current()) is not None:
        per_step = _true_period(cands[order[c]][0], H) / H
        for h in range(H):
            trial.record(h, per_step * (1.0 + noise.uniform(0.0, 0.08)))  # the machine's noise
        trial.advance()
    return cands[order[decide(trial.measured())]][0]


# kappa/sigma of five demo profiles on one machine (issue 30's table)
FITS = [(0.03, 3.40), (0.63, 0.45), (0.36, 0.54), (0.32, 0.17), (0.00, 0.48)]


@pytest.mark.parametrize("online", [True, False])
def test_two_profiles_never_end_in_schedules_whose_times_differ(online: bool) -> None:
    """Issue 30's 'done means': two profiles of one model on one machine must not lead to different
    schedules whose predicted times differ by less than the profile's uncertainty while their measured
    times differ by more than 10 %. Prediction alone (online=False) fails it; the trials pass it."""
    H = 5
    bad = []
    for i, (k1, s1) in enumerate(FITS):
        for k2, s2 in FITS[i + 1 :]:
            for seed in range(3):
                noise = random.Random(seed)
                a = _final_choice(_cnn_like(k1, s1, noise), H, online=online, noise=noise)
                b = _final_choice(_cnn_like(k2, s2, noise), H, online=online, noise=noise)
                ta, tb = _true_period(a, H), _true_period(b, H)
                if a != b and abs(ta - tb) / min(ta, tb) > 0.10:
                    bad.append(((k1, s1), (k2, s2), seed, a, b, round(ta, 4), round(tb, 4)))
    if online:
        assert not bad, f"profiles ended in schedules >10 % apart: {bad[:3]}"
    else:
        assert bad, "the prediction alone should have been fooled here (else this test shows nothing)"


# -- the strategy on thread ranks ----------------------------------------------------------------


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(5)
    m = nn.Sequential(nn.Linear(12, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 3)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return m


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 12, generator=g, dtype=torch.float64), torch.randn(
        4, 3, generator=g, dtype=torch.float64
    )


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((m(b[0]) - b[1]) ** 2).mean()


def _oracle(n: int, steps: int, averaged: Sequence[Sequence[tuple[str, int, int]]]) -> list[torch.Tensor]:
    """Algorithm 1 with per-layer SGD: K copies, each its rank's batches; after step k the element ranges
    ``averaged[k]`` ((layer, start, stop) of the layer's flattened parameters) averaged over the copies."""
    copies = [_model() for _ in range(n)]
    opts = [torch.optim.SGD(c.parameters(), lr=0.1) for c in copies]
    layers = [dict((name, list(mod.parameters())) for name, mod in c.named_children() if list(mod.parameters()))
              for c in copies]  # fmt: skip
    for k in range(steps):
        for r in range(n):
            opts[r].zero_grad()
            _loss(copies[r], _batch(r, k)).backward()  # type: ignore[no-untyped-call]
            opts[r].step()
        with torch.no_grad():
            for layer, start, stop in averaged[k]:
                flats = [torch.cat([p.reshape(-1) for p in layers[r][layer]]) for r in range(n)]
                mean = torch.stack([f[start:stop] for f in flats]).mean(0)
                for r in range(n):
                    off = 0
                    for p in layers[r][layer]:
                        a, b = max(start, off), min(stop, off + p.numel())
                        if a < b:
                            p.view(-1)[a - off : b - off] = mean[a - start : b - start]
                        off += p.numel()
    return [torch.cat([p.detach().reshape(-1) for p in c.parameters()]) for c in copies]


@pytest.mark.parametrize("n", [2, 3])
def test_strategy_measures_contenders_and_matches_algorithm1(n: int, monkeypatch: Any) -> None:
    """With every candidate a contender (margin widened), the strategy runs each for two periods,
    switches units at period boundaries, keeps one chosen from the slowest rank's measurements on every
    rank alike, and its parameters equal Algorithm 1 with the units each step averaged."""
    monkeypatch.setattr("lowband.localsgd.rescheduling.MODEL_ERROR", 1e9)
    H, steps = 3, 30

    def rank_fn() -> dict[str, Any]:
        m = _model()
        s = make_strategy("dreamddp", m, lambda ps: torch.optim.SGD(ps, lr=0.1), period=H)
        log: dict[int, list[tuple[str, int, int]]] = {}
        av: LayerAverager = s.averager  # type: ignore[attr-defined]
        begin = av.begin

        def spy(step: int, units: Sequence[int]) -> None:  # the last call of a step is the real one
            log[step] = [(av.specs[u].layer, av.specs[u].start, av.specs[u].stop) for u in units]
            begin(step, units)

        av.begin = spy  # type: ignore[method-assign]
        for k in range(steps):
            s.train_step(lambda mod, k=k: _loss(mod, _batch(lowband.rank(), k)))
        s.synchronize()
        rep = s.report()
        return {"log": [log[k] for k in range(steps)], "params": torch.cat([p.detach().reshape(-1) for p in m.parameters()]),
                "trials": rep["trials"], "candidates": rep["candidates"], "split": rep["split_bytes"],
                "reschedules": rep["reschedules"]}  # fmt: skip

    res = run_threads(rank_fn, n, timeout=180)
    cands = res[0]["candidates"]
    assert len(cands) >= 2, f"the model should give several candidate splits, got {cands}"
    tr = res[0]["trials"]
    assert len(tr[0]["splits"]) == len(cands) and tr[0]["step"] == 2 * H * len(cands)
    # a winner measured off its prediction by more than MISMATCH: the links re-measured once, and one
    # more trial only if that changed the contenders (here the tiny model's step is mostly Python
    # overhead the model does not know, so the links are re-measured)
    off = abs(tr[0]["measured_over_predicted"] - 1.0) > MISMATCH
    assert res[0]["reschedules"] == int(off) and len(tr) <= 1 + int(off)
    if len(tr) == 2:
        assert tr[1]["step"] == 2 * tr[0]["step"] and tr[1]["splits"] != tr[0]["splits"]
    for r in range(n):  # one decision, from the same (slowest-rank) numbers, on every rank
        assert res[r]["trials"] == tr and res[r]["split"] == tr[-1]["chosen"]
        assert res[r]["log"] == res[0]["log"]
    log = res[0]["log"]
    used = {tuple(sorted({stop - start for _, start, stop in entry})) for entry in log if entry}
    assert len(used) >= 2, "the trial switched units (chunk sizes) between periods"
    want = _oracle(n, steps, log)
    for r in range(n):
        err = float((res[r]["params"] - want[r]).abs().max())
        assert err < 1e-9, f"rank {r}: parameters differ from Algorithm 1 by {err}"
