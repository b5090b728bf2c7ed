"""lowband.optim.pending: per-layer work in flight, waited before the forward that uses the layer."""

from __future__ import annotations

import torch
from torch import nn

from lowband.optim import parameter_layers
from lowband.optim.pending import PendingWork, forward_pre_hooks, module_layers


class Work:
    """A finished operation recording when it was waited for."""

    def __init__(self, log: list[str], label: str, value: int) -> None:
        self.log, self.label, self.value = log, label, value

    def wait(self) -> int:
        self.log.append(self.label)
        return self.value


def test_wait_order_finish_and_one_per_key() -> None:
    log: list[str] = []
    finished: list[tuple[int, int]] = []
    pw: PendingWork[int] = PendingWork(lambda k, v: finished.append((k, v)))
    pw.add(3, Work(log, "a", 30))
    pw.add(1, Work(log, "b", 10))
    assert len(pw) == 2 and 3 in pw and pw.keys() == [3, 1]
    pw.add(3, Work(log, "c", 31))  # the first one on key 3 is waited for before the second is kept
    assert log == ["a"] and finished == [(3, 30)]
    pw.wait(2)  # nothing in flight there
    pw.wait_all(in_key_order=True)
    assert log == ["a", "b", "c"] and finished == [(3, 30), (1, 10), (3, 31)]
    assert not pw
    pw.add(5, Work(log, "d", 5))
    pw.add(4, Work(log, "e", 4))
    pw.wait_all()  # launch order
    assert log[-2:] == ["d", "e"]


def test_forward_pre_hooks_name_each_modules_layers() -> None:
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=True)
    head.weight = emb.weight  # tied: the head's module uses the embedding's layer too
    model = nn.Sequential(emb, head)
    layers = parameter_layers(model)
    names = [n for n, _ in layers]
    seen: list[list[str]] = []
    hooks = forward_pre_hooks(model, layers, lambda idx: seen.append([names[i] for i in idx]))
    assert [len(idx) for _, idx in module_layers(model, layers)] == [1, 2]
    model(torch.tensor([1, 2]))
    assert len(seen) == 2 and len(seen[1]) == 2 and seen[0][0] in seen[1]
    for h in hooks:
        h.remove()
    model(torch.tensor([1]))
    assert len(seen) == 2
