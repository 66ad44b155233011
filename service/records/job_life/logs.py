"""Job logs: what a job's processes logged (NOTE [ Job logs ] in workers/running/logs.py), a
list ``keys.job_logs`` of JSON entries of which the latest :data:`JOB_LOG_MAX_ENTRIES` are
kept, numbered by the counter ``keys.job_log_seq`` so that a follower's position survives the
trim."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Final

from api_schemas.jobs.public import JobLogEntry
from service.records import keys
from service.records.base import RedisRecords

__all__ = ["JOB_LOG_MAX_ENTRIES", "JobLogs"]

# A job keeps its latest this many log entries (NOTE [ Job logs ] in workers/running/logs.py).
JOB_LOG_MAX_ENTRIES: Final = 500


class JobLogs(RedisRecords):
    """Appends to and reads of jobs' logs."""

    def append_job_logs(
        self,
        job_id: str,
        entries: Iterable[tuple[str, str, str, str]],
        part: str | None = None,
    ) -> None:
        """Appends (at, level, logger, message) entries, keeping the latest
        :data:`JOB_LOG_MAX_ENTRIES`; ``part`` labels them with the part of a sharded job that
        logged them."""
        entries = list(entries)
        if not entries:
            return
        last = int(self.client.incrby(keys.job_log_seq(job_id), len(entries)))
        first = last - len(entries) + 1
        labelled = {} if part is None else {"part": part}
        lines = [
            json.dumps(
                {"seq": first + i, "at": at, "level": level, "logger": name, "message": msg}
                | labelled
            )
            for i, (at, level, name, msg) in enumerate(entries)
        ]
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(keys.job_logs(job_id), *lines)
        pipe.ltrim(keys.job_logs(job_id), -JOB_LOG_MAX_ENTRIES, -1)
        pipe.execute()

    def job_logs(self, job_id: str, after: int = 0) -> list[JobLogEntry]:
        """The kept entries with ``seq`` > ``after``, oldest first."""
        raw = self.client.lrange(keys.job_logs(job_id), 0, -1)
        entries = [JobLogEntry.model_validate_json(line) for line in raw]
        return [entry for entry in entries if entry.seq > after]
