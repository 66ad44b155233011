"""The background thread of the API and of every worker supervisor: it fails jobs whose process
is gone (service/reaper.py) and, when one is due, runs a store collection (service/store_gc.py).

Both are safe to run from many processes at once: the reaper's verdicts are compare-and-sets,
and one collection at a time runs in the whole deployment.
"""

from __future__ import annotations

import logging
import threading

from service.reaper import reap_stale_jobs
from service.records import Records
from service.settings import Settings
from service.store import Store
from service.store_gc import collect_if_due

__all__ = ["Housekeeping"]

log = logging.getLogger(__name__)


class Housekeeping:
    """Every ``interval_s``: a reaper sweep, then a store collection if one is due."""

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
        self._thread = threading.Thread(target=self._run, name="bnadapt-housekeeping", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        settings = self._settings
        while not self._stop.wait(self._interval_s):
            # Each step on its own: Redis down, say, is logged and tried again next round.
            try:
                reap_stale_jobs(self._records, settings.heartbeat_timeout_s)
            except Exception:
                log.exception("reaper sweep failed")
            try:
                done = collect_if_due(
                    self._records.client,
                    self._store,
                    settings.store_gc_grace_s,
                    settings.store_gc_interval_s,
                )
            except Exception:
                log.exception("store collection failed")
            else:
                if done is not None and done.deleted:
                    log.info(
                        "store collection deleted %d objects (%d bytes)",
                        done.deleted,
                        done.deleted_bytes,
                    )
