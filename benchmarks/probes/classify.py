"""A probe's outcome from what its ranks reported and how its launch ended (no torch: pure functions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from benchmarks.probes.common import (
    AGREED_ERRORS,
    CRASH,
    GLOO_ABORT,
    HANG,
    NAN_MODEL,
    OK_ERROR,
    OK_TRAINED,
    SILENT,
    SLOW_EXIT,
    SURVIVOR_EXIT_S,
    WRONG_BLAME,
    WRONG_ERROR,
    Case,
)

Report = dict[str, Any]
#: what says a rank died in a gloo abort: the launcher's blame line, gloo's own message
ABORT_MARKS = ("SIGABRT", "EnforceNotMet")


@dataclass
class LaunchEnd:
    """How one ``lowband run`` ended: its exit status, its stderr and the ranks' logs, whether the
    orchestrator killed it (the case that ran past the bound), survivors' exit delays (family 6)."""

    returncode: int | None
    stderr: str = ""
    logs: str = ""
    hung: bool = False
    seconds: float = 0.0
    exit_delays: dict[int, float] = field(default_factory=dict)


def excerpt(text: str, n: int = 600) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-8:])[-n:]


def blame_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("lowband run: ")]


def launch_failure(end: LaunchEnd) -> tuple[str, str]:
    """A case whose ranks did not all report: killed past its bound, a gloo abort, or another death."""
    if end.hung:
        return HANG, f"ran past the per-probe bound; {excerpt(end.stderr)}"
    text = end.stderr + "\n" + end.logs
    if any(mark in text for mark in ABORT_MARKS):
        marks = [ln for ln in text.splitlines() if any(m in ln for m in ABORT_MARKS)]
        return GLOO_ABORT, excerpt("\n".join(marks) or text)
    return CRASH, f"exit {end.returncode}: " + excerpt("\n".join(blame_lines(end.stderr)) or text)


def _errors(reports: list[Report]) -> list[str | None]:
    return [r.get("etype") for r in reports]


def _first_error(reports: list[Report]) -> str:
    for i, r in enumerate(reports):
        if r.get("etype"):
            return f"rank {i}: {r['etype']}: {r.get('error', '')}"[:600]
    return ""


def _mixed(reports: list[Report]) -> tuple[str, str]:
    """Some ranks raised, some did not: the ones that did not trained on."""
    quiet = [i for i, r in enumerate(reports) if not r.get("etype")]
    return SILENT, f"ranks {quiet} trained on without an error; {_first_error(reports)}"


def _same_verdict(reports: list[Report]) -> bool:
    return len({r.get("error", "").split(": ", 1)[-1] for r in reports}) == 1


def _synced(reports: list[Report], tol: float = 1e-9) -> bool:
    finals: list[list[float]] = [r.get("replicated") or r["final"] for r in reports]
    return all(max(abs(a - b) for a, b in zip(f, finals[0])) <= tol for f in finals[1:])


def _nonfinite_raise(case: Case, reports: list[Report]) -> tuple[str, str]:
    errs = _errors(reports)
    if not any(errs):
        bad = [i for i, r in enumerate(reports) if not r.get("finite", True)]
        return SILENT, f"no rank raised; non-finite model on ranks {bad}"
    if not all(errs):
        return _mixed(reports)
    wrong = []
    for i, r in enumerate(reports):
        msg = r.get("error", "")
        named = all(f"rank {b} " in msg for b in case["bad"]) or "torch DDP averaged it" in msg
        if r["etype"] != "NonFiniteError" or not named or f"at step {case.get('bad_step', 2)}" not in msg:
            wrong.append(f"rank {i}: {r['etype']}: {msg}"[:600])
    if wrong:
        return WRONG_ERROR, "; ".join(wrong)
    nan = [i for i, r in enumerate(reports) if not r.get("finite", True)]
    if nan:
        return NAN_MODEL, f"NonFiniteError raised, but ranks {nan} hold a non-finite model"
    return OK_ERROR, reports[0]["error"][:300]


def _nonfinite_skip(case: Case, reports: list[Report]) -> tuple[str, str]:
    errs = _errors(reports)
    if all(errs):
        if set(errs) == {"InvalidArgumentError"} and _same_verdict(reports):
            return OK_ERROR, f"refused: {reports[0]['error'][:300]}"
        return WRONG_ERROR, _first_error(reports)
    if any(errs):
        return _mixed(reports)
    problems = []
    for i, r in enumerate(reports):
        if not r["finite"] or r["state_bad"]:
            problems.append(f"rank {i}: model finite {r['finite']}, non-finite state {r['state_bad'][:3]}")
        if r["final"] == r["after"]:
            problems.append(f"rank {i}: parameters never changed after the skipped step (frozen)")
        if i in case["bad"] and r["skipped"] < 1:
            problems.append(f"rank {i}: held the value, skipped {r['skipped']} steps")
    if all(r["in_sync"] for r in reports) and not _synced(reports):
        problems.append("the replicas differ although the strategy says they are in sync")
    return (SILENT, "; ".join(problems)) if problems else (OK_TRAINED, "skipped, trained on, finite")


