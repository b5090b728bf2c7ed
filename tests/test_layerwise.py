"""LayerwiseOptimizer: stepping layer by layer from backward hooks == one ordinary optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn

from lowband.errors import InvalidArgumentError
from lowband.optim import LayerwiseOptimizer, parameter_layers

Factory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

FACTORIES: dict[str, Factory] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


class Net(nn.Module):
    """Conv + MLP with an unused branch and a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.conv = nn.Conv1d(6, 4, 3, padding=1)
        self.fc = nn.Linear(4, 8)
        self.unused = nn.Linear(3, 3)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).transpose(1, 2)
        x = torch.relu(self.conv(x)).mean(-1)
        x = self.fc(x)[:, :6]
        return self.head(x)


def _loss(m: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 10, (5, 7), generator=g)
    y = torch.randint(0, 10, (5,), generator=g)
    return nn.functional.cross_entropy(m(idx), y)


@pytest.mark.parametrize("opt", sorted(FACTORIES))
def test_matches_one_optimizer(opt: str) -> None:
    torch.manual_seed(0)
    ref = Net().double()
    mine = Net().double()
    mine.load_state_dict(ref.state_dict())
    ref_opt = FACTORIES[opt](ref.parameters())
    seen: list[int] = []
    lw = LayerwiseOptimizer(parameter_layers(mine), FACTORIES[opt], on_layer=seen.append)
    for step in range(6):
        ref_opt.zero_grad()
        _loss(ref, step).backward()
        ref_opt.step()
        lw.zero_grad()
        seen.clear()
        _loss(mine, step).backward()
        assert sorted(seen) == list(range(len(lw.layers))), "every layer reported once per backward"
        assert all(p.grad is None for p in mine.parameters()), "grads released after each layer's step"
        lw.step()  # nothing left to do
    for (n, a), b in zip(ref.named_parameters(), mine.parameters()):
        assert torch.equal(a, b), n


def test_layers_and_tied_parameters() -> None:
    names = [n for n, _ in parameter_layers(Net())]
    assert names == ["emb", "conv", "fc", "unused"]  # head's weight is emb's


def test_backward_order_of_callbacks() -> None:
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), nn.Linear(3, 1))
    order: list[int] = []
    lw = LayerwiseOptimizer(
        parameter_layers(m), lambda ps: torch.optim.SGD(ps, lr=0.1), on_layer=order.append
    )
    m(torch.randn(4, 3)).sum().backward()
    assert order == [2, 1, 0]
    lw.remove_hooks()
    m(torch.randn(4, 3)).sum().backward()
    assert order == [2, 1, 0] and m[0].weight.grad is not None


def test_lr_scheduler_and_state_dict() -> None:
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    lw = LayerwiseOptimizer(parameter_layers(m), lambda ps: torch.optim.Adam(ps, lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(lw, step_size=1, gamma=0.5)
    for _ in range(3):
        m(torch.randn(2, 3)).sum().backward()
        lw.step()
        sched.step()
    assert all(g["lr"] == pytest.approx(0.125) for o in lw.optimizers for g in o.param_groups)
    sd = lw.state_dict()
    m2 = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    lw2 = LayerwiseOptimizer(parameter_layers(m2), lambda ps: torch.optim.Adam(ps, lr=1.0))
    lw2.load_state_dict(sd)
    assert torch.equal(
        lw2.optimizers[1].state_dict()["state"][0]["exp_avg"], sd["layers"][1]["state"][0]["exp_avg"]
    )
    with pytest.raises(InvalidArgumentError, match="expected 2 layer states"):
        lw2.load_state_dict({"layers": sd["layers"][:1]})


def test_a_scheduler_built_before_a_load_drives_the_loaded_groups() -> None:
    """torch's load_state_dict gives each inner optimizer new group dicts; a scheduler built on the
    LayerwiseOptimizer before the load (as a resumed run builds it) still sets the learning rate the
    layers step with."""
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    lw = LayerwiseOptimizer(parameter_layers(m), lambda ps: torch.optim.SGD(ps, lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(lw, step_size=1, gamma=0.5)
    state = {"layers": [o.state_dict() for o in lw.optimizers]}
    state["layers"][0]["param_groups"][0]["lr"] = 0.25  # a saved run's rate
    lw.load_state_dict(state)
    assert lw.param_groups[0] is lw.optimizers[0].param_groups[0] and lw.param_groups[0]["lr"] == 0.25
    sched.step()
    assert [o.param_groups[0]["lr"] for o in lw.optimizers] == [0.125, 0.5]


def test_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="no trainable parameters"):
        LayerwiseOptimizer([], lambda ps: torch.optim.SGD(ps, lr=0.1))
    lin = nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match="more than one layer"):
        LayerwiseOptimizer([("a", [lin.weight]), ("b", [lin.weight])], lambda ps: torch.optim.SGD(ps, lr=0.1))
