"""Every registered strategy checkpoints to a file that loads with ``torch.load(weights_only=True)``
(tensors, numbers, strings and containers only: nothing unpickled), and a fresh strategy that loads it
continues exactly as the uninterrupted run: bit for bit, except where the strategy is nondeterministic
by design (listed in NOT_BIT_EXACT with the reason).

One launch of real processes (torch DDP and the model averagers need a process-wide group) trains each
strategy in turn; world sizes 1-4 of the torch baselines are in test_strategies.py.
"""

from __future__ import annotations

import io
import math

import torch
from torch import nn

import lowband
from lowband.strategies import make_strategy, parse_strategy_spec, strategy_names
from lowband.strategies.registry import STRATEGIES
from lowband.testing import run_processes

RESUME_AT, STEPS = 7, 12
# options that make each strategy communicate (and change its state) before RESUME_AT
OPTIONS = {
    "powersgd": "start_iter=3,rank=1",
    "localsgd": "period=3",
    # the threshold decided (from timings) before RESUME_AT: the resumed run loads it
    "slimgc": "pre_steps=4",
}
# the window puts of win-put land whenever the network delivers them and are combined as they are:
# two uninterrupted runs differ already, so a resumed run can only be checked for loading and running on
NOT_BIT_EXACT = {"winput": "asynchronous puts: the combined values depend on arrival times"}


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(7)
    m = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return m


def _bn_dropout_model() -> nn.Module:
    """Buffers and randomness in forward: DDP's rebucketing pass on resume must leave both untouched."""
    g = torch.Generator().manual_seed(8)
    m = nn.Sequential(
        nn.Linear(6, 10), nn.BatchNorm1d(10), nn.Tanh(), nn.Dropout(0.3), nn.Linear(10, 2)
    ).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return m


class _EmbModel(nn.Module):
    """An embedding table read with ids derived from the inputs, then dense layers (for the strategies
    that partition or exchange tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.head = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 7).long() % 20
        return self.head(self.emb(ids).mean(1))  # type: ignore[no-any-return]


def _emb_model() -> nn.Module:
    g = torch.Generator().manual_seed(9)
    m = _EmbModel().double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return m


# strategies that need a model with an embedding table run on _emb_model
NEEDS_TABLES = {"embrace"}


def _loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = (
        torch.randn(5, 6, generator=g, dtype=torch.float64),
        torch.randn(5, 2, generator=g, dtype=torch.float64),
    )
    return ((m(x) - y) ** 2).mean()


def _opt(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


def _flat(m: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()


def _run(name: str, m: nn.Module, steps: range, checkpoint: bytes | None) -> tuple[list[float], bytes]:
    r = lowband.rank()
    _, opts = parse_strategy_spec(f"{name}:{OPTIONS.get(name, '')}")
    s = make_strategy(name, m, _opt, **opts)
    if checkpoint is not None:
        s.load_state_dict(torch.load(io.BytesIO(checkpoint), weights_only=True))
    saved = b""
    for k in steps:
        if k == RESUME_AT:
            s.synchronize()
            buf = io.BytesIO()
            torch.save(s.state_dict(), buf)
            saved = buf.getvalue()
            torch.manual_seed(RESUME_AT)  # dropout's generator: the caller's to checkpoint, as in torch
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    s.synchronize()
    s.close()
    return _flat(m), saved


def _train_and_resume(names: list[str]) -> dict[str, tuple[list[float], list[float]]]:
    out = {}
    for key in names:
        name, _, variant = key.partition("/")
        make = {"bn-dropout": _bn_dropout_model, "emb": _emb_model}.get(variant, _model)
        whole, ckpt = _run(name, make(), range(STEPS), None)
        resumed, _ = _run(name, make(), range(RESUME_AT, STEPS), ckpt)
        out[key] = (whole, resumed)
    return out


def test_every_strategy_resumes_from_weights_only_checkpoint() -> None:
    # lowband's own strategies: the ranks are fresh processes, which do not import test fixtures that
    # register more (tests/sharded_model.py)
    own = [n for n in strategy_names() if STRATEGIES.get(n).__module__.startswith("lowband.")]
    own = [f"{n}/emb" if n in NEEDS_TABLES else n for n in own]
    names = [*own, "ddp/bn-dropout", "powersgd/bn-dropout", "sparse-allgather/emb", "embedding-ps/emb"]
    assert set(NOT_BIT_EXACT) <= set(names)
    n = 3
    res = run_processes(_train_and_resume, n, names, timeout=300)
    for r in range(n):
        for name in names:
            whole, resumed = res[r][name]
            if name in NOT_BIT_EXACT:
                assert all(math.isfinite(v) for v in resumed) and len(resumed) == len(whole)
            else:
                assert resumed == whole, (
                    f"{name} rank {r}: resumed run differs from the uninterrupted one by "
                    f"{max(abs(a - b) for a, b in zip(resumed, whole)):.3g}"
                )
