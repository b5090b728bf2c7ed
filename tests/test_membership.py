"""The membership decision (lowband.membership), pure: survivors arriving at any times, polling in any
order against a store with compare-and-set, all adopt the same member list or raise the same error."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband import membership
from lowband.errors import CommFailedError, InvalidArgumentError


def _simulate(
    n: int,
    arrivals: dict[int, int],
    exchanges: dict[int, int],
    min_ranks: int | None,
    settle: int,
    timeout: int,
    rnd: random.Random,
) -> tuple[str, dict[int, tuple[int, ...] | str]]:
    """:func:`lowband.comm.membership.agree`'s loop in ticks: each tick, the arrived survivors poll once,
    in a random order (a survivor writes its key at its arrival tick, before its first poll)."""
    last = list(range(n))
    quorum = membership.quorum_size(last, min_ranks)
    store: dict[str, str] = {}
    state = {r: {"seen": {}, "newest": 0, "began": 0} for r in arrivals}
    outcome: dict[int, tuple[int, ...] | str] = {}
    for t in range(max(arrivals.values()) + timeout + 2):
        # reads first (arrivals interleaved: a survivor writes its key before its first read), then the
        # proposals' compare-and-sets, each phase in a random order: every race of reads and writes
        polling = [r for r in sorted(arrivals) if r not in outcome and arrivals[r] <= t]
        rnd.shuffle(polling)
        proposals: list[tuple[int, str | None]] = []
        for r in polling:
            st_ = state[r]
            if arrivals[r] == t:
                store[f"rank{r}"] = str(exchanges[r])
                st_["began"] = st_["newest"] = t
            got = store.get("decision")
            if got is not None:
                proposals.append((r, None))
                continue
            for q in last:
                if q not in st_["seen"] and f"rank{q}" in store:
                    st_["seen"][q] = int(store[f"rank{q}"])
                    st_["newest"] = t
            value = membership.proposal(last, st_["seen"], quorum, settled=t - st_["newest"] >= settle)
            if value is None and t - st_["began"] >= timeout:
                value = membership.failure(last, st_["seen"], quorum, timeout)
            if value is not None:
                proposals.append((r, value))
        rnd.shuffle(proposals)
        for r, value in proposals:
            got = store["decision"] if value is None else store.setdefault("decision", value)  # compare_set
            try:
                outcome[r] = membership.adopt(membership.decode(got), r, "test")
            except CommFailedError as exc:
                outcome[r] = str(exc)
    return store["decision"], outcome


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[int, dict[int, int], dict[int, int], int | None, int, int, int]:
    n = draw(st.integers(1, 7))
    survivors = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    arrivals = {r: draw(st.integers(0, 12)) for r in survivors}
    skew = draw(st.booleans()) and draw(st.booleans())  # a quarter of the cases: exchanges differ
    exchanges = {r: 5 + (draw(st.integers(0, 1)) if skew else 0) for r in survivors}
    min_ranks = draw(st.one_of(st.none(), st.integers(1, n)))
    return (
        n,
        arrivals,
        exchanges,
        min_ranks,
        draw(st.integers(1, 6)),
        draw(st.integers(8, 30)),
        draw(st.integers(0, 2**31)),
    )


@settings(max_examples=400, deadline=None)
@given(_scenarios())
def test_every_survivor_adopts_the_one_stored_decision(
    case: tuple[int, dict[int, int], dict[int, int], int | None, int, int, int],
) -> None:
    n, arrivals, exchanges, min_ranks, settle, timeout, seed = case
    decided, outcome = _simulate(n, arrivals, exchanges, min_ranks, settle, timeout, random.Random(seed))
    assert set(outcome) == set(arrivals), "every survivor ends, within its timeout"
    quorum = membership.quorum_size(list(range(n)), min_ranks)
    d = membership.decode(decided)
    lists = {v for v in outcome.values() if isinstance(v, tuple)}
    assert len(lists) <= 1, f"survivors disagree: {outcome}"
    if d.failure:
        assert not lists and len({v for v in outcome.values()}) == 1  # the same error everywhere
        return
    assert len(d.members) >= quorum and set(d.members) <= set(arrivals)
    assert list(d.members) == sorted(d.members)
    if len(set(d.exchanges)) > 1:
        assert not lists and all("different exchanges" in v for v in outcome.values() if isinstance(v, str))
        return
    for r, v in outcome.items():
        assert v == d.members if r in d.members else "no longer a member" in str(v)
    if len(arrivals) >= quorum and max(arrivals.values()) - min(arrivals.values()) < settle:
        assert set(d.members) == set(arrivals), "survivors arriving within the settle time are all members"


def test_quorum_rules() -> None:
    assert [membership.quorum_size(list(range(n)), None) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]
    assert membership.quorum_size([0, 1, 2, 3], 1) == 1
    with pytest.raises(InvalidArgumentError, match="min_ranks"):
        membership.quorum_size([0, 1], 0)
    last = [0, 1, 2]
    assert membership.proposal(last, {0: 4}, 2, settled=True) is None  # below quorum: wait
    assert membership.proposal(last, {0: 4, 2: 4}, 2, settled=False) is None  # may still come: wait
    assert membership.proposal(last, {2: 4, 0: 4}, 2, settled=True) == "0@4,2@4"
    assert membership.proposal(last, {0: 4, 1: 4, 2: 4}, 2, settled=False) == "0@4,1@4,2@4"  # all here
    assert membership.adopt(membership.decode("0@4,2@4"), 2, "w") == (0, 2)
    with pytest.raises(CommFailedError, match="rank 1 reached the membership agreement after"):
        membership.adopt(membership.decode("0@4,2@4"), 1, "w")
    with pytest.raises(CommFailedError, match="rank 0 at exchange 4, rank 2 at exchange 5"):
        membership.adopt(membership.decode("0@4,2@5"), 0, "w")
    # strategies that average at every step: members at different steps catch up to the latest
    late = membership.decode("0@4,2@5,3@4")
    assert membership.adopt(late, 3, "w", aligned=False) == (0, 2, 3)
    assert membership.catch_up(late) == 5
    with pytest.raises(CommFailedError, match="rank 1 reached the membership agreement after"):
        membership.adopt(late, 1, "w", aligned=False)
    failed = membership.failure(last, {0: 4}, 2, 7.0)
    with pytest.raises(
        CommFailedError, match=r"a quorum of 2 of the last membership \[0, 1, 2\] was not met"
    ):
        membership.adopt(membership.decode(failed), 0, "w")
