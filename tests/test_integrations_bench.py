"""``lowband bench`` runs a Hugging Face model as its workload: examples/hf_gpt2.py:make_workload (a
GPT-2 built from a config, on the bench's Shakespeare characters) at 2 ranks on loopback, two strategies
side by side; the workload's model is transformers' GPT-2 and its loss is the model's own next-token
loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from lowband.bench.config import BenchConfig
from lowband.bench.runner import run_bench
from lowband.bench.workloads import get_workload

ROOT = Path(__file__).resolve().parent.parent
SPEC = "examples/hf_gpt2.py:make_workload"


def test_the_workload_is_a_hugging_face_gpt2(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    monkeypatch.chdir(ROOT)
    w = get_workload(SPEC)
    model = w.build_model(0)
    assert isinstance(model.model, transformers.GPT2LMHeadModel)  # type: ignore[union-attr]
    x, y = next(iter(w.batches(0, 1, 4, 0)))
    out = model.model(input_ids=x, labels=x)  # type: ignore[operator]
    # the model's own loss shifts the labels; the workload's targets are the next characters
    assert torch.allclose(w.loss(model, (x[:, :-1], x[:, 1:])), out.loss, rtol=1e-5)
    assert torch.equal(y[:, :-1], x[:, 1:])


def test_bench_runs_the_hugging_face_workload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cfg = BenchConfig(
        workload=SPEC, strategies=["ddp", "powersgd"], world_size=2, rate=None, mode="loopback", rounds=2,
        steps_per_round=2, warmup_rounds=1, eval_items=0, out_dir=str(tmp_path / "out"),
    )  # fmt: skip
    res = run_bench(cfg, timeout=300, quiet=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["workload"].endswith(SPEC.split("/")[1])
    rows = res["summary"]["strategies"]
    assert set(rows) == {"ddp", "powersgd"} and rows["ddp"]["steps"] == 4 and rows["powersgd"]["steps"] == 4
    assert res["raw"]["workload_name"] == "hf-gpt2"
