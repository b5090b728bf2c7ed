"""benchmarks/probe_families.py's machinery on a tiny subset: one real 2-rank launch of three cases (a
mismatched option is ok-error, a NaN skipped is ok-trained, a tied model is ok-trained or ok-error),
and the classifier on synthetic ends both ways (a gloo abort, a hang, a silent rank, a wrong blame)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.probes import cases as grid  # noqa: E402
from benchmarks.probes.classify import LaunchEnd, classify, classify_signal  # noqa: E402
from benchmarks.probes.common import OK, Case  # noqa: E402
from benchmarks.probes.orchestrate import Settings, run_batch  # noqa: E402

ABORT = (
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
    "  what():  [enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4\n"
)


def test_one_launch_classifies_each_case(tmp_path: Path) -> None:
    mismatch = grid.family3(["gs-sgd"], quick=True)[5]  # the gs-sgd density 0.1 vs 0.3
    assert mismatch["per_rank"] == [{"density": 0.1}, {"density": 0.3}]
    skip = grid.family1(["stage"])[0]
    tied = grid.family2(["stage"])[0]
    probes = run_batch([mismatch, skip, tied], Settings(tmp_path, 30.0, 90.0))
    got = {p.case["id"]: (p.outcome, p.detail) for p in probes}
    assert got[mismatch["id"]][0] == "ok-error", got
    assert "option 'density'" in got[mismatch["id"]][1]
    assert got[skip["id"]][0] == "ok-trained", got
    assert got[tied["id"]][0] in OK, got
    assert len(probes) == 3 and len(list(tmp_path.glob("launch*"))) == 1  # agreed errors: one launch


def _nan_case(**kw: Any) -> Case:
    return {"family": 5, "id": "x", "kind": "nonfinite", "ranks": 2, "policy": "raise", "bad": [1], **kw}


def test_classifier_both_ways() -> None:
    case = _nan_case()
    aborted = LaunchEnd(
        1, "lowband run: rank 1 was killed by SIGABRT (exit code -6: an abort in native code)\n"
    )
    assert classify(case, [None, None], aborted)[0] == "GLOO-ABORT"
    assert classify(case, [{"final": [0.0]}, None], LaunchEnd(1, "", ABORT))[0] == "GLOO-ABORT"
    assert classify(case, [None, None], LaunchEnd(None, "", hung=True))[0] == "HANG"
    assert (
        classify(case, [None, None], LaunchEnd(1, "lowband run: rank 0 failed: ValueError: x"))[0] == "CRASH"
    )
    err = {
        "etype": "NonFiniteError",
        "error": "non-finite gradient on rank 1 (unit 'x') at step 2",
        "finite": True,
    }
    assert classify(case, [err, err], LaunchEnd(0))[0] == "ok-error"
    quiet = {"final": [float("nan")], "finite": False}
    assert classify(case, [quiet, quiet], LaunchEnd(0))[0] == "SILENT"
    timeout = {"etype": "CommTimeoutError", "error": "no completion within 30 s", "finite": True}
    assert classify(case, [timeout, err], LaunchEnd(0))[0] == "WRONG-ERROR"
    assert classify(case, [{**err, "finite": False}, err], LaunchEnd(0))[0] == "NAN-MODEL"
    sig: Case = {"family": 6, "id": "y", "kind": "signal", "ranks": 3, "victim": 1, "signal": "SIGSTOP"}
    right = (
        "lowband run: rank 1 stopped answering first (seen by rank 0)\nlowband run: then ranks 0, 2 failed"
    )
    assert classify_signal(sig, LaunchEnd(1, right, exit_delays={0: 0.2, 2: 0.3}))[0] == "ok-error"
    assert classify_signal(sig, LaunchEnd(1, right, exit_delays={0: 0.2, 2: 5.8}))[0] == "SLOW-EXIT"
    wrong = "lowband run: rank 0 failed: CommTimeoutError: no completion within 3 s\n"
    assert classify_signal(sig, LaunchEnd(1, wrong))[0] == "WRONG-BLAME"
    assert classify_signal(sig, LaunchEnd(None, "", hung=True))[0] == "HANG"
    assert classify_signal(sig, LaunchEnd(1, right, ABORT))[0] == "GLOO-ABORT"


def test_a_mismatch_may_name_each_value_in_its_canonical_form() -> None:
    case: Case = {
        "family": 3, "id": "z", "kind": "mismatch", "ranks": 2, "option": "compressor",
        "values": ["onebit", "onebit:threshold_mode=absolute"],
    }  # fmt: skip
    msg = (
        "make_strategy('compressed') on rank 0: the ranks' strategy configurations differ: option "
        "'compressor' is onebit:scale=1.0;threshold=0.5;threshold_mode='relative' on rank 0, "
        "onebit:scale=1.0;threshold=0.5;threshold_mode='absolute' on rank 1"
    )
    err = {"etype": "CollectiveMismatchError", "error": msg, "finite": True}
    assert classify(case, [err, err], LaunchEnd(1))[0] == "ok-error"
    other = {**err, "error": msg.replace("'absolute'", "'relative'")}
    assert classify(case, [other, other], LaunchEnd(1))[0] == "WRONG-ERROR"
