"""Every registered strategy for a few steps at 2 and 3 ranks under the NCCL emulator
(:mod:`lowband.comm.nccl_emulator`: a timed wait that expires aborts, futures complete at enqueue, a
pair's unbatched two-way exchange or a receive matched only by its tag raises, two threads issuing
collectives on one group raise), against the same run on plain gloo: it must not raise, and it must
train bit for bit the same parameters (the emulator changes when things complete, never values; ATC's
two strategies to 1e-12 relative, as in the loop tests).

Thread ranks (the strategies built on torch DDP need process-wide groups: processes, in
``test_nccl_emulator.py``'s registered-backend test). The model, options and seeds are the loop tests'
(``tests/test_loop_api.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_loop_api import PROCESS_ONLY, ROUNDING, VARIANTS, _close, _flat, _loss, _model, _opt, _options, _own

import lowband
from lowband.strategies import make_strategy
from lowband.testing import run_threads

STEPS = 4


def _train(name: str, folder: str) -> list[float]:
    r = lowband.rank()
    m = _model()
    momentum = VARIANTS[name][1] if name in VARIANTS else 0.9
    s = make_strategy(name.partition("/")[0], m, lambda p: _opt(p, momentum), **_options(name, folder))
    for k in range(STEPS):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    s.synchronize()
    out = _flat(m)
    s.close()
    return out


NAMES = [x for x in _own() if x not in PROCESS_ONLY and x != "winput"] + sorted(VARIANTS)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_strategy_under_nccl_semantics_trains_as_on_gloo(name: str, n: int, tmp_path: Path) -> None:
    # one folder: DreamDDP's variants schedule from the profile the first run measures
    want: Any = run_threads(_train, n, name, str(tmp_path), timeout=120)
    got: Any = run_threads(_train, n, name, str(tmp_path), timeout=120, emulate_nccl=True)
    where = f"{name} at {n} ranks trains differently under NCCL's contract"
    if name.partition("/")[0] in ROUNDING:  # two gloo runs already differ in a last bit now and then
        _close(got, want, where)
    else:
        assert got == want, where
