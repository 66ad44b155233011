"""Long copies and hashes of large objects, run off the request path.

# NOTE [ Heavy work off the request path ]
A sync route, and every ``run_in_threadpool``, takes a thread of one pool that the whole API
shares (anyio's default limiter: 40 threads). Joining a resumable upload's parts, hashing a
direct upload or an import into the cache, checking a dataset file and copying an uploaded
weights file each hold their thread for as long as the object takes to read: 40 of them at once
and every sync route (``/healthz`` included) waits for one to end, and even 20 of them, each
holding the GIL by turns, make a short request wait behind 20 others for the interpreter.

So this work takes its turn in a pool of its own (a streamed upload's pieces, a few
milliseconds each, stay on the request path: NOTE [ Streamed uploads ] in
service/api/transfers.py): :class:`HeavyWork`, a capacity limiter of
``BNADAPT_API_COPY_THREADS`` threads (4 by default). The work beyond it waits, first come
first served, without holding a thread of the request path; the routes still answer when the
work is done, so the API's contract (201 with the dataset) is unchanged. What waits is a
request whose client waits for its answer anyway; the limits of what a tenant may start
(uploads, their sizes) bound how much of it there can be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeVar, TypeVarTuple, Unpack

import anyio
import anyio.to_thread

__all__ = ["COPY_THREADS_SETTING", "HeavyWork"]

COPY_THREADS_SETTING: Final = "BNADAPT_API_COPY_THREADS"

_T = TypeVar("_T")
_Args = TypeVarTuple("_Args")


class HeavyWork:
    """A pool of ``threads`` for long blocking work (NOTE [ Heavy work off the request path ]).
    Built in the API's lifespan, inside its event loop."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads} ({COPY_THREADS_SETTING})")
        self._limiter = anyio.CapacityLimiter(threads)

    async def run(self, function: Callable[[Unpack[_Args]], _T], *args: *_Args) -> _T:
        """``function(*args)`` in a thread of this pool, once one is free; its result or its
        exception."""
        return await anyio.to_thread.run_sync(function, *args, limiter=self._limiter)
