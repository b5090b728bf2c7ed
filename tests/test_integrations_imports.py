"""Importing lowband, its CLI and the integrations package imports none of the frameworks (each
integration module imports its own framework when it is imported)."""

from __future__ import annotations

import subprocess
import sys


def test_lowband_imports_no_framework() -> None:
    code = (
        "import sys, lowband, lowband.cli, lowband.integrations, lowband.strategies\n"
        "bad = sorted(m for m in ('lightning', 'pytorch_lightning', 'accelerate', 'transformers') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
