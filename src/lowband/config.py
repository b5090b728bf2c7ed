"""Runtime settings, read from :func:`lowband.init` arguments and ``LOWBAND_*`` environment variables."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from lowband.errors import InvalidArgumentError
from lowband.options import Opt, Options

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024

#: :func:`lowband.init`'s settings (:class:`Config`), checked by :mod:`lowband.options`
SETTINGS = Options(
    {
        "timeout": Opt(float, DEFAULT_TIMEOUT_S, gt=0, finite=False, unit="seconds", doc="any wait's bound"),
        "check": Opt(bool, True, doc="collective arguments checked across ranks before each op"),
        "fusion_threshold": Opt(
            float, DEFAULT_FUSION_THRESHOLD, min=0, what="a number of bytes", doc="per fusion buffer (0: off)"
        ),
        "trace": Opt(bool, False, doc="byte counters and a timeline of every op"),
    }
)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise InvalidArgumentError(f"environment variable {name}={raw!r} is not a number") from exc


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise InvalidArgumentError(f"environment variable {name}={raw!r} is not a boolean (use 1/0)")


@dataclass
class Config:
    """Settings of one runtime context.

    timeout: seconds any communication may wait before it raises (dead peers, mismatched programs).
    check: validate collective arguments across ranks before each op (one small extra collective).
        gloo aborts the whole process on mismatched sizes, so this is on by default; turn it off
        (``LOWBAND_CHECK=0``) once a program is known to be right.
    fusion_threshold: bytes per fusion buffer for grouped ops (0 disables fusion).
    trace: record byte counters and a timeline of every op.
    """

    timeout: float = DEFAULT_TIMEOUT_S
    check: bool = True
    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    trace: bool = False

    def __post_init__(self) -> None:
        SETTINGS.check("lowband.init", dataclasses.asdict(self))

    @classmethod
    def from_env(
        cls,
        timeout: float | None = None,
        check: bool | None = None,
        fusion_threshold: int | None = None,
        trace: bool | None = None,
    ) -> Config:
        """Explicit arguments win over ``LOWBAND_TIMEOUT``/``LOWBAND_CHECK``/``LOWBAND_FUSION_THRESHOLD``/``LOWBAND_TRACE``."""
        return cls(
            timeout=timeout if timeout is not None else _env_float("LOWBAND_TIMEOUT", DEFAULT_TIMEOUT_S),
            check=check if check is not None else _env_bool("LOWBAND_CHECK", True),
            fusion_threshold=fusion_threshold
            if fusion_threshold is not None
            else int(_env_float("LOWBAND_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD)),
            trace=trace if trace is not None else _env_bool("LOWBAND_TRACE", False),
        )
