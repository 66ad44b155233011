"""The background threads of the API and of every worker supervisor: one fails jobs whose
process is gone and moves children RQ left ready to the queue (service/upkeep/reaper.py), the other
deletes jobs past their retention (service/upkeep/retention.py) and runs a store collection when
one is due (service/store/gc.py). Apart, so that a long
collection never delays the reaper.

Both are safe to run from many processes at once: the reaper's verdicts are compare-and-sets,
and one collection at a time runs in the whole deployment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from service.records.sync import Records
from service.records.tenancy.turns import Turns
from service.settings import Settings
from service.store.base import Store
from service.store.gc import collect_if_due
from service.upkeep.reaper import (
    enqueue_ready_children,
    heartbeat_key_ttl_s,
    reap_lost_queued_jobs,
    reap_stale_jobs,
    sweep_interval_s,
)
from service.upkeep.retention import delete_expired_jobs

__all__ = ["Housekeeping"]

log = logging.getLogger(__name__)


class Housekeeping:
    """Every ``interval_s``: a reaper sweep; and a store collection if one is due."""

    def __init__(
        self, records: Records, store: Store, settings: Settings, interval_s: float
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._records = records
        self._store = store
        self._settings = settings
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._redis_back_at = float("-inf")  # when a sweep last failed to reach Redis
        # The reaper's pace sets how fast a dead job ends (NOTE [ Heartbeat bound ]).
        reap_every_s = min(interval_s, sweep_interval_s(settings.heartbeat_timeout_s))
        self._threads = [
            threading.Thread(target=self._every, args=(task, every), name=name, daemon=True)
            for name, task, every in (
                ("bnadapt-reaper", self._reap, reap_every_s),
                ("bnadapt-store-gc", self._collect, interval_s),
            )
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stops both; a collection in progress stops before its next batch of objects."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def _every(self, task: Callable[[], None], interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                task()
            except (redis.ConnectionError, redis.TimeoutError):
                log.warning("%s: Redis unreachable", threading.current_thread().name)
                self._redis_back_at = time.monotonic()
            except Exception:  # Redis down, say: logged, and tried again next round.
                log.exception("%s failed", threading.current_thread().name)

    def _reap(self) -> None:
        # Heartbeats written during a Redis outage were lost, not missed: the jobs rode the
        # outage out (service/records/connection.py), so a sweep judges heartbeats only once it has
        # seen Redis for a whole heartbeat TTL again (NOTE [ Heartbeat bound ]).
        if time.monotonic() - self._redis_back_at < heartbeat_key_ttl_s(
            self._settings.heartbeat_timeout_s
        ):
            self._records.client.ping()
            return
        # Children wait in their tenant's queues of the device queues (NOTE [ Fair turns ]).
        turns = Turns(self._records.client)
        moved = sum(
            enqueue_ready_children(self._records.client, queue)
            for base in self._settings.job_queues
            for queue in (base, *turns.queue_names(base))
        )
        if moved:
            log.info("moved %d jobs RQ left ready to the queue", moved)
        reap_stale_jobs(self._records, self._settings.heartbeat_timeout_s)
        reap_lost_queued_jobs(self._records, self._settings)

    def _collect(self) -> None:
        settings = self._settings
        if settings.job_retention_s is not None:
            # First, so that this collection can take what expired jobs leave unused.
            expired = delete_expired_jobs(self._records, settings.job_retention_s)
            if expired:
                log.info(
                    "deleted %d jobs that ended over %g s ago", expired, settings.job_retention_s
                )
        done = collect_if_due(
            self._records.client,
            self._store,
            settings.store_gc_grace_s,
            settings.store_gc_interval_s,
            self._stop,
        )
        if done is not None and done.deleted:
            log.info(
                "store collection deleted %d objects (%d bytes)", done.deleted, done.deleted_bytes
            )
