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
beyond them waits for its turn (below), without holding a thread of the request path; the
routes still answer when the work is done, so the API's contract (201 with the dataset) is
unchanged. What waits is a request whose client waits for its answer anyway; the limits of what
a tenant may start (uploads, their sizes) bound how much of it there can be.

# NOTE [ Heavy work in turns ]
The threads are shared by every tenant, so the work waiting for them takes turns by tenant
(:class:`_Turns`), not first come: a tenant that completes ten large uploads at once would
otherwise make every other tenant's registration wait for all ten. Two rules:

- Round robin: a free thread goes to the waiting work of the tenant that was given one
  least recently (a tenant that held none since it last had nothing running or waiting
  counts as never given one); each tenant's work runs in the order it came. A tenant with one
  registration waits for a thread to end, not for the work others queued.
- A share: one tenant holds at most ``BNADAPT_API_COPY_TENANT_THREADS`` of the long-work
  threads at once (half of them, rounded up, by default), even when no one else waits. A
  thread once given cannot be taken back, and the work it runs may last seconds (a large
  import), so the share is what leaves a thread free for the next tenant's registration the
  moment it comes rather than after the flood's next copy ends. A lone tenant's completions
  beyond its share wait for its own; the setting at the thread count lifts the share.

The pieces of streamed uploads take turns by the first rule only: each holds a thread for
milliseconds, so a share would slow a lone upload for nothing. The tenant is the request's
(``HeavyWorkDep`` in service/api/deps.py binds it): routes call :meth:`HeavyWork.run` as before.

# NOTE [ Bytes at a lower priority ]
Threads of their own are not enough on a busy machine. A thread hashing 4 MiB holds a processor
for milliseconds without the GIL, and the request path's threads then wait for a processor as
much as for the interpreter: during a flood of large uploads another tenant's status reads slow
down many times over, even with the API on a processor of its own. So these threads run at a
lower processor priority (``BNADAPT_API_COPY_NICE``, a nice value added to the API's; Linux sets
it per thread): the kernel then runs a request's thread first whenever it is ready, and the
bytes take the time the requests leave (the reads' p99 at each priority:
bench/history/2026-12-07-bytes-uploads-below-requests.md). That does not bring the reads back to
their quiet figure, because a thread at a low priority that runs Python holds the GIL while the
kernel runs it last: the requests then wait for it (a priority inversion:
bench/history/2026-12-07-noisy-neighbour-slow-reads-fall.md; what removes it is NOTE [ Upload
bytes in processes of their own ] in service/api/routes/uploads.py).
The uploads are as fast when the processor has room; when it has none (a worker's jobs on the
same machine too), they slow down, not the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import math
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar, TypeVarTuple, Unpack

__all__ = [
    "COPY_NICE_SETTING",
    "COPY_TENANT_THREADS_SETTING",
    "COPY_THREADS_SETTING",
    "HeavyWork",
    "lower_process_priority",
]

COPY_THREADS_SETTING: Final = "BNADAPT_API_COPY_THREADS"
COPY_NICE_SETTING: Final = "BNADAPT_API_COPY_NICE"
COPY_TENANT_THREADS_SETTING: Final = "BNADAPT_API_COPY_TENANT_THREADS"
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


