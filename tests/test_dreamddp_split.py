"""DreamDDP with layers split into chunks (lowband.localsgd.units): the unit profile, the auto choice,
and distributed runs against a single-process Algorithm 1 that averages the scheduled flat ranges."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from oracle import WORLD_SIZES
from test_dreamddp import OPTS, H, R, _batch, _flat, _loss, _mlp, _profile, _seeded
from torch import nn

import lowband
from lowband.errors import InvalidArgumentError
from lowband.localsgd import CostProfile, make_schedule
from lowband.localsgd.costmodel import period_time
from lowband.localsgd.strategy import PartialSyncStrategy
from lowband.localsgd.units import (
    MIN_AUTO_CHUNK,
    auto_candidates,
    chunk_bounds,
    layer_geometry,
    plan_units,
    unit_profile,
    unit_tensors,
)
from lowband.optim import parameter_layers
from lowband.strategies import make_strategy
from lowband.testing import run_threads

ATOL = 1e-9


@pytest.mark.parametrize("numel", [1, 7, 100, 1001])
@pytest.mark.parametrize("max_bytes", [0, 4, 24, 400, 10**6])
def test_chunk_bounds_partition(numel: int, max_bytes: int) -> None:
    b = chunk_bounds(numel, 4, max_bytes)
    assert b[0][0] == 0 and b[-1][1] == numel
    assert all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))
    sizes = [e - s for s, e in b]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1  # near-equal
    if max_bytes <= 0 or numel * 4 <= max_bytes:
        assert len(b) == 1
    else:
        assert max(sizes) * 4 <= max(max_bytes, 4) and len(b) == min(numel, math.ceil(numel * 4 / max_bytes))


def _cnn_like() -> CostProfile:
    """A CNN-like profile: compute-heavy small convs, then one fully connected layer with most bytes."""
    nb = [4_000, 80_000, 2_000_000, 5_000]
    return CostProfile(
        tuple(
            CostProfile.from_lists(
                [4e-3, 8e-3, 1e-3, 1e-4], [8e-3, 16e-3, 2e-3, 2e-4], [1e-3 + 1.2e-7 * b for b in nb],
                names=["conv1", "conv2", "fc1", "fc2"], nbytes=nb,
            ).layers
        ),
        alpha=1e-3,
        beta=1.2e-7,
    )  # fmt: skip


def test_unit_profile_preserves_times_and_bytes() -> None:
    prof = _cnn_like()
    numels = [lc.nbytes // 4 for lc in prof.layers]
    assert unit_profile(prof, plan_units(prof, numels, [4] * 4, 0)) == prof  # whole layers: the paper's
    specs = plan_units(prof, numels, [4] * 4, 300_000)
    up = unit_profile(prof, specs)
    assert [u.name for u in specs][2:9] == [f"fc1[{k}/7]" for k in range(7)]
    assert sum(lc.nbytes for lc in up.layers) == sum(lc.nbytes for lc in prof.layers)
    assert up.fwd_total == pytest.approx(prof.fwd_total) and up.bwd_total == pytest.approx(prof.bwd_total)
    fc1 = [i for i, u in enumerate(specs) if u.layer == "fc1"]
    # every chunk of fc1 is ready when fc1's backward ends; its forward waits for all of them
    assert len({up.bwd_ends[i] for i in fc1}) == 1 and up.bwd_ends[fc1[0]] == prof.bwd_ends[2]
    assert [up.layers[i].fwd for i in fc1] == [0.0] * 6 + [prof.layers[2].fwd]
    for i in fc1:
        assert up.layers[i].comm == pytest.approx(prof.alpha + prof.beta * up.layers[i].nbytes)
    with pytest.raises(InvalidArgumentError, match="has 4 layers, got 3 element counts"):
        plan_units(prof, numels[:3], [4] * 4, 0)


def test_splitting_shortens_the_predicted_period_of_a_one_big_layer_model() -> None:
    prof = _cnn_like()
    numels = [lc.nbytes // 4 for lc in prof.layers]
    whole = make_schedule("dreamddp", prof, 5)
    cands = auto_candidates(sum(lc.nbytes for lc in prof.layers), 5)
    assert cands[0] == 0 and all(c >= MIN_AUTO_CHUNK for c in cands[1:]) and len(cands) == 4
    best = min(
        make_schedule(
            "dreamddp", unit_profile(prof, plan_units(prof, numels, [4] * 4, c)), 5
        ).predicted_period
        for c in cands[1:]
    )
    assert best < 0.8 * whole.predicted_period
    assert whole.predicted_period == pytest.approx(period_time(prof, whole.sets))


def test_unit_tensors_are_views_of_the_parameters() -> None:
    lin = nn.Linear(3, 4)
    ps = list(lin.parameters())
    assert layer_geometry(ps) == (16, 4)
    views = unit_tensors(ps, 10, 14)  # weight[10:12] and bias[0:2]
    assert [v.numel() for v in views] == [2, 2]
    for v in views:
        v.fill_(7.0)
    flat = torch.cat([p.detach().reshape(-1) for p in ps])
    assert flat[10:14].eq(7.0).all() and not flat[:10].eq(7.0).any() and not flat[14:].eq(7.0).any()
    assert layer_geometry([torch.zeros(2), torch.zeros(2, dtype=torch.float64)]) == (4, 0)


def _run_split(opt: str, steps: int, split: Any, **extra: Any) -> tuple[PartialSyncStrategy, nn.Module]:
    m = _mlp()
    s = make_strategy("dreamddp", m, OPTS[opt], period=H, profile=_profile("mlp", 4e-3), split=split, **extra)
    assert isinstance(s, PartialSyncStrategy)
    r = lowband.rank()
    for k in range(steps):
        batch = _batch(r, k)
        s.train_step(lambda mod, b=batch: _loss(mod, b))
    s.synchronize()
    return s, m


def oracle_units(opt: str, n: int, sets: Any, units: list[list[Any]], steps: int) -> list[torch.Tensor]:
    """Algorithm 1 over units: after each local step, average elements [start, stop) of each scheduled
    unit's layer (its parameters flattened and concatenated)."""
    models = [_mlp() for _ in range(n)]
    opts = [OPTS[opt](m.parameters()) for m in models]
    layers = [dict(parameter_layers(m)) for m in models]
    for step in range(steps):
        for k in range(n):
            opts[k].zero_grad()
            _loss(models[k], _batch(k, step)).backward()  # type: ignore[no-untyped-call]
            opts[k].step()
        with torch.no_grad():
            for u in sets[step % len(sets)]:
                layer, start, stop = units[u]
                flats = [torch.cat([p.reshape(-1) for p in lay[layer]]) for lay in layers]
                mean = torch.stack(flats).mean(0)
                for lay, f in zip(layers, flats):
                    f[start:stop] = mean[start:stop]
                    off = 0
                    for p in lay[layer]:
                        p.copy_(f[off : off + p.numel()].view_as(p))
                        off += p.numel()
    return [_flat(m) for m in models]


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("opt", ["sgdm", "adam"])
def test_split_matches_algorithm1_over_units(n: int, opt: str) -> None:
    def rank_fn() -> dict[str, Any]:
        s, m = _run_split(opt, R, 200)  # float64: layers over 25 elements are cut
        assert s.schedule is not None
        rep = s.report()
        return {"params": _flat(m), "sets": s.schedule.sets, "units": rep["units"], "names": rep["layers"],
                "max_gap": list(s.averager.max_gap), "counts": list(s.averager.launch_counts),
                "split": rep["split_bytes"]}  # fmt: skip

    res = run_threads(rank_fn, n, timeout=120)
    sets, units = res[0]["sets"], res[0]["units"]
    assert res[0]["split"] == 200 and len(units) > 4  # the three large layers were cut
    assert any("[" in nm for nm in res[0]["names"])
    want = oracle_units(opt, n, sets, units, R)
    for r in range(n):
        assert res[r]["sets"] == sets and res[r]["units"] == units
        err = float((res[r]["params"] - want[r]).abs().max())
        assert err < ATOL, f"rank {r}: parameters differ from Algorithm 1 over units by {err}"
        assert max(res[r]["max_gap"]) <= H and min(res[r]["max_gap"]) >= 1  # every unit once per H
        assert sum(res[r]["counts"]) == sum(len(sets[k % H]) for k in range(R))


