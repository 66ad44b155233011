"""A process's part of its job's memory (NOTE [ A job's memory among its processes ] in
workers/training/ranks.py): what a process may still allocate under its ``RLIMIT_DATA``, a
share of it given to a process it starts, and the loader processes of a pass holding
themselves to theirs.

NOTE [ Loader processes' memory ]
A DataLoader's processes are forks of the process that iterates them and inherit its limit,
each able to allocate all that process had left: L loader processes could take L + 1 times
what the job may hold. So while loader processes run, what their parent has left is divided
equally among it and them: each loader holds itself to its share when it starts
(``worker_init_fn``), and the parent lowers its own soft limit to its share until the loader
ends, then takes back the rest. ``RLIMIT_DATA`` counts a process's private writable
mappings, virtual: what a loader holds of its parent's pages it holds from the fork (not its
share), the batches it hands over cross in shared memory (not counted). Fewer loader
processes (``loader_workers``, ``BNADAPT_LOADER_PROCESSES``) leave each process more.
"""

from __future__ import annotations

import contextlib
import re
import resource
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

__all__ = ["hold_process_to", "loader_shares", "memory_left", "vm_data"]


def vm_data() -> int | None:
    """This process's data segment as ``RLIMIT_DATA`` counts it (VmData), in bytes."""
    with contextlib.suppress(OSError):
        match = re.search(r"^VmData:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
        if match:
            return int(match.group(1)) * 1024
    return None


def memory_left() -> int | None:
    """What this process may still allocate under its ``RLIMIT_DATA``; None without a limit
    (a worker that holds its jobs to nothing, or a GPU job)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    held = vm_data()
    if soft == resource.RLIM_INFINITY or held is None:
        return None
    return max(0, soft - held)


def hold_process_to(share: int) -> None:
    """Holds this process to ``share`` bytes beyond what it holds now: its part of its job's
    memory (a rank's, a loader process's), never more than the limit it inherited."""
    held = vm_data()
    if held is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = held + share if hard == resource.RLIM_INFINITY else min(held + share, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _hold_loader_to(share: int, worker_id: int) -> None:
    hold_process_to(share)


@contextlib.contextmanager
def loader_shares(loaders: int) -> Iterator[Callable[[int], None] | None]:
    """While ``loaders`` loader processes run (NOTE [ Loader processes' memory ]): this
    process held to its share, and the ``worker_init_fn`` that holds each loader to its own;
    None (and nothing held) when this process has no limit."""
    left = memory_left()
    held = vm_data()
    if left is None or held is None or loaders < 1:
        yield None
        return
    share = left // (loaders + 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (held + share, hard))
    try:
        yield partial(_hold_loader_to, share)
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
