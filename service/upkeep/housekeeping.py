"""The background threads of the API and of every worker supervisor: one fails jobs whose
process is gone and moves children RQ left ready to the queue (service/upkeep/reaper.py), the other
runs a store collection when one is due (service/store/gc.py). Apart, so that a long
collection never delays the reaper.

Both are safe to run from many processes at once: the reaper's verdicts are compare-and-sets,
and one collection at a time runs in the whole deployment.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store
from service.store.gc import collect_if_due
from service.upkeep.reaper import enqueue_ready_children, reap_stale_jobs

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
        self._threads = [
            threading.Thread(target=self._every, args=(task,), name=name, daemon=True)
            for name, task in (
                ("bnadapt-reaper", self._reap),
                ("bnadapt-store-gc", self._collect),
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

    def _every(self, task: Callable[[], None]) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                task()
            except Exception:  # Redis down, say: logged, and tried again next round.
                log.exception("%s failed", threading.current_thread().name)

    def _reap(self) -> None:
        moved = sum(
            enqueue_ready_children(self._records.client, queue)
            for queue in self._settings.job_queues
        )
        if moved:
            log.info("moved %d jobs RQ left ready to the queue", moved)
        reap_stale_jobs(self._records, self._settings.heartbeat_timeout_s)

    def _collect(self) -> None:
        settings = self._settings
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
