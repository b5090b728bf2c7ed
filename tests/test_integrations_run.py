"""The integrations under launchers (marked slow): each under ``lowband run --rate`` on the testbed (root
and link shaping needed, skipped otherwise: 2 ranks behind emulated 100 Mbit/s links train one strategy
through Lightning, Accelerate and the transformers Trainer), Lightning under its own launcher and
Accelerate under ``accelerate launch``; the same checks as the in-process tests against lowband's own
loop (tests/_integration_run_script.py, each rank writing its loss sequences)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowband.testbed import shaping_available

TESTS = Path(__file__).parent
_OK, _WHY = shaping_available()
pytestmark = pytest.mark.slow
shaped = pytest.mark.skipif(not _OK, reason=f"link shaping unavailable here: {_WHY}")
no_shaping = pytest.mark.timeout(360)
ENV = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}

#: one strategy per framework: a DDP comm hook, a gradient stage, a sharded embedding
CASES = [("lightning", "powersgd"), ("accelerate", "compressed"), ("transformers", "embrace")]


@shaped
@pytest.mark.parametrize("framework,name", CASES)
def test_integration_under_lowband_run_on_shaped_links(framework: str, name: str, tmp_path: Path) -> None:
    pytest.importorskip({"lightning": "lightning.pytorch"}.get(framework, framework))
    args = ["-n", "2", "--rate", "100mbit", "--mode", "netns", str(TESTS / "_integration_run_script.py")]
    cmd = [sys.executable, "-m", "lowband.cli", "run", *args, framework, str(tmp_path), name]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=ENV, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "netns+tbf: 2 ranks, 100 Mbit/s per rank" in out.stderr
    sys.path.insert(0, str(TESTS))
    module = __import__(f"test_integrations_{framework}")
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        module.check_result(name, res[name], f"{framework} {name} rank {rank} under lowband run --rate")


def _launched(cmd: list[str], tmp_path: Path) -> list[dict[str, dict[str, list[float]]]]:
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@no_shaping
def test_lightning_under_its_own_launcher(tmp_path: Path) -> None:
    """``python script.py`` with ``Trainer(devices=2)``: Lightning starts the second rank itself."""
    pytest.importorskip("lightning.pytorch")
    script = str(TESTS / "_integration_run_script.py")
    for rank, res in enumerate(
        _launched([sys.executable, script, "lightning-launcher", str(tmp_path), "powersgd"], tmp_path)
    ):
        import integration_fixtures as fx

        fx.check(
            "powersgd", res["powersgd"]["whole"], res["powersgd"]["ref"], f"lightning's launcher, rank {rank}"
        )


@no_shaping
def test_accelerate_under_accelerate_launch(tmp_path: Path) -> None:
    """``accelerate launch --multi_gpu --num_processes 2`` (torchrun inside; ``--cpu`` would start one
    process) with ``Accelerator(cpu=True)`` in the script: CPU ranks on gloo."""
    pytest.importorskip("accelerate")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    script = [str(TESTS / "_integration_run_script.py"), "accelerate", str(tmp_path), "compressed"]
    sys.path.insert(0, str(TESTS))
    import test_integrations_accelerate as t

    for rank, res in enumerate(_launched([*launcher, *script], tmp_path)):
        t.check_result("compressed", res["compressed"], f"accelerate launch, rank {rank}")


EXAMPLES = [
    ("lightning_train.py", [], "lightning_train: dreamddp trained to loss"),
    ("accelerate_train.py", ["--epochs", "1"], "accelerate_train: dreamddp(H=5) trained to loss"),
    ("accelerate_train.py", ["--epochs", "1", "--hook", "onebit:twostage"], "DDP + onebit:twostage trained"),
    ("hf_gpt2.py", ["--steps", "10"], "hf_gpt2: dreamddp trained 10 steps"),
]


@no_shaping
@pytest.mark.parametrize(
    "script,args,says", EXAMPLES, ids=["lightning", "accelerate", "accelerate-hook", "hf"]
)
def test_example_runs_under_lowband_run(script: str, args: list[str], says: str, tmp_path: Path) -> None:
    """The examples as their docstrings launch them (``lowband run -n 2``, loopback), checkpoints included."""
    example = TESTS.parent / "examples" / script
    cmd = [sys.executable, "-m", "lowband.cli", "run", "-n", "2", str(example), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert says in out.stdout, out.stdout[-2000:]
    saved = {
        "lightning_train.py": "lightning.ckpt.lowband",
        "hf_gpt2.py": "hf-gpt2-run/checkpoint-10/lowband",
    }
    folder = tmp_path / saved.get(script, "accelerate-state/lowband")
    expected = (
        {"rank0-of-2.pt", "rank1-of-2.pt"} if "--hook" not in args else {"hook-rank0.pt", "hook-rank1.pt"}
    )
    assert {p.name for p in folder.iterdir()} == expected
