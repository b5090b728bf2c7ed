"""Tied parameters stay tied: a language model whose output layer shares the input table's weight
(``m.dec.weight = m.emb.weight``, as most language models do) trained at 2 ranks by every registered
strategy either keeps the tie (one tensor, after training and after a checkpoint round trip) or is
refused at construction with an :class:`InvalidArgumentError` naming both modules. The strategies
that train exactly as the single-process model are compared with it (a strategy that drops the
output layer's gradient on the rows no lookup read keeps the tie and trains the wrong model).

The units of the gradient stage and of DreamDDP count a tied parameter once; a sharded parameter
registered under two names is sharded under both (never broadcast or averaged as a replica).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowband
from lowband.errors import InvalidArgumentError
from lowband.localsgd.units import layer_geometry
from lowband.nn.sharding import ShardSpec, shard_specs
from lowband.nn.tied import tied_parameters
from lowband.optim.layerwise import parameter_layers
from lowband.optim.units import model_units
from lowband.strategies import make_strategy, strategy_names
from lowband.strategies.registry import STRATEGIES
from lowband.testing import run_processes, run_threads

VOCAB, DIM, STEPS, N = 11, 4, 3, 2
#: strategies that cannot keep the output layer on the table's rows: refused, naming both modules
REFUSED = {"embrace", "sparse-allgather", "embedding-ps", "ddp-sparse"}
#: strategies that train as the single-process model on every rank's batch (losses averaged)
EXACT = {"ddp", "stage", "compressed", "gradient-allreduce", "dense-priority", "powersgd"}


class TiedLM(nn.Module):
    """Token table -> a dense layer -> an output layer tied to the table (logits over the vocabulary)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = nn.Embedding(VOCAB, DIM, dtype=torch.float64)
        self.mid = nn.Linear(DIM, DIM, dtype=torch.float64)
        self.dec = nn.Linear(DIM, VOCAB, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        self.dec.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dec(torch.tanh(self.mid(self.emb(ids))))
        return out


def _loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    """Next-token loss on a seeded batch; the ids read only part of the table (rows 0..VOCAB-3)."""
    g = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(0, VOCAB - 2, (3, 5), generator=g)
    return F.cross_entropy(m(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _opt(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _flat(m: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()


def _oracle() -> list[float]:
    m = TiedLM()
    opt = _opt(m.parameters())
    for k in range(STEPS):
        opt.zero_grad()
        (sum(_loss(m, r, k) for r in range(N)) / N).backward()  # type: ignore[union-attr]
        opt.step()
    return _flat(m)


def _weight(m: nn.Module, path: str) -> torch.Tensor:
    w = m.get_submodule(path).weight
    assert isinstance(w, torch.Tensor)
    return w


def _tie(m: nn.Module) -> tuple[bool, float]:
    e, d = _weight(m, "emb"), _weight(m, "dec")
    return e is d, float((e.detach() - d.detach()).abs().max())


def _train(names: list[str]) -> dict[str, Any]:
    r = lowband.rank()
    out: dict[str, Any] = {}
    for name in names:
        m = TiedLM()
        try:
            s = make_strategy(name, m, _opt)
        except InvalidArgumentError as e:
            out[name] = ("refused", str(e))
            continue
        for k in range(STEPS):
            s.train_step(partial(_loss, rank=r, step=k))
        s.synchronize()
        trained = _tie(m)
        buf = io.BytesIO()
        torch.save(s.state_dict(), buf)
        s.close()
        m2 = TiedLM()
        s2 = make_strategy(name, m2, _opt)
        s2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        s2.close()
        out[name] = ("trained", trained, _tie(m2), _flat(m), _flat(m2))
    return out


def test_every_strategy_keeps_a_tie_or_refuses_it() -> None:
    # lowband's own strategies (the ranks are fresh processes: fixtures registering more are not there)
    names = [n for n in strategy_names() if STRATEGIES.get(n).__module__.startswith("lowband.")]
    assert set(names) >= REFUSED | EXACT
    res = run_processes(_train, N, names, timeout=240)
    want = _oracle()
    for r in range(N):
        for name in names:
            got = res[r][name]
            if name in REFUSED:
                assert got[0] == "refused", f"{name} rank {r}: trained a tied model: {got[1:3]}"
                msg = got[1]
                assert "'emb'" in msg and "'dec'" in msg and f"rank {r}" in msg, msg
                continue
            assert got[0] == "trained", f"{name} rank {r}: refused the tie: {got[1]}"
            _, trained, loaded, flat, flat2 = got
            assert trained == (True, 0.0), f"{name} rank {r}: the tie broke in training: {trained}"
            assert loaded == (True, 0.0), f"{name} rank {r}: the tie broke in a checkpoint round trip"
            assert flat2 == flat, f"{name} rank {r}: the checkpoint did not restore the tied model"
            if name in EXACT:
                err = max(abs(a - b) for a, b in zip(flat, want, strict=True))
                assert err < 1e-9, f"{name} rank {r}: differs from the single-process model by {err:.3g}"


def test_tied_parameters_lists_every_name() -> None:
    m = TiedLM()
    assert tied_parameters(m) == [("emb.weight", "dec.weight")]
    shared = nn.Sequential(m.mid, m.mid)  # one module at two paths
    assert tied_parameters(shared) == [("0.weight", "1.weight"), ("0.bias", "1.bias")]
    assert tied_parameters(nn.Linear(2, 2)) == []


@pytest.mark.parametrize("bucket_mb", [0.0, 25.0])
def test_units_count_a_tied_parameter_once(bucket_mb: float) -> None:
    m = TiedLM()
    units = model_units(m, bucket_mb)
    params = [p for u in units for p in u.params]
    assert len(params) == len({id(p) for p in params}) == len(list(m.parameters()))
    names = [n for u in units for n in u.names]
    assert "emb.weight" in names and "dec.weight" not in names
    layers = parameter_layers(m)  # DreamDDP's layers (localsgd/units.py cuts them into chunks)
    assert [n for n, _ in layers] == ["emb", "mid", "dec"]
    numel = sum(layer_geometry(ps)[0] for _, ps in layers)
    assert numel == sum(p.numel() for p in m.parameters())


class _Shard(nn.Module):
    """This rank's columns of a table (a Sharded module), lookups of local columns only."""

    def __init__(self, full: torch.Tensor, rank: int, world: int) -> None:
        super().__init__()
        self.spec = ShardSpec.even(tuple(full.shape), 1, rank, world)
        self.weight = nn.Parameter(self.spec.slice(full))

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.spec}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def _shared_shard() -> tuple[list[str], list[float], list[float]]:
    from lowband.strategies.base import Strategy

    full = torch.arange(12.0, dtype=torch.float64).view(3, 4)
    shard = _Shard(full, lowband.rank(), lowband.size())
    m = nn.ModuleDict({"a": shard, "b": shard})  # one sharded table at two paths
    s = Strategy(m, _opt(m.parameters()), lowband.runtime.world_group(None, "test")[1])
    avg = s.average_state_dict()
    s.load_state_dict(s.full_state_dict())
    return sorted(shard_specs(m)), avg["b.weight"].reshape(-1).tolist(), _flat(m)


def test_a_sharded_parameter_under_two_names_is_sharded_under_both() -> None:
    full = torch.arange(12.0, dtype=torch.float64)
    for r, (names, b, mine) in enumerate(run_threads(_shared_shard, N, timeout=30)):
        assert names == ["a.weight", "b.weight"]
        assert b == full.tolist(), f"rank {r}: the second name's table was averaged as a replica"
        assert mine == full.view(3, 4)[:, 2 * r : 2 * r + 2].reshape(-1).tolist()


class TwoPathLM(nn.Module):
    """One table registered at two paths (``a`` and ``b``: two inputs read through one module)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.a = nn.Embedding(VOCAB, DIM, dtype=torch.float64)
        self.b = self.a
        self.head = nn.Linear(DIM, VOCAB, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.a(ids) + self.b(ids.flip(1))))
        return out


def _plain(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2)  # lazy updates (embrace's vertical schedules) equal dense ones


def _two_path_oracle() -> list[float]:
    m = TwoPathLM()
    opt = _plain(m.parameters())
    for k in range(STEPS):
        opt.zero_grad()
        (sum(_loss(m, r, k) for r in range(N)) / N).backward()  # type: ignore[union-attr]
        opt.step()
    return _flat(m)


def _embrace_two_paths(schedule: str) -> tuple[bool, list[float], bool]:
    m = TwoPathLM()
    s = make_strategy("embrace", m, _plain, schedule=schedule)
    for k in range(STEPS):
        s.train_step(partial(_loss, rank=lowband.rank(), step=k))
    s.synchronize()
    full = TwoPathLM()
    s.average_model(full)
    m2 = TwoPathLM()
    s2 = make_strategy("embrace", m2, _plain, schedule=schedule)
    s2.load_state_dict(s.full_state_dict())
    same = m2.get_submodule("a") is m2.get_submodule("b") and _flat(m2) == _flat(m)
    s.close()
    s2.close()
    return m.get_submodule("a") is m.get_submodule("b"), _flat(full), same


@pytest.mark.parametrize("schedule", ["hybrid", "2d"])
def test_embrace_partitions_a_table_at_two_paths_once(schedule: str) -> None:
    want = _two_path_oracle()
    for r, (shared, flat, restored) in enumerate(run_threads(_embrace_two_paths, N, schedule, timeout=60)):
        assert shared, f"rank {r}: the two paths hold different tables"
        err = max(abs(a - b) for a, b in zip(flat, want, strict=True))
        assert err < 1e-9, f"rank {r}: differs from the single-process model by {err:.3g}"
        assert restored, f"rank {r}: the checkpoint round trip lost the shared table"


class FunctionalTieLM(TiedLM):
    """The output layer computes with the table's weight directly (a tie no module structure shows)."""

    def __init__(self) -> None:
        super().__init__()
        self.dec = nn.Linear(DIM, VOCAB, dtype=torch.float64)  # unused: the logits read emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(self.emb(ids))) @ self.emb.weight.T


def _functional(name: str) -> str:
    s = make_strategy(name, FunctionalTieLM(), _opt)
    try:
        s.train_step(partial(_loss, rank=lowband.rank(), step=0))
    except InvalidArgumentError as e:
        return str(e)
    finally:
        s.close()
    return "trained"


@pytest.mark.parametrize("name", ["sparse-allgather", "embedding-ps"])
def test_sparse_baselines_refuse_a_table_read_outside_its_module(name: str) -> None:
    for r, msg in enumerate(run_threads(_functional, N, name, timeout=30)):
        assert "['emb']" in msg and f"rank {r}, step 0" in msg, msg
