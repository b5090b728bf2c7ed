"""``--rate-change`` (:mod:`lowband.testbed.schedule`): parsing, the checks against a layout, the
schedule's timer with a stand-in for tc, and the options of ``lowband run`` / ``lowband bench`` (pure:
no testbed, no rank)."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowband.bench.config import BenchConfig
from lowband.errors import InvalidArgumentError, LowbandError
from lowband.testbed.links import Layout, build_layout
from lowband.testbed.schedule import (
    RateChange,
    RateSchedule,
    check_rate_changes,
    check_spec,
    parse_rate_changes,
    place_changes,
)


def test_parse_one_and_several() -> None:
    assert parse_rate_changes("30s:m1=10mbit") == [RateChange(30.0, 1, 1e7)]
    assert parse_rate_changes("30s:m1=10mbit, 90:m1=100Mbit/s,2m:m0=1gbit") == [
        RateChange(30.0, 1, 1e7), RateChange(90.0, 1, 1e8), RateChange(120.0, 0, 1e9),
    ]  # fmt: skip
    assert parse_rate_changes("1.5s:m0=12.5MB/s") == [RateChange(1.5, 0, 1e8)]
    assert parse_rate_changes("5s:m0=1mbit,5s:m1=1mbit")[1].machine == 1  # two machines at one time


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("", "expected TIME:mMACHINE=RATE"),
        ("30s", "cannot parse '30s'"),
        ("30s:1=10mbit", "cannot parse"),
        ("m1=10mbit", "cannot parse"),
        ("-3s:m1=10mbit", "cannot parse"),
        ("30s:m1=10mbps", "ambiguous"),
        ("30s:m1=fast", "cannot parse"),
        ("30s:m1=none", "a change needs a rate"),
        ("30s:m1=20ms", "delay changes are not supported"),
        ("90s:m1=10mbit,30s:m1=100mbit", "times must not decrease"),
        ("30s:m1=10mbit,30s:m1=1mbit", "machine 1 changes twice at 30 s"),
    ],
)
def test_bad_specs_are_one_clear_error(spec: str, said: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^--rate-change: ") as exc:
        parse_rate_changes(spec)
    assert said in str(exc.value) and "\n" not in str(exc.value)


_change = st.tuples(st.integers(0, 10_000).map(lambda ms: ms / 10), st.integers(0, 7), st.integers(1, 10_000))


@given(st.lists(_change, min_size=1, max_size=6))
def test_describe_parses_back(items: list[tuple[float, int, int]]) -> None:
    seen: set[tuple[float, int]] = set()
    changes = []
    for at, m, kbit in sorted(items):
        if (at, m) not in seen:
            seen.add((at, m))
            changes.append(RateChange(at, m, kbit * 1e3))
    spec = ",".join(c.describe() for c in changes)
    back = parse_rate_changes(spec)
    assert [(c.at_s, c.machine) for c in back] == [(c.at_s, c.machine) for c in changes]
    assert [c.rate for c in back] == pytest.approx([c.rate for c in changes], rel=1e-12)
    assert ",".join(c.describe() for c in back) == spec


@given(st.text(max_size=40))
def test_any_text_parses_or_is_refused_cleanly(text: str) -> None:
    try:
        changes = parse_rate_changes(text)
    except InvalidArgumentError:
        return
    assert changes and all(c.rate > 0 and c.at_s >= 0 for c in changes)
    assert [c.at_s for c in changes] == sorted(c.at_s for c in changes)


def test_checks_against_the_layout() -> None:
    four = build_layout(4, rate="100mbit")
    check_rate_changes(parse_rate_changes("1s:m3=1mbit"), four)
    with pytest.raises(InvalidArgumentError, match=r"no machine m4; this layout has machines m0\.\.m3"):
        check_rate_changes(parse_rate_changes("1s:m4=1mbit"), four)
    two_tier = build_layout(4, rate="1gbit", ranks_per_machine=2)
    with pytest.raises(InvalidArgumentError, match="one link per machine"):
        check_rate_changes(parse_rate_changes("1s:m2=1mbit"), two_tier)
    mixed = build_layout(2, rates=["100mbit", "none"])
    check_rate_changes(parse_rate_changes("1s:m0=1mbit"), mixed)
    with pytest.raises(InvalidArgumentError, match="m1's link is not shaped both ways"):
        check_rate_changes(parse_rate_changes("1s:m1=1mbit"), mixed)
    with pytest.raises(InvalidArgumentError, match="--mode loopback never shapes"):
        check_spec("1s:m0=1mbit", four, "loopback")
    check_spec(None, build_layout(2), "loopback")  # no spec: nothing to check


def test_the_bench_config_checks_it() -> None:
    BenchConfig(world_size=2, rate="100mbit", rate_change="3s:m1=10mbit").validate()
    with pytest.raises(InvalidArgumentError, match="lowband bench: --rate-change: 3s:m2=10mbit: no machine"):
        BenchConfig(world_size=2, rate="100mbit", rate_change="3s:m2=10mbit").validate()
    with pytest.raises(InvalidArgumentError, match="not shaped both ways"):
        BenchConfig(world_size=2, rate=None, rate_change="3s:m1=10mbit").validate()


def _layout() -> Layout:
    return build_layout(2, rate="100mbit")


def test_the_schedule_applies_in_order_and_records_old_and_new() -> None:
    calls: list[tuple[int, float, float]] = []
    t0 = time.perf_counter()
    sched = RateSchedule(
        parse_rate_changes("0.05s:m1=10mbit,0.1s:m0=1mbit,0.15s:m1=100mbit"),
        _layout(),
        lambda m, r: calls.append((m, r, time.perf_counter() - t0)),
        who="test",
    )
    with sched:
        time.sleep(0.4)
    assert [(m, r) for m, r, _ in calls] == [(1, 1e7), (0, 1e6), (1, 1e8)]
    assert all(at >= due for (_, _, at), due in zip(calls, (0.05, 0.1, 0.15)))
    olds = [(c["machine"], c["old"], c["new"]) for c in sched.applied]
    assert olds == [
        (1, "100 Mbit/s", "10 Mbit/s"),
        (0, "100 Mbit/s", "1 Mbit/s"),
        (1, "10 Mbit/s", "100 Mbit/s"),
    ]
    placed = place_changes(sched.applied, sched.t0)
    assert all(0.05 <= c["at_bench_s"] < 1.0 for c in placed)


def test_stop_drops_what_is_not_due_and_ends_the_thread() -> None:
    calls: list[int] = []
    sched = RateSchedule(
        parse_rate_changes("0.02s:m1=10mbit,60s:m1=1mbit"), _layout(), lambda m, r: calls.append(m)
    )
    sched.start()
    time.sleep(0.2)
    before = time.perf_counter()
    assert len(sched.stop()) == 1 and calls == [1]
    assert time.perf_counter() - before < 1.0
    assert not any(t.name == "lowband-rate-change" for t in threading.enumerate())


def test_a_failed_change_is_recorded_and_keeps_the_old_rate() -> None:
    def refuse(m: int, r: float) -> None:
        raise LowbandError("tc said no")

    sched = RateSchedule(parse_rate_changes("0s:m1=10mbit"), _layout(), refuse)
    with sched:
        time.sleep(0.1)
    (rec,) = sched.applied
    assert rec["error"] == "tc said no" and sched._rates[1] == 1e8


def test_results_md_names_the_changes() -> None:
    from lowband.bench.report import drift_note

    assert drift_note([]) == ""
    rec = {"applied_s": 60.02, "at_bench_s": 39.75, "machine": 1, "old": "1 Gbit/s", "new": "10 Mbit/s"}
    note = drift_note([rec, {**rec, "error": "tc said no"}])
    assert "at 60.0 s after the launch (39.8 s on the steps' axis) machine m1 1 Gbit/s -> 10 Mbit/s" in note
    assert "FAILED: tc said no" in note and "initial rates" in note
