"""Ending a child process when its parent dies, so that no orphan keeps working.

Used by the children of ``bnadapt worker`` (the RQ worker and the inspector) and by the worker
processes of ``uvicorn --workers N``: killed with SIGKILL, a parent cannot stop its children,
and orphans kept taking jobs beside a restarted supervisor, or kept the API's port bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
from typing import Final

__all__ = ["SUPERVISOR_PID_ENV", "die_with_parent", "die_with_supervisor"]

log = logging.getLogger(__name__)

# Set by a parent in its children's environment: its pid, to tell whether it already died.
SUPERVISOR_PID_ENV: Final = "BNADAPT_SUPERVISOR_PID"
_PR_SET_PDEATHSIG: Final = 1  # <linux/prctl.h>


def die_with_parent(signum: signal.Signals, parent_pid: int) -> bool:
    """Asks the kernel to send ``signum`` to this process when its parent dies (Linux); if
    the parent ``parent_pid`` is already gone, sends it now. Returns whether the request was
    made (False where prctl does not exist: macOS, say; there orphans outlive the parent).

    NOTE: the signal follows the death of the parent *thread* that started this process: a
    parent must start its children from a thread that lives as long as it does (its main
    thread)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    # The parent may have died before prctl: this process was then adopted by another one.
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)
    return True


def die_with_supervisor(signum: signal.Signals = signal.SIGTERM) -> bool:
    """:func:`die_with_parent` for a child that a parent started with its pid in
    ``BNADAPT_SUPERVISOR_PID``; False (nothing done) without it."""
    parent = os.environ.get(SUPERVISOR_PID_ENV)
    return parent is not None and die_with_parent(signum, int(parent))
