import faulthandler
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _hard_deadline(request: pytest.FixtureRequest) -> Iterator[None]:
    """A last resort for a deadlock that pytest-timeout cannot end: its SIGALRM handler is Python and
    needs the GIL, which a thread blocked in C++ while holding it never gives back (a rank thread
    waiting on a torch generator's mutex did so once). faulthandler's watchdog is a C thread: 60 s
    past the test's own timeout it dumps every thread's stack and exits the process, so a run fails
    with the stacks instead of hanging."""
    marker = request.node.get_closest_marker("timeout")
    limit = (
        float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 300)
    )
    faulthandler.dump_traceback_later(limit + 60, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
