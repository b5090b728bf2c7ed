"""A strategy checkpoint taken at 3 ranks, loaded with ``Strategy.load_state_dict`` at 2 (issue 29: local
SGD loaded one silently, dropping rank 2's replica and momenta): every registered strategy either
refuses it on every rank, naming both sizes, or holds no per-rank state (the three ranks saved the same
content: a replica) and loads it. Never loaded with per-rank state dropped.

Strategies built on torch DDP need real processes (one launch per size); the others run as threads.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import lowband
from lowband.errors import InvalidArgumentError
from lowband.strategies import make_strategy, strategy_names
from lowband.strategies.digest import content_crc
from lowband.testing import run_processes, run_threads
from tests import embedding_model as em

PROCESS_ONLY = {"ddp", "powersgd", "ddp-sparse"}
#: 3 steps saved mid-period (local steps), so the replicas differ; auto among the compressed ones
OPTIONS: dict[str, dict[str, Any]] = {
    "auto": {"only": "compressed"},
    "localsgd": {"period": 2},
    "diloco": {"inner_steps": 2},
    "dreamddp": {"period": 2},
    "plsgd-enp": {"period": 2},
    "flsgd-overlap": {"period": 2},
}
#: per-rank state that must never load at another size (the defect this file reproduces first)
MUST_REFUSE = {"localsgd", "diloco", "gtopk", "gs-sgd", "compressed", "slimgc"}
SAVE = 3


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    out: dict[str, Any] = torch.load(buf, weights_only=True)
    return out


def _save(names: list[str]) -> dict[str, Any]:
    rank = lowband.rank()
    out: dict[str, Any] = {}
    for name in names:
        s = make_strategy(name, em.model(seed=5), em.sgd, **OPTIONS.get(name, {}))
        try:
            for step in range(SAVE):
                s.train_step(em.loss_fn(rank, step))
            s.synchronize()
            out[name] = _roundtrip(s.state_dict())
        finally:
            s.close()
    return out


def _load(names: list[str], saved: list[dict[str, Any]]) -> dict[str, str]:
    rank = lowband.rank()
    out: dict[str, str] = {}
    for name in names:
        s = make_strategy(name, em.model(seed=5), em.sgd, **OPTIONS.get(name, {}))
        try:
            s.load_state_dict(saved[rank][name])
            s.train_step(em.loss_fn(rank, SAVE))
            s.synchronize()
            out[name] = "loaded"
        except InvalidArgumentError as exc:
            out[name] = f"refused: {exc}"
        finally:
            s.close()
    return out


def _names_size(msg: str) -> bool:
    """The refusal names the saved size and this one (per-rank state, or a sharded layout)."""
    return ("taken at 3 ranks" in msg and "has 2" in msg) or ("a world of 3" in msg and "(of 2)" in msg)


def _replicated(names: list[str], saved: list[dict[str, Any]]) -> dict[str, bool]:
    """Whether the ranks saved one content (before a load: torch's optimizer loads a state's tensors
    without copying them, and the steps after it change them in place)."""
    return {n: len({content_crc(per_rank[n]) for per_rank in saved}) == 1 for n in names}


def _check(names: list[str], replicated: dict[str, bool], loaded: list[dict[str, str]]) -> list[str]:
    failures = []
    for name in names:
        outcomes = [per_rank[name] for per_rank in loaded]
        if all(o == "loaded" for o in outcomes):
            if not replicated[name] or name in MUST_REFUSE:
                failures.append(f"{name}: per-rank state of 3 ranks loaded at 2 without a word")
        elif not all(o.startswith("refused: ") and _names_size(o) for o in outcomes):
            failures.append(f"{name}: not refused alike on every rank, naming the size: {outcomes}")
    return failures


def test_every_thread_strategy_refuses_or_is_replicated() -> None:
    names = [n for n in strategy_names() if n not in PROCESS_ONLY]
    saved = run_threads(_save, 3, names, timeout=180)
    replicated = _replicated(names, saved)
    loaded = run_threads(_load, 2, names, saved, timeout=180)
    assert not (failures := _check(names, replicated, loaded)), "\n".join(failures)
    assert all(o.startswith("refused") for o in (loaded[0]["localsgd"], loaded[1]["localsgd"]))


def _procs(names: list[str], saved: list[dict[str, Any]] | None) -> Any:
    return _save(names) if saved is None else _load(names, saved)


def test_ddp_strategies_in_processes() -> None:
    names = sorted(PROCESS_ONLY)
    saved = run_processes(_procs, 3, names, None, timeout=180, backend="gloo", device="cpu")
    replicated = _replicated(names, saved)
    loaded = run_processes(_procs, 2, names, saved, timeout=180, backend="gloo", device="cpu")
    assert not (failures := _check(names, replicated, loaded)), "\n".join(failures)
    # DDP holds one replica: its checkpoint is every rank's and loads at any size
    assert loaded[0]["ddp"] == loaded[1]["ddp"] == "loaded"


@pytest.mark.parametrize("value", [torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)])
def test_content_crc_sees_every_byte(value: torch.Tensor) -> None:
    a = {"model": {"w": value.clone()}, "steps": 3}
    b = {"model": {"w": value.clone()}, "steps": 3}
    assert content_crc(a) == content_crc(b)
    b["model"]["w"][1] = 1
    assert content_crc(a) != content_crc(b)
    assert content_crc({**a, "steps": 4}) != content_crc(a)
    assert content_crc({"w": value.reshape(1, 3)}) != content_crc({"w": value})
