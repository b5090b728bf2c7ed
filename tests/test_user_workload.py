"""A user's own workload: the protocol's defaults, loading by ``module:factory`` or ``file.py:factory``
(one-line errors), the shipped example, and a tiny bench of it on loopback (2 ranks, 2 rounds x 2 steps)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowband.bench.config import BenchConfig
from lowband.bench.runner import run_bench
from lowband.bench.workloads import Workload, canonical_spec, get_workload, tensor_batches
from lowband.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "my_workload.py"


class Minimal(Workload):
    """Only the three required methods: y = 2x on 64 rows."""

    def __init__(self) -> None:
        self.x = torch.linspace(-1, 1, 64).unsqueeze(1)

    def build_model(self, seed: int) -> nn.Module:
        gen = torch.Generator().manual_seed(seed)
        m = nn.Linear(1, 1)
        with torch.no_grad():
            m.weight.copy_(torch.rand(1, 1, generator=gen))
        return m

    def batches(self, rank: int, world: int, batch_size: int, seed: int) -> Iterator[Any]:
        return tensor_batches([self.x, 2 * self.x], rank, world, batch_size, seed)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return F.mse_loss(model(batch[0]), batch[1])


def test_protocol_defaults() -> None:
    w = Minimal()
    model = w.build_model(0)
    opt = w.make_optimizer(model.parameters())
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["lr"] == w.default_lr == 0.01
    assert opt.defaults["momentum"] == 0.9
    assert w.make_optimizer(model.parameters(), lr=0.5).defaults["lr"] == 0.5
    batch = next(w.batches(0, 2, 8, 0))
    assert w.items(batch) == 8 and w.items({"a": torch.zeros(5, 2)}) == 5
    with pytest.raises(InvalidArgumentError, match=r"override Workload\.items"):
        w.items("text")
    assert w.evaluate(model) is None
    assert "Minimal" in w.describe() and w.unit == "samples" and w.default_batch_size == 32
    with pytest.raises(TypeError):
        Workload()  # type: ignore[abstract]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tensor_batches_shard_disjoint_and_seeded(world: int) -> None:
    rows = torch.arange(30)
    firsts = []
    for r in range(world):
        epoch = list(itertools.islice(tensor_batches([rows], r, world, 2, seed=1), 30 // world // 2))
        again = list(itertools.islice(tensor_batches([rows], r, world, 2, seed=1), 30 // world // 2))
        assert all(torch.equal(a[0], b[0]) for a, b in zip(epoch, again))
        firsts.append(torch.cat([b[0] for b in epoch]))
    seen = torch.cat(firsts)
    assert len(set(seen.tolist())) == len(seen) == 30 // world // 2 * 2 * world
    with pytest.raises(InvalidArgumentError, match="same number of rows"):
        tensor_batches([rows, rows[:3]], 0, 1, 2, 0)


def test_example_trains_and_evaluates() -> None:
    w = get_workload(f"{EXAMPLE}:make_workload", hidden=32)
    assert w.name == "digits-mlp" and "3-layer MLP" in w.describe()
    model = w.build_model(0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), w.build_model(0).parameters()))
    opt = w.make_optimizer(model.parameters())
    before = w.evaluate(model)
    for batch in itertools.islice(w.batches(0, 1, 32, 0), 100):
        opt.zero_grad()
        w.loss(model, batch).backward()
        opt.step()
    after = w.evaluate(model)
    assert before is not None and after is not None and after.accuracy is not None
    assert after.loss < 0.5 * before.loss and after.accuracy > 0.8


def _module(tmp_path: Path, body: str, name: str = "usermod") -> str:
    (tmp_path / f"{name}.py").write_text(
        "from lowband.bench.workloads import Workload\n"
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from test_user_workload import Minimal\n" + body
    )
    return name


def test_module_spec_from_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _module(
        tmp_path, "def make():\n    return Minimal()\nnot_a_factory = 3\nbad = lambda: 'x'\n", "usermod_a"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    w = get_workload(f"{mod}:make")
    assert isinstance(w, Minimal) and w.name == "usermod_a"  # named after the spec
    assert canonical_spec(f"{mod}:make") == f"{mod}:make"
    assert canonical_spec("sub/w.py:make") == f"{tmp_path / 'sub' / 'w.py'}:make"
    for spec, msg in (
        (f"{mod}:nope", "has no attribute 'nope'"),
        (f"{mod}:not_a_factory", "is a int, not a factory"),
        (f"{mod}:bad", "returned a str, not a lowband.bench.workloads.Workload"),
        ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
        ("missing.py:make", "no such file"),
        (f"{mod}:", "expected module:factory"),
        (f"{mod}:make", "make\\(hidden\\) failed: TypeError"),
    ):
        opts = {"hidden": 3} if spec.endswith(":make") else {}
        with pytest.raises(InvalidArgumentError, match=msg) as e:
            get_workload(spec, **opts)
        assert "\n" not in str(e.value) and spec in str(e.value)


def test_a_failing_import_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import torch\nraise RuntimeError('no data here')\n")
    with pytest.raises(
        InvalidArgumentError, match=r"loading .*broken.py' failed: RuntimeError: no data here"
    ):
        get_workload(f"{tmp_path / 'broken.py'}:make")


def test_a_rank_process_imports_the_module_spec(tmp_path: Path) -> None:
    """The ranks run ``python -m lowband.bench.worker`` in the bench's working directory, which puts it
    on sys.path: a module there resolves by the same spec."""
    mod = _module(tmp_path, "def make():\n    return Minimal()\n", "usermod_b")
    code = f"from lowband.bench.workloads import get_workload; print(get_workload('{mod}:make').name)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "usermod_b", out.stderr


def test_bench_of_the_example_on_loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # a relative path: made absolute for the ranks
    cfg = BenchConfig(
        workload="examples/my_workload.py:make_workload", strategies=["ddp", "localsgd:period=2"], world_size=2,
        rate=None, mode="loopback", rounds=2, steps_per_round=2, warmup_rounds=1, eval_items=0,
        out_dir=str(tmp_path / "out"),
    )  # fmt: skip
    res = run_bench(cfg, timeout=240, quiet=True)
    on_disk = json.loads((tmp_path / "out" / "config.json").read_text())
    assert on_disk["workload"] == f"{EXAMPLE}:make_workload"
    rows = res["summary"]["strategies"]
    assert set(rows) == {"ddp", "localsgd:period=2"} and rows["ddp"]["steps"] == 4
    assert rows["ddp"]["eval_accuracy"] is not None and res["raw"]["workload_name"] == "digits-mlp"
    assert "digits-mlp, 2 ranks" in res["terminal"] and "localsgd:period=2" in res["terminal"]
    assert "`localsgd:period=2`" in res["markdown"] and "**Columns.**" in res["markdown"]


def test_cli_refuses_a_bad_spec_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lowband.cli import main

    out = tmp_path / "out"
    args = ["bench", "-w", "no_such_module_xyz:make", "-n", "2", "--mode", "loopback", "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot import 'no_such_module_xyz'" in err
    assert not out.exists()
