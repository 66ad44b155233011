"""Long copies and hashes of large objects, run off the request path.

# NOTE [ Heavy work off the request path ]
A sync route, and every ``run_in_threadpool``, takes a thread of one pool that the whole API
shares (anyio's default limiter: 40 threads). Joining a resumable upload's parts, hashing a
direct upload or an import into the cache, checking a dataset file and copying an uploaded
weights file each hold their thread for as long as the object takes to read: 40 of them at once
and every sync route (``/healthz`` included) waits for one to end, and even 20 of them, each
holding the GIL by turns, make a short request wait behind 20 others for the interpreter.

So this work takes its turn in a pool of its own: :class:`HeavyWork`, ``BNADAPT_API_COPY_THREADS``
threads (4 by default). The pieces of streamed uploads (NOTE [ Streamed uploads ] in
service/api/transfers.py) take theirs in a second pool of as many threads: a piece holds a
thread for milliseconds, and queued behind a long join an upload would stall mid-stream. Each
stream awaits its piece's write before it reads on, so that pool's pace is the pace at which
the API takes in upload bytes. The work beyond either pool waits, first come first served,
without holding a thread of the request path; the routes still answer when the work is done,
so the API's contract (201 with the dataset) is unchanged.

# NOTE [ Heavy work yields the processor ]
A pool of its own keeps threads free, not processor time: measured on 2 cores, 20 uploads of
64 MiB at once took the API 7.8 s of CPU in 18 s (each byte hashed twice, written twice, read
once), and another tenant's status reads, which need the event loop's thread, waited behind
them (p99 13 ms quiet, 254 ms during the uploads). So the pool's threads run at a lower
scheduling priority, ``BNADAPT_API_COPY_NICE`` (10 by default, 0 to keep the API's): Linux
schedules threads one by one, and a thread may lower its own priority without privileges (it
may not raise it back, hence threads that do only this work). The request path then has the
processor whenever it wants it, and bulk transfers take what is left: on a machine with
processor time to spare they run as fast as before. The threads hold the GIL little (hashing
and file I/O release it), so a preempted one rarely holds up the loop. Where threads cannot be
given their own priority (not Linux), the pool runs at the API's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar, TypeVarTuple, Unpack

import anyio

__all__ = ["COPY_NICE_SETTING", "COPY_THREADS_SETTING", "HeavyWork"]

COPY_THREADS_SETTING: Final = "BNADAPT_API_COPY_THREADS"
COPY_NICE_SETTING: Final = "BNADAPT_API_COPY_NICE"

_T = TypeVar("_T")
_Args = TypeVarTuple("_Args")


def _lower_priority(nice: int) -> None:
    """This thread's scheduling priority lowered by ``nice`` (NOTE [ Heavy work yields the
    processor ]); unchanged where threads have no priority of their own."""
    if nice == 0 or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


class HeavyWork:
    """A pool of ``threads`` for long blocking work (NOTE [ Heavy work off the request path ]),
    run ``nice`` steps below the API's priority. Built in the API's lifespan; :meth:`close`
    ends it."""

    def __init__(self, threads: int, nice: int = 0) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads} ({COPY_THREADS_SETTING})")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be in 0..19, got {nice} ({COPY_NICE_SETTING})")
        self._long, self._pieces = (
            ThreadPoolExecutor(
                threads,
                thread_name_prefix=f"bnadapt-{kind}",
                initializer=_lower_priority,
                initargs=(nice,),
            )
            for kind in ("heavy", "pieces")
        )

    async def run(self, function: Callable[[Unpack[_Args]], _T], *args: *_Args) -> _T:
        """``function(*args)`` in a thread of the pool of long work, once one is free; its
        result or its exception."""
        return await _call_in(self._long, function, *args)

    async def run_piece(self, function: Callable[[Unpack[_Args]], _T], *args: *_Args) -> _T:
        """``function(*args)``, a streamed upload's piece, in a thread of the pool of pieces."""
        return await _call_in(self._pieces, function, *args)

    def close(self) -> None:
        """Stops taking work; calls under way end on their own."""
        for pool in (self._long, self._pieces):
            pool.shutdown(wait=False, cancel_futures=True)


async def _call_in(
    pool: ThreadPoolExecutor, function: Callable[[Unpack[_Args]], _T], *args: *_Args
) -> _T:
    # Like anyio's threads, not cancellable: a cancelled request waits for the call to end, so
    # no caller tears down state (a store writer) that the call still uses.
    future = asyncio.get_running_loop().run_in_executor(pool, functools.partial(function, *args))
    with anyio.CancelScope(shield=True):
        result = await future
    return result
