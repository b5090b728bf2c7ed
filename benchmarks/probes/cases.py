"""The grid: issue 29's six families over every registered strategy where a family applies."""

from __future__ import annotations

from typing import Any

from benchmarks.probes.common import Case

#: options every probe of a strategy uses (auto chooses among the compressed schemes, as the tests do;
#: the globally sparse ones keep a residual at this small model's size; compressed keeps error feedback)
BASE: dict[str, dict[str, Any]] = {
    "auto": {"only": "compressed"},
    "gs-sgd": {"density": 0.1},
    "sketched-sgd": {"density": 0.1},
    "gtopk": {"density": 0.1},
    "topk-allgather": {"density": 0.1},
    "compressed": {"compressor": "topk:ratio=0.2"},
}
#: strategies that train exactly as the single-process model (family 2 compares them with it)
EXACT = {"ddp", "stage", "compressed", "gradient-allreduce", "dense-priority", "powersgd"}
#: strategies with an error-feedback residual (family 1 also puts the value on every rank)
RESIDUAL = ["compressed", "gs-sgd", "gtopk", "sketched-sgd", "topk-allgather", "slimgc"]
#: family 6: strategies whose ranks are killed and stopped (DDP's buckets, a compressed stage with
#: error feedback, SlimGC's helper thread, gTop-k's tree)
SIGNALLED = ["ddp", "compressed", "slimgc", "gtopk"]
QUICK = ["ddp", "stage", "gtopk", "gs-sgd", "slimgc", "embrace", "localsgd"]
#: the issue's option mismatches: strategy, rank 0's options, rank 1's, the option to be named
ISSUE_MISMATCHES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("compressed", {"compressor": "qsgd:levels=7"}, {"compressor": "qsgd:levels=5"}, "compressor"),
    ("compressed", {"compressor": "onebit", "reducer": "ps"}, {"compressor": "sign", "reducer": "ps"}, "compressor"),
    ("compressed", {"compressor": "onebit"}, {"compressor": "twobit"}, "compressor"),
    ("slimgc", {"compressor": "onebit:threshold=0.5"}, {"compressor": "onebit:threshold=0.1"}, "compressor"),
    ("slimgc", {"comm_threshold": 0}, {"comm_threshold": float("inf")}, "comm_threshold"),
    ("gs-sgd", {"density": 0.1}, {"density": 0.3}, "density"),
    ("embrace", {"schedule": "2d"}, {"schedule": "hybrid"}, "schedule"),
]  # fmt: skip
#: option changed between a save and a load (family 4): strategy, saved options, loaded, the option
OPTION_LOADS: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("gs-sgd", {"density": 0.1}, {"density": 0.3}, "density"),
    ("gtopk", {"density": 0.1}, {"density": 0.3}, "density"),
    ("topk-allgather", {"density": 0.1}, {"density": 0.3}, "density"),
    ("sketched-sgd", {"density": 0.1}, {"density": 0.3}, "density"),
    ("compressed", {"compressor": "topk:ratio=0.2"}, {"compressor": "topk:ratio=0.5"}, "compressor"),
]


def strategies(quick: bool = False) -> list[str]:
    """lowband's registered strategies (the registry, not a list here); ``quick``: a few of them."""
    import lowband.strategies
    from lowband.strategies.registry import STRATEGIES

    names = [
        n for n in lowband.strategies.strategy_names() if STRATEGIES.get(n).__module__.startswith("lowband.")
    ]
    return [n for n in names if n in QUICK] if quick else names


def _case(family: int, cid: str, kind: str, ranks: int, **params: Any) -> Case:
    return {"family": family, "id": cid, "kind": kind, "ranks": ranks, **params}


def _opts(name: str) -> dict[str, Any]:
    return dict(BASE.get(name, {}))


def family1(names: list[str]) -> list[Case]:
    """Training goes on after a non-finite step (on_nonfinite='skip'): NaN on rank 1, and on every rank
    for the strategies with a residual (issue: gtopk froze, a NaN kept in its residual)."""
    out = [
        _case(1, f"{n} nan rank1 skip", "nonfinite", 2, strategy=n, options=_opts(n), policy="skip", value="nan", bad=[1])
        for n in names
    ]  # fmt: skip
    out += [
        _case(1, f"{n} nan all skip", "nonfinite", 2, strategy=n, options=_opts(n), policy="skip", value="nan", bad=[0, 1])
        for n in RESIDUAL if n in names
    ]  # fmt: skip
    return out


def family2(names: list[str]) -> list[Case]:
    """Tied weights stay tied (trained, after a checkpoint round trip) or are refused naming both modules."""
    return [
        _case(
            2, f"{n} tied", "tied", 2, strategy=n, options=_opts(n) if n == "auto" else {}, exact=n in EXACT
        )
        for n in names
    ]


def _alternative(opt: Any) -> Any:
    """A valid value of ``opt`` (a :class:`lowband.options.Opt`) other than its default, or None."""
    d = opt.default
    choices = opt._choices() if opt.choices is not None and opt.spec is None else None
    if choices:
        other = [c for c in choices if c != d]
        return other[0] if other else None
    if opt.kind is bool:
        return not d
    if opt.kind is int:
        return 5 if d is None else d + 1
    if opt.kind is float and (d is None or isinstance(d, (int, float))):
        if d is None:
            return 0.3
        return 0.5 if d == 0 else round(d * 1.5 if d >= 1 else d / 2, 6)
    return None


def _valid(registry: Any, name: str, options: dict[str, Any]) -> bool:
    """Whether ``options`` pass the item's schema (a value refused on one rank alone is no mismatch)."""
    from lowband.errors import InvalidArgumentError

    try:
        registry.check_options(name, options)
    except InvalidArgumentError:
        return False
    return True


