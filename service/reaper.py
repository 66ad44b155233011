"""Fails running jobs whose process is gone, so no job stays `running` forever.

A running job refreshes its heartbeat key (TTL ``heartbeat_timeout_s``) about twice a second
from a thread of the job's own process. If the worker or the job's process is killed (SIGKILL,
out of memory, a machine lost), the key expires and the next sweep marks the job failed. The
sweep is a compare-and-set, so the API and every worker supervisor may run it at once.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from api_schemas import JobStatus, utc_now
from service.records import Records

__all__ = ["Reaper", "reap_stale_jobs"]

log = logging.getLogger(__name__)


def reap_stale_jobs(records: Records, heartbeat_timeout_s: float) -> list[str]:
    """Marks failed every running job without a heartbeat; returns their ids."""
    reaped = []
    grace = timedelta(seconds=heartbeat_timeout_s)
    for job_id in records.running_jobs():
        if records.heartbeat_alive(job_id):
            continue
        started = records.started_at(job_id)
        if started is not None and utc_now() - started < grace:
            continue  # just started: its first heartbeat may not be written yet
        error = (
            f"the process running this job stopped sending heartbeats for "
            f"{heartbeat_timeout_s:g} s (killed, out of memory, or its machine was lost); "
            "nothing it was writing was kept: submit the job again"
        )
        if records.mark_finished(job_id, JobStatus.FAILED, error=error):
            log.warning("job %s failed: no heartbeat", job_id)
            reaped.append(job_id)
    return reaped


class Reaper:
    """Runs :func:`reap_stale_jobs` every ``interval_s`` in a daemon thread."""

    def __init__(self, records: Records, heartbeat_timeout_s: float, interval_s: float) -> None:
        self._records = records
        self._timeout_s = heartbeat_timeout_s
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bnadapt-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                reap_stale_jobs(self._records, self._timeout_s)
            except Exception:  # Redis down, say: try again next round, never die.
                log.exception("reaper sweep failed")
