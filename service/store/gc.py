"""Garbage collection of store objects that nothing refers to.

# NOTE [ Store garbage collection ]
Objects are shared: the same bytes uploaded twice, or weights a job writes again, are one object
with several referrers (the set ``keys.sha_refs``: models, datasets, jobs). An object becomes
garbage when its last referrer is deleted, and when a process stops between writing an object
and registering it: a refused upload, a job whose output is dropped, an API or worker that died.

Nothing deletes an object at once. Deleting a model or dataset only drops its reference and
records when (``keys.STORE_RELEASED``); the collector deletes later. Deleting at once races with
a concurrent writer of the same bytes: the writer finds the object present, the deleter removes
it, the writer registers a model whose file is gone. Likewise a job submitted while its model
is being deleted read the model's record before the delete and adds its own reference after it.

The collector deletes an object only when all of these hold:
1. no referrer now;
2. the object was last written before the grace period began. Every write sets the object's
   mtime, also one that finds it already there (``LocalStore._commit``), and whoever writes an
   object registers it within seconds (an upload within the inspection timeout);
3. no reference to it was dropped within the grace period, so a request that read a record
   just before it was deleted has long since added its reference.
Between the collector's checks and the unlink a writer could still touch the object. So the
collector first renames the object out of reach (after that a writer finds nothing and writes
it anew), checks 2 and 1 again on the moved file, and puts it back if either changed.

The grace period (``BNADAPT_STORE_GC_GRACE_S``, an hour by default) must exceed the longest
time between writing an object, or reading a record, and registering the reference, and the
clock difference between the machines that share the store (on NFS, also the attribute cache
time, ``actimeo``, after which a collector sees another machine's fresh mtime). A sharded
job's merged weights wait for its evaluation children under a reference of the merge's own
(service/records/job_life/shards.py ``hold_weights``), dropped when the job ends.

One collection runs at a time in the whole deployment (a Redis lock, renewed before each batch
of objects); the API and every worker supervisor start one when it is due
(``BNADAPT_STORE_GC_INTERVAL_S``), and ``bnadapt store gc`` runs one now.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import redis

from service.records import keys
from service.store.base import Store

__all__ = [
    "Collection",
    "collect_garbage",
    "collect_if_due",
    "collect_now",
]

# A collection renews its lock before each batch; one silent this long is presumed dead.
LOCK_TIMEOUT_S: Final = 60.0
# Objects judged per Redis round trip.
_BATCH: Final = 500


@dataclass(frozen=True)
class Collection:
    """What one collection found and did."""

    objects: int  # committed objects seen
    deleted: int
    deleted_bytes: int
    kept_in_use: int  # referenced, or a reference dropped within the grace period
    kept_recent: int  # written within the grace period
    temp_files_removed: int  # left by writers that died
    complete: bool  # False: stopped early (the process stops, or the lock was lost)


def _in_use(client: redis.Redis, sha256s: Sequence[str], cutoff: float) -> list[bool]:
    """For each object: referenced now, or a reference dropped at or after ``cutoff``."""
    pipe = client.pipeline(transaction=False)
    for sha256 in sha256s:
        pipe.exists(keys.sha_refs(sha256))
        pipe.zscore(keys.STORE_RELEASED, sha256)
    replies = pipe.execute()
    return [
        bool(refs) or (released is not None and float(released) >= cutoff)
        for refs, released in zip(replies[::2], replies[1::2], strict=True)
    ]


def collect_garbage(
    client: redis.Redis,
    store: Store,
    grace_s: float,
    now: float | None = None,
    keep_going: Callable[[], bool] = lambda: True,
) -> Collection:
    """One collection by the rules of NOTE [ Store garbage collection ]; ``keep_going`` is
    asked before each batch of objects. The caller makes sure no other collection runs (see
    :func:`collect_now`)."""
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    cutoff = (time.time() if now is None else now) - grace_s

    def one_in_use(sha256: str) -> bool:
        return _in_use(client, [sha256], cutoff)[0]

    deleted = store.settle_trash(cutoff, one_in_use)
    seen = recent = kept = freed = 0
    old = []
    for obj in store.objects():
        seen += 1
        if obj.mtime >= cutoff:
            recent += 1
        else:
            old.append(obj)
    complete = True
    for start in range(0, len(old), _BATCH):
        if not keep_going():
            complete = False
            break
        batch = old[start : start + _BATCH]
        used = _in_use(client, [obj.sha256 for obj in batch], cutoff)
        for obj, obj_used in zip(batch, used, strict=True):
            if obj_used:
                kept += 1
            elif store.remove_unused(obj.sha256, cutoff, one_in_use):
                deleted += 1
                freed += obj.size
    # Drops older than the cutoff no longer protect anything.
    client.zremrangebyscore(keys.STORE_RELEASED, "-inf", f"({cutoff}")
    return Collection(
        objects=seen,
        deleted=deleted,
        deleted_bytes=freed,
        kept_in_use=kept,
        kept_recent=recent,
        temp_files_removed=store.cleanup_tmp(),
        complete=complete,
    )


def collect_now(
    client: redis.Redis, store: Store, grace_s: float, stop: threading.Event | None = None
) -> Collection | None:
    """Runs a collection unless another one holds the lock (then None). It renews the lock
    as it goes and stops early once ``stop`` is set or the lock was lost; a process that dies
    mid-way leaves the lock for at most ``LOCK_TIMEOUT_S``."""
    lock = client.lock(keys.STORE_GC_LOCK, timeout=LOCK_TIMEOUT_S, blocking=False)
    if not lock.acquire():
        return None

    def keep_going() -> bool:
        if stop is not None and stop.is_set():
            return False
        try:
            lock.reacquire()  # another LOCK_TIMEOUT_S from now
        except redis.exceptions.LockError:
            return False  # it expired: another collection may have begun
        return True

    try:
        return collect_garbage(client, store, grace_s, keep_going=keep_going)
    finally:
        with contextlib.suppress(redis.exceptions.LockError):
            lock.release()


def collect_if_due(
    client: redis.Redis,
    store: Store,
    grace_s: float,
    interval_s: float,
    stop: threading.Event | None = None,
) -> Collection | None:
    """Runs a collection if none started in the whole deployment within ``interval_s``."""
    if not client.set(keys.STORE_GC_STARTED, "1", nx=True, px=max(1, int(interval_s * 1000))):
        return None
    return collect_now(client, store, grace_s, stop)
