"""Link rates as tc reads them, in the one parser of ``lowband run``, ``lowband bench`` and the testbed:
``bit`` is bits, ``bps`` is *bytes* per second to tc (``100mbps`` = 800 Mbit/s), so the spellings
people read otherwise are refused with what tc would make of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowband.errors import InvalidArgumentError
from lowband.testbed.links import build_layout
from lowband.testbed.rates import format_rate, parse_rate


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("100mbit", 1e8), ("100Mbit", 1e8), ("100MBIT", 1e8), ("100Mbit/s", 1e8), ("100 mbit", 1e8),
        ("100mbits/s", 1e8), ("1gbit", 1e9), ("2.5Gbit", 2.5e9), ("500kbit", 5e5), ("1tbit", 1e12),
        ("64bit", 64.0), ("10mibit", 10 * 2**20), ("1kibit/s", 1024.0), ("1e8", 1e8), ("12345", 12345.0),
        (1e8, 1e8), (12345, 12345.0),
        # bytes written out: a capital B (or "byte") and "/s"
        ("12.5MB/s", 1e8), ("12.5MByte/s", 1e8), ("1GB/s", 8e9), ("125kB/s", 1e6), ("1KiB/s", 8192.0),
        ("100B/s", 800.0), ("3bytes/s", 24.0),
    ],
)  # fmt: skip
def test_unambiguous_rates_are_read_as_tc_reads_them(text: str | float, bits: float) -> None:
    assert parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("100mbps", "tc reads 'mbps' as megabytes per second, so 100mbps is 800 Mbit/s to tc; write "
         "100mbit for 100 Mbit/s, or 800mbit (= 100MB/s) for what tc would read"),
        ("100Mbps", "so 100Mbps is 800 Mbit/s to tc; write 100mbit for 100 Mbit/s"),
        ("100MBps", "so 100MBps is 800 Mbit/s to tc"),
        ("1gbps", "tc reads 'gbps' as gigabytes per second, so 1gbps is 8 Gbit/s to tc; write 1gbit"),
        ("500kbps", "so 500kbps is 4 Mbit/s to tc; write 500kbit for 500 kbit/s, or 4mbit (= 500kB/s)"),
        ("10bps", "tc reads 'bps' as bytes per second, so 10bps is 80 bit/s to tc; write 10bit"),
        ("100Mb", "'100Mb' is ambiguous (bits or bytes?); write 100mbit for 100 Mbit/s, or 100MB/s for "
         "100 megabytes per second (800 Mbit/s)"),
        ("100MB", "(bits or bytes?)"), ("100mb/s", "(bits or bytes?)"), ("1Gb/s", "write 1gbit for 1 Gbit/s"),
    ],
)  # fmt: skip
def test_ambiguous_units_are_refused_with_their_meaning(text: str, said: str) -> None:
    with pytest.raises(InvalidArgumentError, match="ambiguous") as ei:
        parse_rate(text)
    assert said in str(ei.value), str(ei.value)


def test_the_suggested_spellings_mean_what_the_message_says() -> None:
    """Every alternative a refusal offers parses to the rate it names."""
    assert parse_rate("100mbit") == 1e8 and parse_rate("800mbit") == 8e8 == parse_rate("100MB/s")
    assert parse_rate("4mbit") == 4e6 == parse_rate("500kB/s")


def test_malformed_zero_and_unshaped_rates() -> None:
    assert parse_rate(None) is None and parse_rate("unlimited") is None and parse_rate("none") is None
    for bad in (
        "fast",
        "100 furlongs",
        "",
        "-5mbit",
        "mbit",
        "1e8x",
        "100mbitps",
        0,
        -1.0,
        float("inf"),
        True,
    ):
        with pytest.raises(InvalidArgumentError, match="rate"):
            parse_rate(bad)  # type: ignore[arg-type]


def test_format_rate_and_its_tc_spelling_round_trip() -> None:
    assert (
        format_rate(1e8) == "100 Mbit/s"
        and format_rate(2.5e9) == "2.5 Gbit/s"
        and format_rate(None) == "unshaped"
    )
    for bits in (800.0, 5e5, 1e8, 2.5e9):
        assert parse_rate(format_rate(bits, tc=True)) == bits
    assert build_layout(2, rates=["12.5MB/s", "1gbit"]).machines[0].up == 1e8


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "-n", "2", "--rate", "100mbps", "job.py"],
        ["run", "-n", "2", "--intra-rate", "1gbps", "--ranks-per-machine", "2", "job.py"],
        ["run", "-n", "2", "--rates", "1gbit,100Mbps", "job.py"],
        ["bench", "--rate", "100mbps", "--mode", "loopback", "--force"],
        ["bench", "--sweep-rates", "10mbit,100mbps", "--mode", "loopback", "--force"],
        ["testbed", "up", "-n", "2", "--rate", "100mbps"],
    ],
)
def test_run_bench_and_testbed_refuse_them_in_one_line_before_starting(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowband.bench import runner
    from lowband.cli import main
    from lowband.testbed import netns

    (tmp_path / "job.py").write_text("raise SystemExit(7)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(netns.Testbed, "up", lambda self: pytest.fail("the testbed started"))
    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("the bench started"))
    assert main([*argv, *(["--out", str(tmp_path / "out")] if argv[0] == "bench" else [])]) == 2
    err = capsys.readouterr().err
    assert "ambiguous: tc reads" in err, err
    assert "is 800 Mbit/s to tc" in err or "is 8 Gbit/s to tc" in err, err
    assert len(err.strip().splitlines()) == 1, err