def _tied(case: Case, reports: list[Report]) -> tuple[str, str]:
    errs = _errors(reports)
    if all(errs):
        good = all(
            r["etype"] == "InvalidArgumentError" and "'emb'" in r["error"] and "'dec'" in r["error"]
            for r in reports
        )
        return (
            (OK_ERROR, f"refused: {reports[0]['error'][:300]}")
            if good
            else (WRONG_ERROR, _first_error(reports))
        )
    if any(errs):
        return _mixed(reports)
    problems = []
    for i, r in enumerate(reports):
        if r["tie"] != [True, 0.0] or r["tie_loaded"] != [True, 0.0] or not r["loaded_equal"]:
            problems.append(f"rank {i}: tie after training {r['tie']}, after loading {r['tie_loaded']}")
        if case.get("exact") and r["oracle_err"] > 1e-9:
            problems.append(f"rank {i}: differs from the single-process model by {r['oracle_err']:.3g}")
    return (SILENT, "; ".join(problems)) if problems else (OK_TRAINED, "the tie kept (is, equal, reloaded)")


def _names(msg: str, value: str) -> bool:
    """``msg`` shows ``value`` as given or in its canonical spec form (every ``key=value`` of it, string
    values quoted: ``onebit:threshold_mode=absolute`` is ``onebit:...;threshold_mode='absolute'``)."""
    if value in msg:
        return True
    plain = msg.replace("'", "")
    head, _, opts = value.partition(":")
    return head in plain and all(part in plain for part in opts.split(";") if part)


def _mismatch(case: Case, reports: list[Report]) -> tuple[str, str]:
    errs = _errors(reports)
    if not any(errs):
        return SILENT, "every rank built and trained with differing options"
    if not all(errs):
        return _mixed(reports)
    for i, r in enumerate(reports):
        msg = r["error"]
        named = f"option {case['option']!r}" in msg and all(_names(msg, v) for v in case["values"])
        if r["etype"] != "CollectiveMismatchError" or not named or "rank 0" not in msg or "rank 1" not in msg:
            return WRONG_ERROR, f"rank {i}: {r['etype']}: {msg}"[:600]
    if not _same_verdict(reports):
        return WRONG_ERROR, "the ranks' verdicts differ"
    return OK_ERROR, reports[0]["error"][:300]


def _refused(reports: list[Report], needle: str = "") -> tuple[str, str] | None:
    errs = _errors(reports)
    if all(errs):
        if set(errs) <= AGREED_ERRORS and all(needle in r["error"] for r in reports):
            return OK_ERROR, f"refused: {reports[0]['error'][:300]}"
        return WRONG_ERROR, _first_error(reports)
    if any(errs):
        return _mixed(reports)
    return None


def _checkpoint(case: Case, reports: list[Report]) -> tuple[str, str]:
    kind = case["kind"]
    if kind == "ckpt-save":
        return _refused(reports) or (OK_TRAINED, "saved")
    if kind == "ckpt-option":
        return _refused(reports, f"option {case['option']!r}") or (
            SILENT, f"loaded a state saved under {case['saved_options']} into {case['options']}")  # fmt: skip
    done = _refused(reports)
    if done is not None:
        return done
    problems = [f"rank {i}: a non-finite model" for i, r in enumerate(reports) if not r["finite"]]
    if kind == "ckpt-direct":
        if reports[0]["differs"]:
            problems.append(
                f"loaded without a word, dropping rank 2's per-rank state {reports[0]['differs'][:3]}"
            )
        problems += [
            f"rank {i}: the model is not the one saved" for i, r in enumerate(reports) if not r["restored"]
        ]
    else:
        problems += [
            f"rank {i}: resumed at step {r['start']}, not 3" for i, r in enumerate(reports) if r["start"] != 3
        ]
        problems += [v for v in reports[0]["violations"]]
    if all(r["in_sync"] for r in reports) and not _synced(reports):
        problems.append("the replicas differ although the strategy says they are in sync")
    return (SILENT, "; ".join(problems)) if problems else (OK_TRAINED, "restored")


def classify(case: Case, reports: list[Report | None], end: LaunchEnd) -> tuple[str, str]:
    """The outcome of a case of families 1-5 and a line saying why."""
    if any(r is None for r in reports):
        return launch_failure(end)
    full: list[Report] = [r for r in reports if r is not None]
    if case["kind"] == "nonfinite":
        return (_nonfinite_skip if case["policy"] == "skip" else _nonfinite_raise)(case, full)
    if case["kind"] == "tied":
        return _tied(case, full)
    if case["kind"] == "mismatch":
        return _mismatch(case, full)
    return _checkpoint(case, full)


def classify_signal(case: Case, end: LaunchEnd) -> tuple[str, str]:
    """Family 6: the killed or stopped rank named first, every survivor out within SURVIVOR_EXIT_S."""
    if end.hung:
        return HANG, f"ran past the per-probe bound; {excerpt(end.stderr)}"
    if any(mark in end.stderr + end.logs for mark in ABORT_MARKS):
        return launch_failure(end)
    lines = blame_lines(end.stderr)
    if end.returncode == 0 or not lines:
        return CRASH, f"exit {end.returncode}, no blame: {excerpt(end.stderr)}"
    v = case["victim"]
    said = "killed by SIGKILL" if case["signal"] == "SIGKILL" else "stopped answering first"
    if not (lines[0].startswith(f"lowband run: rank {v} ") and said in lines[0]):
        return WRONG_BLAME, "\n".join(lines[:3])
    slow = {r: d for r, d in end.exit_delays.items() if d > SURVIVOR_EXIT_S}
    if slow:
        return SLOW_EXIT, f"survivors' exit delays {slow} s; {lines[0][:200]}"
    return OK_ERROR, lines[0][:300]