def compressor_options() -> list[tuple[str, str, Any, dict[str, Any]]]:
    """``(compressor, option, other value, options both ranks set)`` for every option of every compressor."""
    from lowband.compress.base import COMPRESSORS

    out = []
    for name in COMPRESSORS:
        for key, opt in COMPRESSORS.options(name).opts.items():
            alt = _alternative(opt)
            modes = "threshold_mode" in COMPRESSORS.options(name).opts
            both = {"threshold_mode": "absolute"} if key == "scale" and modes else {}
            if alt is not None and _valid(COMPRESSORS, name, {**both, key: alt}):
                out.append((name, key, alt, both))
    return out


def strategy_options(names: list[str]) -> list[tuple[str, str, Any]]:
    """``(strategy, option, other value)``: each strategy's first option that has a plain other value."""
    from lowband.strategies.registry import STRATEGIES

    out = []
    for n in names:
        for key, opt in STRATEGIES.options(n).opts.items():
            alt = _alternative(opt)
            if (
                alt is not None
                and key not in BASE.get(n, {})
                and _valid(STRATEGIES, n, {**_opts(n), key: alt})
            ):
                out.append((n, key, alt))
                break
    return out


def _spec(name: str, opts: dict[str, Any]) -> str:
    return name + (":" + ";".join(f"{k}={v}" for k, v in opts.items()) if opts else "")


def family3(names: list[str], quick: bool = False) -> list[Case]:
    """Ranks built with different options: the issue's seven, one per compressor option (through
    ``compressed``), one per strategy."""
    out = [
        _case(3, f"{s} {o0} vs {o1}", "mismatch", 2, strategy=s, per_rank=[o0, o1], option=opt,
              values=[str(o0[opt]).split(":")[-1], str(o1[opt]).split(":")[-1]])
        for s, o0, o1, opt in ISSUE_MISMATCHES
    ]  # fmt: skip
    comp = compressor_options()
    for c, key, alt, both in comp[:3] if quick else comp:
        a, b = _spec(c, both), _spec(c, {**both, key: alt})
        out.append(_case(3, f"compressed {a} vs {b}", "mismatch", 2, strategy="compressed",
                         per_rank=[{"compressor": a}, {"compressor": b}], option="compressor",
                         values=[f"{key}=", f"{key}={alt}"]))  # fmt: skip
    for s, key, alt in strategy_options(names):
        base = _opts(s)
        out.append(_case(3, f"{s} {key} default vs {alt}", "mismatch", 2, strategy=s,
                         per_rank=[base, {**base, key: alt}], option=key, values=[str(alt)]))  # fmt: skip
    return out


def family4(names: list[str], folder: str) -> tuple[list[Case], list[Case]]:
    """Checkpoints: (the 3-rank saves, the 2-rank loads: as saved, through the Checkpointer, and with
    an option changed since the save)."""
    saves, loads = [], []
    for n in names:
        f = f"{folder}/{n}"
        saves.append(_case(4, f"{n} save at 3", "ckpt-save", 3, strategy=n, options=_opts(n), folder=f))
        loads.append(_case(4, f"{n} 3-rank state_dict loaded at 2", "ckpt-direct", 2, strategy=n,
                           options=_opts(n), folder=f, saved_ranks=3))  # fmt: skip
        loads.append(_case(4, f"{n} Checkpointer 3 -> 2", "ckpt-resume", 2, strategy=n, options=_opts(n),
                           folder=f, saved_ranks=3))  # fmt: skip
    for s, saved, now, opt in OPTION_LOADS:
        if s in names:
            loads.append(_case(4, f"{s} saved {saved} loaded {now}", "ckpt-option", 2, strategy=s,
                               saved_options=saved, options=now, option=opt))  # fmt: skip
    return saves, loads


def family5(names: list[str], quick: bool = False) -> list[Case]:
    """on_nonfinite='raise' (the default): NaN and Inf on rank 1 and on every rank, at 3 ranks; then
    one NaN through each compressor, SlimGC with and without its offload thread."""
    out = []
    for n in names:
        for value in ("nan", "inf"):
            for bad in ([1], [0, 1, 2]):
                who = "rank1" if bad == [1] else "all"
                out.append(_case(5, f"{n} {value} {who}", "nonfinite", 3, strategy=n, options=_opts(n),
                                 policy="raise", value=value, bad=bad))  # fmt: skip
    if quick:
        return out
    from lowband.compress.base import COMPRESSORS

    for c in COMPRESSORS:
        out.append(_case(5, f"compressed:{c} nan rank1", "nonfinite", 3, strategy="compressed",
                         options={"compressor": c}, policy="raise", value="nan", bad=[1]))  # fmt: skip
    for offload in (True, False):
        out.append(_case(5, f"slimgc offload={offload} comm_threshold=0 nan rank1", "nonfinite", 3,
                         strategy="slimgc", options={"offload": offload, "comm_threshold": 0},
                         policy="raise", value="nan", bad=[1]))  # fmt: skip
    return out


def family6(quick: bool = False) -> list[Case]:
    """SIGKILL and SIGSTOP of each rank index at 3 ranks: each its own launch."""
    names = SIGNALLED[:1] if quick else SIGNALLED
    return [
        _case(6, f"{n} {sig} rank{v}", "signal", 3, strategy=n, options=_opts(n), signal=sig, victim=v)
        for n in names for sig in ("SIGKILL", "SIGSTOP") for v in range(3)
    ]  # fmt: skip