def test_auto_split_keeps_whole_layers_for_small_models_and_resume_restores_units() -> None:
    cut = 4

    def rank_fn() -> dict[str, Any]:
        r = lowband.rank()
        auto, _ = _run_split("sgdm", 1, "auto")
        _, m = _run_split("adam", R, 300)
        s2, _ = _run_split("adam", cut, 300)
        buf = io.BytesIO()
        torch.save(s2.state_dict(), buf)
        buf.seek(0)
        layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4), nn.Linear(4, 2)]
        m3 = _seeded(nn.Sequential(*layers), 99 + r)
        s3 = make_strategy("dreamddp", m3, OPTS["adam"])  # split not given: the checkpoint's units
        assert isinstance(s3, PartialSyncStrategy)
        s3.load_state_dict(torch.load(buf, weights_only=True))
        restored = s3.averager.specs == s2.averager.specs and s3.schedule == s2.schedule
        for k in range(cut, R):
            batch = _batch(r, k)
            s3.train_step(lambda mod, b=batch: _loss(mod, b))
        s3.synchronize()
        return {"auto": auto.split_bytes, "auto_units": auto.averager.n, "restored": restored,
                "same": torch.equal(_flat(m), _flat(m3))}  # fmt: skip

    for out in run_threads(rank_fn, 2, timeout=120):
        assert out["auto"] == 0 and out["auto_units"] == 4  # 200-byte layers: nothing worth cutting
        assert out["restored"] and out["same"]


def test_bad_split_and_bad_checkpoint_units() -> None:
    def rank_fn() -> list[str]:
        errs = []
        for bad in (-1, "big", 1.5, True):
            try:
                make_strategy("dreamddp", _mlp(), OPTS["sgd"], split=bad)
                errs.append("no error")
            except InvalidArgumentError as e:
                errs.append(str(e))
        s, _ = _run_split("sgd", 1, 200)
        sd = s.state_dict()
        sd["extra"]["units"] = sd["extra"]["units"][:-1]  # a layer no longer covered
        try:
            s.load_state_dict(sd)
            errs.append("no error")
        except InvalidArgumentError as e:
            errs.append(str(e))
        return errs

    errs = run_threads(rank_fn, 1)[0]
    for e in errs[:4]:
        assert "split must be 'auto' or a chunk size in bytes >= 0" in e, e
    assert "do not cover the model's layers" in errs[4], errs[4]
