"""What a running job shares with the outside: heartbeat, progress, and cancel requests.

A daemon thread of the job's process writes, about twice a second, the heartbeat (so the reaper
knows the process lives: see service/upkeep/reaper.py) and the latest progress, and reads the cancel
flag. The compute loop only touches memory: ``report(done)`` and ``should_stop()`` cost no
Redis round trip. Redis writes are best effort: a short outage delays progress, never kills
the job (its client retries through an outage of ``BNADAPT_REDIS_OUTAGE_S``). A job nobody
waits for any more stops itself at its next batch, as if canceled: when its record is no
longer ``running`` (the reaper ended the attempt after a lost heartbeat) or when Redis stayed
unreachable for longer than the outage it rides out (the attempt is then retried).
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType
from typing import Final, Literal

from api_schemas import JobStatus, Progress, utc_now
from service.records.sync import Records
from service.upkeep.reaper import heartbeat_key_ttl_s

__all__ = ["JobRuntime"]

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S: Final = 0.5


class JobRuntime:
    """Use as a context manager around the job's work."""

    def __init__(
        self,
        records: Records,
        job_id: str,
        heartbeat_timeout_s: float,
        redis_outage_s: float | None = None,
    ) -> None:
        self._records = records
        self._job_id = job_id
        self._ttl_s = heartbeat_key_ttl_s(heartbeat_timeout_s)  # NOTE [ Heartbeat bound ]
        # How long Redis may stay away before the job stops (its attempt is then retried).
        self._outage_s = redis_outage_s if redis_outage_s is not None else self._ttl_s
        self._lock = threading.Lock()
        self._progress: Progress | None = None
        self._phase_start = time.monotonic()
        self._samples_per_unit = 0.0
        self._canceled = threading.Event()
        self._last_published = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"job-{job_id}", daemon=True)

    def __enter__(self) -> JobRuntime:
        self._publish()  # the first heartbeat before any work
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def start_phase(
        self, phase: str, total: int, unit: Literal["batches", "steps"], samples_per_unit: float
    ) -> None:
        """A new stretch of work (say "adapt", "evaluate after"); resets rate and ETA."""
        with self._lock:
            self._phase_start = time.monotonic()
            self._samples_per_unit = samples_per_unit
            self._progress = Progress(
                done=0,
                total=total,
                unit=unit,
                samples_per_second=0.0,
                eta_seconds=None,
                phase=phase,
                updated_at=utc_now(),
            )

    def enter_saving(self) -> None:
        """The saving phase: the figures of the last work phase stay (done of total, its
        rate), only the phase's name changes and the ETA goes; saving is no batch, and a
        "saving 1/1 batches at 0 samples/s" was what a finished job used to show."""
        with self._lock:
            if self._progress is not None:
                self._progress = self._progress.model_copy(
                    update={"phase": "saving", "eta_seconds": None, "updated_at": utc_now()}
                )

    def report(self, done: int) -> None:
        with self._lock:
            if self._progress is None:
                return
            elapsed = time.monotonic() - self._phase_start
            rate = done / elapsed if elapsed > 0 else 0.0  # units per second
            left = max(self._progress.total - done, 0)
            self._progress = self._progress.model_copy(
                update={
                    "done": min(done, self._progress.total),
                    "samples_per_second": rate * self._samples_per_unit,
                    "eta_seconds": left / rate if rate > 0 else None,
                    "updated_at": utc_now(),
                }
            )

    def should_stop(self) -> bool:
        return self._canceled.is_set()

    def check_cancel_now(self) -> bool:
        """Asks Redis directly (before committing results, say)."""
        try:
            if self._records.cancel_requested(self._job_id):
                self._canceled.set()
        except Exception:
            log.warning("could not read the cancel flag of job %s", self._job_id, exc_info=True)
        return self._canceled.is_set()

    def _beat(self) -> None:
        """Refreshes the heartbeat the reaper watches (a shard of a sharded job has its own)."""
        self._records.beat(self._job_id, self._ttl_s)

    def _write_progress(self, progress: Progress) -> None:
        """Publishes the progress (a shard of a sharded job adds it to its parent's)."""
        self._records.write_progress(self._job_id, progress)

    def _publish(self) -> None:
        try:
            self._beat()
            with self._lock:
                progress = self._progress
            if progress is not None:
                self._write_progress(progress)
            if self._records.cancel_requested(self._job_id):
                self._canceled.set()
            status = self._records.job_status(self._job_id)
            if status is not JobStatus.RUNNING:
                log.warning("job %s is %s elsewhere; stopping it", self._job_id, status)
                self._canceled.set()
            self._last_published = time.monotonic()
        except Exception:  # Redis unreachable: keep computing, try again next tick
            log.warning("could not publish job %s state", self._job_id, exc_info=True)
            if time.monotonic() - self._last_published > self._outage_s:
                log.warning(
                    "job %s lost Redis for %.0f s; stopping it", self._job_id, self._outage_s
                )
                self._canceled.set()

    def _run(self) -> None:
        while not self._stopped.wait(PUBLISH_INTERVAL_S):
            self._publish()
        self._publish()  # the final progress
