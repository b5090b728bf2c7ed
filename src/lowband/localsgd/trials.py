"""Choosing among schedules the cost model cannot tell apart: measure them online (lowband's extension).

DreamDDP's cost model predicts a schedule's period from a profile measured in a few seconds. On this
project's 2-core testbed the prediction is off by -16 % to +26 % (README: measured/predicted 0.84-1.26),
and the interference part of the profile (``kappa``/``sigma``) swings by an order of magnitude between
two profiles of one model on one machine (kappa 0.00-0.63, sigma 0.17-3.40 over five runs of the demo).
Candidates whose predictions differ by less than that error (whole layers vs chunks of them, the chunk
sizes of ``split="auto"``) were chosen by the noise of the profile: two demo runs in five chose whole
layers and ran 33 % slower than the three that chose chunks, although both were predicted within 10 %.

So when a candidate of the other kind (whole layers against chunks) is predicted within
:data:`MODEL_ERROR` of the best, the two are *contenders* (:func:`contender_pair`; chunk sizes among
themselves differ by a few percent in prediction and measurement alike, and two contenders fit a
20-step warm-up at H = 5), and they are measured where they will run: each contender runs whole periods of real training, interleaved
(A B A B ...: slow drift of the machine hits every contender alike), switched at period boundaries
(a layer is then averaged at most ``2H - 1`` iterations apart, once). A contender's measured period is
the sum over the period's iterations of the FASTEST sample of that iteration over the contender's
periods (a pause of the training loop, an evaluation or another job's round, lands in one sample and
is dropped by the minimum; a step the schedule makes slow every period, the one averaging a whole large
layer, is kept), its last iteration including the wait for the averagings still in flight at the
period's end (the caller waits for them before it records that step: a schedule that pushes its
communication to the end of the period pays for it there, not the next contender); the ranks agree on the
slowest rank's figures (one small allreduce, done by the caller); the fastest measured contender wins,
the predicted best on a tie within :data:`TIE`. Every rank decides from the same numbers, so every rank
switches to the same schedule. No step is wasted: every trial period trains.

This module is pure (no clock, no communication): :class:`ScheduleTrial` is the bookkeeping and
:func:`contenders` / :func:`decide` the decisions, so they are tested in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lowband.errors import InvalidArgumentError

#: the cost model's relative error on this project's testbed (README's measured/predicted 0.84-1.26):
#: candidates predicted within it of the best are measured online instead of trusted
MODEL_ERROR = 0.25
#: measured periods within this fraction of the fastest count as a tie (the predicted best then wins)
TIE = 0.03
#: after a trial, a winner measured more than this fraction off its prediction has the links measured
#: again (``refit_comm``) and the candidates chosen again, once per profile
MISMATCH = 0.15
#: periods each contender runs during a trial (interleaved)
DEFAULT_TRIAL_PERIODS = 2


def contenders(predicted: Sequence[float], margin: float = MODEL_ERROR) -> list[int]:
    """Indices of the candidates whose predicted period is within ``margin`` of the best (the best
    first, then in the given order)."""
    if not predicted:
        raise InvalidArgumentError("contenders: no candidates")
    if not margin >= 0.0:
        raise InvalidArgumentError(f"contenders: margin must be >= 0, got {margin!r}")
    best = min(range(len(predicted)), key=lambda i: (predicted[i], i))
    bound = predicted[best] * (1.0 + margin)
    return [best] + [i for i, p in enumerate(predicted) if i != best and p <= bound]


def contender_pair(
    limits: Sequence[int], predicted: Sequence[float], margin: float = MODEL_ERROR
) -> list[int]:
    """The contenders among candidate chunk limits (0: whole layers): the predicted best, and the best
    predicted candidate of the other kind (whole layers vs chunks) when it is within ``margin`` of it."""
    if len(limits) != len(predicted):
        raise InvalidArgumentError(f"contender_pair: {len(limits)} limits but {len(predicted)} predictions")
    order = contenders(predicted, margin)
    best = order[0]
    other = sorted(
        (i for i in order[1:] if (limits[i] == 0) != (limits[best] == 0)), key=lambda i: (predicted[i], i)
    )
    return [best, other[0]] if other else [best]


def decide(measured: Sequence[float], tie: float = TIE) -> int:
    """Index of the winner among ``measured`` periods (contenders in :func:`contenders` order, the
    predicted best first): the fastest, unless the predicted best is within ``tie`` of it."""
    if not measured:
        raise InvalidArgumentError("decide: nothing measured")
    fastest = min(range(len(measured)), key=lambda i: (measured[i], i))
    return 0 if measured[0] <= measured[fastest] * (1.0 + tie) else fastest


@dataclass
class ScheduleTrial:
    """The running trial among ``n`` contenders of a period-``period`` schedule.

    :meth:`record` each completed step's seconds (its position in the period is the step index mod
    ``period``); at each period boundary :meth:`advance` says which contender runs next (None: the trial
    is over, call :meth:`measured`). Contender ``c`` runs trial periods ``c, c + n, c + 2n, ...``."""

    n: int
    period: int
    periods_each: int = DEFAULT_TRIAL_PERIODS
    #: trial periods completed so far
    done: int = 0
    #: samples[c][h]: seconds of iteration h of contender c's periods so far
    samples: list[list[list[float]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for what, v, lo in (
            ("n", self.n, 1),
            ("period", self.period, 1),
            ("periods_each", self.periods_each, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidArgumentError(f"ScheduleTrial: {what} must be an int >= {lo}, got {v!r}")
        if not self.samples:
            self.samples = [[[] for _ in range(self.period)] for _ in range(self.n)]

    @property
    def total(self) -> int:
        return self.n * self.periods_each

    def current(self) -> int | None:
        """The contender running now (None once the trial is over)."""
        return None if self.done >= self.total else self.done % self.n

    def record(self, position: int, seconds: float) -> None:
        """One step of the current trial period: iteration ``position`` (0..period-1) took ``seconds``."""
        c = self.current()
        if c is not None and 0 <= position < self.period and seconds >= 0.0:
            self.samples[c][position].append(float(seconds))

    def advance(self) -> int | None:
        """At a period boundary: the current trial period is complete; the contender of the next one."""
        if self.done < self.total:
            self.done += 1
        return self.current()

    def measured(self) -> list[float]:
        """Each contender's period: the sum over iterations of its fastest sample (over its trial
        periods: a pause lands in one of them); an iteration without a sample counts the median over
        contenders of that iteration's fastest (inf when no contender has one)."""
        best = [[min(s, default=None) for s in per] for per in self.samples]
        out = []
        for per in best:
            total = 0.0
            for h, v in enumerate(per):
                if v is None:
                    others = sorted(x for b in best if (x := b[h]) is not None)
                    v = others[len(others) // 2] if others else float("inf")
                total += v
            out.append(total)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "period": self.period, "periods_each": self.periods_each, "done": self.done,
                "samples": self.samples}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ScheduleTrial:
        try:
            samples = [[[float(x) for x in pos] for pos in c] for c in d["samples"]]
            t = cls(int(d["n"]), int(d["period"]), int(d["periods_each"]), int(d["done"]), samples)
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgumentError(f"ScheduleTrial.from_json: bad trial state ({e!r})") from None
        if len(t.samples) != t.n or any(len(c) != t.period for c in t.samples):
            raise InvalidArgumentError("ScheduleTrial.from_json: samples do not match n and period")
        return t
