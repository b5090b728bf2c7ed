"""lowband.options: option schemas (types, ranges, choices, nested specs, rules), and the refusals they
give before anything starts: through the bench's validation and ``lowband bench`` itself (one line,
exit code 2, no testbed, no rank), and through ``make_strategy`` on a rank."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from lowband.bench.config import BenchConfig
from lowband.bench.validate import check_strategy_specs
from lowband.errors import InvalidArgumentError
from lowband.options import Opt, Options, Rule
from lowband.registry import Registry

# -- one option ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("opt", "value", "out"),
    [
        (Opt(int, 1), "5", 5), (Opt(int, 1), 7, 7), (Opt(float, 1.0), 2, 2.0), (Opt(float, 1.0), "0.5", 0.5),
        (Opt(bool, False), "true", True), (Opt(bool, False), "False", False), (Opt(bool, False), True, True),
        (Opt(str, "a", choices=("a", "b")), "b", "b"), (Opt(float, 1.0, words=("auto",)), "auto", "auto"),
        (Opt(float, 1.0, finite=False), "inf", math.inf), (Opt(int, None, min=0), None, None),
        (Opt(str, "x", objects=(Path,)), Path("p"), Path("p")), (Opt(int, 3, min=3, max=3), 3, 3),
        (Opt(str, "a", choices=lambda: ["a", "late"]), "late", "late"),
    ],
)  # fmt: skip
def test_values_are_converted(opt: Opt, value: Any, out: Any) -> None:
    got = opt.convert("here", "k", value)
    assert got == out and type(got) is type(out)


@pytest.mark.parametrize(
    ("opt", "value", "allowed"),
    [
        (Opt(int, 1, min=1), 0, "an int >= 1"), (Opt(int, 1), "abc", "an int"), (Opt(int, 1), 2.5, "an int"),
        (Opt(int, 1), True, "an int"), (Opt(bool, False), 1, "true or false"),
        (Opt(bool, False), "yes", "true or false"), (Opt(float, 1.0), math.nan, "a number"),
        (Opt(float, 1.0), math.inf, "a number"), (Opt(float, 1.0, gt=0, max=1), 0, "a number in (0, 1]"),
        (Opt(float, 1.0, min=0, lt=1), 1, "a number in [0, 1)"), (Opt(str, "a"), 5, "a word"),
        (Opt(str, "a", choices=("a", "b")), "c", "one of 'a', 'b'"), (Opt(int, 1), None, "an int"),
        (Opt(int, None, min=0, words=("auto",)), -1, "'auto' or an int >= 0 or None"),
        (Opt(None, None, objects=(Path,)), "p", "a Path or None"),
        (Opt(str, "", parse=lambda v: [float(x) for x in v.split("/")], what="numbers a/b"), "1/x", "numbers a/b"),
    ],
)  # fmt: skip
def test_refusals_name_the_option_the_value_and_what_is_allowed(opt: Opt, value: Any, allowed: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        opt.convert("here", "k", value)
    assert str(info.value) == f"here: k must be {allowed}, got {value!r}"


def test_options_check_rules_describe_and_merge() -> None:
    o = Options(
        {"ratio": Opt(float, None, min=0, max=1, doc="fraction"), "k": Opt(int, None, min=0, unit="elements")},
        rules=[Rule(("ratio", "k"), "give ratio or k, not both", lambda v: v["ratio"] is None or v["k"] is None)],
    )  # fmt: skip
    assert o.check("w", {"ratio": "0.5"}) == {"ratio": 0.5}  # only what was given, converted
    with pytest.raises(InvalidArgumentError, match=r"^w: give ratio or k, not both \(got ratio=0.5, k=3\)$"):
        o.check("w", {"ratio": 0.5, "k": 3})
    with pytest.raises(
        InvalidArgumentError, match=r"^w: unknown option\(s\) \['x'\]; it takes \['ratio', 'k'\]$"
    ):
        o.check("w", {"x": 1})
    assert o.describe() == "ratio=None, k=None"
    assert o.help() == [
        "ratio=None: a number in [0, 1] or None; fraction",
        "k=None: an int >= 0 or None (elements)",
        "(give ratio or k, not both)",
    ]
    both = o | Options({"k": Opt(int, 0, min=1), "s": Opt(bool, False)})
    assert both.names() == ["ratio", "k", "s"] and both.opts["k"].min == 1 and len(both.rules) == 1
    with pytest.raises(InvalidArgumentError, match="names undeclared options"):
        Options({}, rules=[Rule(("z",), "z", lambda v: True)])
    with pytest.raises(InvalidArgumentError, match=r"option\(s\) \['n'\] must be given"):
        Options({"n": Opt(int)}).check("w", {})


def test_a_nested_spec_is_checked_by_its_own_registry() -> None:
    inner: Registry[Any] = Registry("part")

    def part(*, levels: int = 7) -> int:
        return levels

    inner.register("q", part, "", Options({"levels": Opt(int, min=1, max=127, doc="levels")}))
    o = Options({"part": Opt(str, "q", spec=inner, words=("auto",))})
    assert o.check("w", {"part": "q:levels=16"}) == {"part": "q:levels=16"}
    assert o.check("w", {"part": "auto"}) == {"part": "auto"}
    with pytest.raises(InvalidArgumentError) as info:
        o.check("w", {"part": "q:levels=0"})
    assert str(info.value) == "w: part='q:levels=0': part 'q': levels must be an int in [1, 127], got 0"
    with pytest.raises(InvalidArgumentError, match=r"w: part='z': unknown part 'z'; known: q"):
        o.check("w", {"part": "z"})


# -- refused before anything starts ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("embrace:schedule=diagonal",
         "strategy 'embrace': schedule must be one of 'hybrid', 'horizontal', 'vertical', '2d', got 'diagonal'"),
        ("localsgd:period=0", "strategy 'localsgd': period must be an int >= 1, got 0"),
        ("dreamddp:period=0", "strategy 'dreamddp': period must be an int >= 1 or None, got 0"),
        ("compressed:compressor=qsgd:levels=0",
         "strategy 'compressed': compressor='qsgd:levels=0': compressor 'qsgd': levels must be an int in "
         "[1, 127], got 0"),
        ("compressed:reducer=twostage:server_memory=maybe",
         "transport 'twostage': server_memory must be true or false, got 'maybe'"),
        ("compressed:memory=dgc:momentum=2", "memory 'dgc': momentum must be a number in [0, 1], got 2"),
        ("slimgc:compressor=topk:ratio=0.1;k=5", "compressor 'topk': give ratio or k, not both (got ratio=0.1, k=5)"),
        ("slimgc:backup=false,local_lr=0.1",
         "strategy 'slimgc': local_lr is the model backup's; it needs backup=true (got local_lr=0.1, backup=False)"),
        ("embrace:overlap=true", "overlap=true only with schedule='vertical' or '2d'"),
        ("atc:topology=star", "topology must be one of 'dynamic-exp2', 'exp2', 'full', 'inner-outer-exp2', 'ring'"),
        ("dreamddp:scheduler=fastest", "scheduler must be one of 'bruteforce', 'dreamddp', 'dreamddp-ls'"),
        ("gs-sgd:warmup=0.5/x,warmup_steps=2", "warmup must be densities in (0, 1] separated by '/'"),
        ("ddp:on_nonfinite=ignore", "strategy 'ddp': on_nonfinite must be one of 'raise', 'skip', 'off', got 'ignore'"),
        ("powersgd:start_iter=1", "strategy 'powersgd': start_iter must be an int >= 2, got 1"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_by_the_bench_validation(spec: str, said: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        check_strategy_specs([spec])
    msg = str(info.value)
    assert msg.startswith("lowband bench: strategy ") and said in msg and "\n" not in msg, msg
    with pytest.raises(InvalidArgumentError, match="strategy"):  # the config a run validates first
        BenchConfig(strategies=["ddp", spec], mode="loopback").validate()


def test_good_specs_pass() -> None:
    check_strategy_specs(
        [
            "compressed:compressor=qsgd:levels=16;bucket=512,reducer=ps", "embrace:schedule=2d,overlap=true",
            "slimgc:comm_threshold=inf", "slimgc:comm_threshold=4096", "dreamddp:split=auto,period=3",
            "gs-sgd:warmup=paper,warmup_steps=5", "atc:topology=ring", "ddp:on_nonfinite=skip",
        ]
    )  # fmt: skip


def test_lowband_bench_with_a_bad_option_ends_at_once_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowband.bench import runner
    from lowband.cli import main

    def no_ranks(*args: object, **kwargs: object) -> None:
        pytest.fail("the testbed started")

    monkeypatch.setattr(runner, "Testbed", no_ranks)
    out = tmp_path / "out"
    t0 = time.monotonic()
    code = main(
        ["bench", "-s", "ddp+embrace:schedule=diagonal", "-n", "2", "--mode", "loopback", "--out", str(out)]
    )
    assert code == 2 and time.monotonic() - t0 < 10
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "lowband bench: strategy 'embrace': schedule must be one of 'hybrid', 'horizontal', 'vertical', '2d', "
        "got 'diagonal'"
    ]
    assert not out.exists()


def test_make_strategy_converts_and_refuses_with_the_schema() -> None:
    import torch
    from torch import nn

    from lowband.strategies import make_strategy
    from lowband.testing import run_threads

    def body() -> tuple[int, str]:
        model = nn.Linear(2, 1)
        s = make_strategy("localsgd", model, lambda ps: torch.optim.SGD(ps, lr=0.1), period="3")
        period = s.period  # type: ignore[attr-defined]
        s.close()
        with pytest.raises(InvalidArgumentError) as info:
            make_strategy("localsgd", nn.Linear(2, 1), lambda ps: torch.optim.SGD(ps, lr=0.1), period=0)
        return period, str(info.value)

    for rank, (period, msg) in enumerate(run_threads(body, 2, timeout=60)):
        assert period == 3 and type(period) is int
        assert msg == f"make_strategy('localsgd') on rank {rank}: period must be an int >= 1, got 0"
