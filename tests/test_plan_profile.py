"""The plan profile's whole-step timing: work a layer's hooks do not see (the loss, the root module's own
code) is counted, by scaling the layers to the timed step; a profile without such work is not scaled
down; the factor survives the JSON round trip; the training run's random streams are untouched."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import lowband
import lowband.plan.profile as profile_mod
from lowband.plan.profile import PlanProfile, profile_module


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 8))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)


def _profile(loss_fn: object, model: nn.Module) -> PlanProfile:
    lowband.init()
    try:
        return profile_module(
            model, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1), name="t", batch_size=16,  # type: ignore[arg-type]
            repeats=3,
        )  # fmt: skip
    finally:
        lowband.shutdown()


def test_work_outside_the_layers_is_counted() -> None:
    x, y = _batch()

    def slow_loss(m: nn.Module) -> torch.Tensor:
        time.sleep(0.02)  # outside every layer: no layer's hooks see it, the pass's wall time does
        return nn.functional.cross_entropy(m(x), y)

    prof = _profile(slow_loss, _model())
    assert prof.whole_step_fit >= 1.0
    assert prof.compute_s >= 0.02
    again = PlanProfile.from_json(prof.to_json())
    assert again.whole_step_fit == prof.whole_step_fit
    assert again.compute_s == prof.compute_s


def test_a_whole_step_longer_than_the_layers_scales_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work a profiled pass does not hold (the loop's own code, a whole step's allocations): the whole
    step's time, less the optimizer step, is what the layers are scaled to."""
    x, y = _batch()
    plain = _profile(lambda m: nn.functional.cross_entropy(m(x), y), _model())
    whole = 3.0 * plain.compute_s + plain.step_s

    monkeypatch.setattr(profile_mod, "whole_step_seconds", lambda *a, **k: whole)
    prof = _profile(lambda m: nn.functional.cross_entropy(m(x), y), _model())
    layers = sum(lc.fwd + lc.bwd for lc in prof.cost.layers)
    assert prof.whole_step_fit > 1.0
    assert layers == pytest.approx(whole - prof.step_s, rel=1e-9)


def test_layers_never_scaled_down_and_rng_untouched() -> None:
    x, y = _batch()
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    prof = _profile(lambda m: nn.functional.cross_entropy(m(x), y), model)
    assert prof.whole_step_fit >= 1.0
    assert torch.equal(torch.rand(4), expected)  # the dropout draws of the profile were forked away
    for k, v in model.state_dict().items():  # stepped on a copy
        assert torch.equal(v, before[k]), k
