"""Each integration under ``lowband run --rate`` on the testbed (root and link shaping needed, skipped
otherwise; marked slow): 2 ranks behind emulated 100 Mbit/s links train one strategy through Lightning,
Accelerate and the transformers Trainer, with the same checks as the in-process tests against lowband's
own loop (tests/_integration_run_script.py, each rank writing its loss sequences)."""

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
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _OK, reason=f"link shaping unavailable here: {_WHY}")]
ENV = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}

#: one strategy per framework: a DDP comm hook, a gradient stage, a sharded embedding
CASES = [("lightning", "powersgd"), ("accelerate", "compressed"), ("transformers", "embrace")]


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
