"""Long copies and hashes of large objects, run off the request path.

# NOTE [ Heavy work off the request path ]
A sync route, and every ``run_in_threadpool``, takes a thread of one pool that the whole API
shares (anyio's default limiter: 40 threads). Joining a resumable upload's parts, hashing a
direct upload or an import into the cache, checking a dataset file and copying an uploaded
weights file each hold their thread for as long as the object takes to read: 40 of them at once
and every sync route (``/healthz`` included) waits for one to end, and even 20 of them, each
holding the GIL by turns, make a short request wait behind 20 others for the interpreter.

So this work takes its turn in threads of its own (:class:`HeavyWork`):
``BNADAPT_API_COPY_THREADS`` threads (4 by default) for the long work, and two more for the
pieces of streamed uploads (a few milliseconds each, NOTE [ Streamed uploads ] in
service/api/transfers.py), apart so that a piece never waits behind a long copy. The work
beyond them waits, first come first served, without holding a thread of the request path; the
routes still answer when the work is done, so the API's contract (201 with the dataset) is
unchanged. What waits is a request whose client waits for its answer anyway; the limits of what
a tenant may start (uploads, their sizes) bound how much of it there can be.

# NOTE [ Bytes at a lower priority ]
Threads of their own are not enough on a busy machine. A thread hashing 4 MiB holds a processor
for milliseconds without the GIL, and the request path's threads then wait for a processor as
much as for the interpreter: with 20 uploads of 64 MiB at once, another tenant's status read
took 190 ms at the 99th percentile where it took 7 ms alone, with the API on a processor of its
own. So these threads run at a lower processor priority (``BNADAPT_API_COPY_NICE``, a nice
value added to the API's; Linux sets it per thread): the kernel then runs a request's thread
first whenever it is ready, and the bytes take the time the requests leave. With the same flood
that read's p99 came to 1.1-4.6x its quiet figure (2.4x at the median of 7 runs one morning,
3.0-4.6x in 5 runs later that day; 1.57-2.58x on a quiet machine with every thread pinned),
where it was 12-22x (bench/RESULTS.md, the noisy-neighbour rows). Not lower, because a
thread at a low priority that runs Python holds the GIL while the kernel runs it last: the
requests then wait for it (a priority inversion, measured there).
The uploads are as fast when the processor has room; when it has none (a worker's jobs on the
same machine too), they slow down, not the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar, TypeVarTuple, Unpack

__all__ = ["COPY_NICE_SETTING", "COPY_THREADS_SETTING", "HeavyWork", "lower_process_priority"]

COPY_THREADS_SETTING: Final = "BNADAPT_API_COPY_THREADS"
COPY_NICE_SETTING: Final = "BNADAPT_API_COPY_NICE"
_PIECE_THREADS: Final = 2

_T = TypeVar("_T")
_Args = TypeVarTuple("_Args")


def _lower_thread(tid: int, nice: int) -> None:
    """Lowers thread ``tid``'s processor priority by ``nice`` (Linux: a nice value per thread;
    the kernel caps it at 19)."""
    os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


def _lower_priority(nice: int) -> None:
    """Lowers the calling thread's processor priority by ``nice`` (NOTE [ Bytes at a lower
    priority ]). Linux only: elsewhere a thread's id is no process id to pass here."""
    if nice and sys.platform == "linux":
        _lower_thread(threading.get_native_id(), nice)


def lower_process_priority(nice: int) -> None:
    """Lowers every thread of this process by ``nice`` (``BNADAPT_API_NICE``). Linux keeps a
    nice value per thread and ``os.nice`` changes the caller's alone: threads started before
    (the server's, a library's) would stay at the old priority, so each is changed here."""
    if not nice:
        return
    if sys.platform != "linux":
        os.nice(nice)
        return
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            _lower_thread(int(task), nice)


class _Threads:
    """A pool of ``threads`` threads at ``nice`` below the API's priority."""

    def __init__(self, threads: int, nice: int, name: str) -> None:
        self._executor = ThreadPoolExecutor(
            threads, thread_name_prefix=name, initializer=_lower_priority, initargs=(nice,)
        )

    async def run(self, function: Callable[[Unpack[_Args]], _T], *args: *_Args) -> _T:
        # The caller's context goes along (its log fields), as anyio's threads take it.
        context = contextvars.copy_context()
        future = self._executor.submit(lambda: context.run(function, *args))
        done = asyncio.wrap_future(future)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            # The request was canceled (its client went away). Work not started is dropped;
            # work under way may hold a store writer that the caller closes next, so the
            # caller waits for it to end first (as anyio's threads make it), then is canceled.
            future.cancel()
            while not done.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({done})
            raise

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class HeavyWork:
    """Threads for long blocking work and for the pieces of streamed uploads, at a lower
    priority (NOTE [ Heavy work off the request path ], NOTE [ Bytes at a lower priority ]).
    Built in the API's lifespan, inside its event loop; :meth:`close` at its end."""

    def __init__(self, threads: int, nice: int = 0) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads} ({COPY_THREADS_SETTING})")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be in [0, 19], got {nice} ({COPY_NICE_SETTING})")
        self._long = _Threads(threads, nice, "bnadapt-copy")
        self._pieces = _Threads(_PIECE_THREADS, nice, "bnadapt-piece")

    async def run(self, function: Callable[[Unpack[_Args]], _T], *args: *_Args) -> _T:
        """``function(*args)`` in a thread for long work, once one is free; its result or its
        exception."""
        return await self._long.run(function, *args)

    async def piece(self, function: Callable[[Unpack[_Args]], _T], *args: *_Args) -> _T:
        """``function(*args)``, a few milliseconds of work on a streamed upload's piece, in a
        thread that long work never holds."""
        return await self._pieces.run(function, *args)

    def close(self) -> None:
        """Drops the work not started; what runs ends on its own."""
        self._long.close()
        self._pieces.close()
