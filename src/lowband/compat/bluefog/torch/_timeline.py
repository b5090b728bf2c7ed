"""BlueFog's timeline file, written while the program runs.

With ``$BLUEFOG_TIMELINE`` set, :func:`start` (called by ``init``) turns lowband's tracing on and writes
``$BLUEFOG_TIMELINE<rank>.json`` (Chrome trace) at once; the file is rewritten at every barrier, at
``timeline_end_activity`` and after completed waits at most every :data:`FLUSH_INTERVAL` seconds, and a
last time at ``shutdown``. Each write replaces the file atomically, so a reader never sees half of it.
"""

from __future__ import annotations

import os
import time

import lowband
from lowband.compat.bluefog.torch._state import compat_state
from lowband.runtime import current

#: the environment variable naming the timeline files' prefix (BlueFog's)
TIMELINE_ENV = "BLUEFOG_TIMELINE"
#: at most one rewrite of the file per this many seconds, except at barriers and shutdown
FLUSH_INTERVAL = 0.5


def start() -> None:
    """Turn tracing on and write the first file, when ``$BLUEFOG_TIMELINE`` is set."""
    prefix = os.environ.get(TIMELINE_ENV)
    if not prefix:
        return
    lowband.set_trace(True)
    st = compat_state(op="init")
    st.timeline_file = f"{prefix}{current('init').rank}.json"
    flush(force=True)


def flush(*, force: bool = False) -> None:
    """Rewrite this rank's timeline file (when one is being written): always with ``force``, else only
    if the last write is at least :data:`FLUSH_INTERVAL` seconds old."""
    if not lowband.is_initialized():
        return
    st = compat_state(op="timeline")
    path = st.timeline_file
    if path is None:
        return
    now = time.monotonic()
    if not force and now - st.timeline_written < FLUSH_INTERVAL:
        return
    tmp = f"{path}.tmp{os.getpid()}.{current('timeline').rank}"
    lowband.chrome_trace(tmp)
    os.replace(tmp, path)
    st.timeline_written = now