class _Turns:
    """Which waiting work takes a free thread next: that of the tenant served least recently,
    at most ``share`` threads held by one tenant (NOTE [ Heavy work in turns ]). Used from the
    event loop's thread only, so it holds no lock."""

    def __init__(self, threads: int, share: int) -> None:
        self._free = threads
        self._share = share
        self._held: dict[str | None, int] = {}
        self._waiting: dict[str | None, deque[asyncio.Future[None]]] = {}  # each in order
        # When each tenant that holds or waits was last given a thread (a count of grants).
        self._served: dict[str | None, int] = {}
        self._grants = 0

    async def take(self, tenant: str | None) -> None:
        """Returns once ``tenant`` holds a thread; :meth:`give_back` it when the work ends."""
        # Whoever waits is at its share or finds no thread free (every change ends in
        # _serve): a tenant that may hold one, and has no earlier work waiting, goes now.
        if tenant not in self._waiting and self._may_hold(tenant):
            self._hold(tenant)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give_back(tenant)  # given as the request was canceled: pass it on
            else:
                self._forget(tenant, turn)
            raise

    def give_back(self, tenant: str | None) -> None:
        self._held[tenant] -= 1
        if not self._held[tenant]:
            del self._held[tenant]
            self._drop_if_idle(tenant)
        self._free += 1
        self._serve()

    def cancel_waiting(self) -> None:
        for turns in self._waiting.values():
            for turn in turns:
                turn.cancel()
        self._waiting.clear()

    def _may_hold(self, tenant: str | None) -> bool:
        return self._free > 0 and self._held.get(tenant, 0) < self._share

    def _hold(self, tenant: str | None) -> None:
        self._free -= 1
        self._held[tenant] = self._held.get(tenant, 0) + 1
        self._grants += 1
        self._served[tenant] = self._grants

    def _serve(self) -> None:
        """Gives free threads to waiting work: each to the tenant, among those under their
        share, given one least recently (a tenant new to the turns first)."""
        while self._free > 0:
            ready = [t for t in self._waiting if self._may_hold(t)]
            if not ready:
                return
            tenant = min(ready, key=lambda t: self._served.get(t, 0))
            turns = self._waiting[tenant]
            turn = turns.popleft()
            if not turns:
                del self._waiting[tenant]
            self._hold(tenant)
            turn.set_result(None)

    def _forget(self, tenant: str | None, turn: asyncio.Future[None]) -> None:
        turns = self._waiting.get(tenant)
        if turns is None or turn not in turns:
            return  # dropped by cancel_waiting
        turns.remove(turn)
        if not turns:
            del self._waiting[tenant]
            self._drop_if_idle(tenant)

    def _drop_if_idle(self, tenant: str | None) -> None:
        # A tenant that neither holds nor waits comes back as a new one: the record of the
        # tenants is as long as the turns, not as the API's life.
        if tenant not in self._held and tenant not in self._waiting:
            self._served.pop(tenant, None)


class _Threads:
    """A pool of ``threads`` threads at ``nice`` below the API's priority, taken in turns by
    tenant, at most ``share`` of them by one."""

    def __init__(self, threads: int, share: int, nice: int, name: str) -> None:
        self._executor = ThreadPoolExecutor(
            threads, thread_name_prefix=name, initializer=_lower_priority, initargs=(nice,)
        )
        self._turns = _Turns(threads, share)

    async def run(
        self, tenant: str | None, function: Callable[[Unpack[_Args]], _T], *args: *_Args
    ) -> _T:
        # Canceled while it waits for its turn, the work is dropped (nothing started).
        await self._turns.take(tenant)
        try:
            return await self._run(function, *args)
        finally:
            self._turns.give_back(tenant)

    async def _run(self, function: Callable[[Unpack[_Args]], _T], *args: *_Args) -> _T:
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
        self._turns.cancel_waiting()
        self._executor.shutdown(wait=False, cancel_futures=True)


class HeavyWork:
    """Threads for long blocking work and for the pieces of streamed uploads, at a lower
    priority, taken in turns by tenant (NOTE [ Heavy work off the request path ], NOTE [ Bytes
    at a lower priority ], NOTE [ Heavy work in turns ]). Built in the API's lifespan, inside
    its event loop; :meth:`close` at its end. A request's work runs through
    :meth:`for_tenant`'s view; work through this object itself takes the turns of no tenant
    (tenant None), one more party to them."""

    def __init__(self, threads: int, nice: int = 0, tenant_threads: int | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads} ({COPY_THREADS_SETTING})")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be in [0, 19], got {nice} ({COPY_NICE_SETTING})")
        share = math.ceil(threads / 2) if tenant_threads is None else tenant_threads
        if not 1 <= share <= threads:
            raise ValueError(
                f"a tenant's share of the copy threads must be 1 to {threads} (the threads, "
                f"{COPY_THREADS_SETTING}), got {share} ({COPY_TENANT_THREADS_SETTING}); set "
                f"it within that, or leave it unset for half of them"
            )
        self.tenant_threads = share
        self._tenant: str | None = None
        self._long = _Threads(threads, share, nice, "bnadapt-copy")
        self._pieces = _Threads(_PIECE_THREADS, _PIECE_THREADS, nice, "bnadapt-piece")

    def for_tenant(self, tenant: str) -> HeavyWork:
        """The same threads, the work run through it taking ``tenant``'s turns."""
        view = copy.copy(self)
        view._tenant = tenant
        return view

    async def run(self, function: Callable[[Unpack[_Args]], _T], *args: *_Args) -> _T:
        """``function(*args)`` in a thread for long work, once the tenant's turn gives it one;
        its result or its exception."""
        return await self._long.run(self._tenant, function, *args)

    async def piece(self, function: Callable[[Unpack[_Args]], _T], *args: *_Args) -> _T:
        """``function(*args)``, a few milliseconds of work on a streamed upload's piece, in a
        thread that long work never holds."""
        return await self._pieces.run(self._tenant, function, *args)

    def close(self) -> None:
        """Drops the work not started (its requests are canceled); what runs ends on its own."""
        self._long.close()
        self._pieces.close()
