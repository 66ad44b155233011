"""A train job's latest training checkpoint and the step each of its attempts resumed from,
kept in the job's record hash.

NOTE [ Train checkpoint records ]
The checkpoint itself is a store object (NOTE [ Training checkpoints ] in
workers/training/train_state.py); the job's hash names the latest in ``train_checkpoint``, and
the job holds a use of it in ``keys.sha_refs`` like of its inputs and report. Replacing it is
one script (``_REPLACE_CHECKPOINT_LUA`` in service/records/tenancy/quotas.py): the new object's use
is added and the field set before the old one's use is released, so the collector never
deletes the checkpoint a retried attempt is about to read (an object just written and not
yet referenced is younger than the collector's grace period, NOTE [ Store garbage
collection ] in service/store/gc.py). The same script makes the job hold the new object in
place of the old one in the tenant's stored bytes, within its quota (NOTE [ Tenant quotas ]
in service/records/tenancy/quotas.py). Deleting the job releases it, and its bytes, with the job's
other objects (``JobRecords.delete_finished_job``). ``train_resumes`` is a JSON list, one
entry an attempt: ``{"attempt": n, "resumed_from_step": s}``; only the job's running attempt
writes it.
"""

from __future__ import annotations

import json
from typing import Any, cast

from service.records import keys
from service.records.base import RedisRecords
from service.records.format import text
from service.records.tenancy.quotas import (
    CHECKPOINT_BYTES_FIELD,
    CHECKPOINT_SHA_FIELD,
    replace_checkpoint,
)

__all__ = ["TrainCheckpoints"]

CHECKPOINT_FIELD = CHECKPOINT_SHA_FIELD
RESUMES_FIELD = "train_resumes"


class TrainCheckpoints(RedisRecords):
    """A train job's latest training checkpoint and its attempts' resumptions."""

    def train_checkpoint(self, job_id: str) -> str | None:
        """The sha256 of the job's latest training checkpoint, or None."""
        value = self.client.hget(keys.record("job", job_id), CHECKPOINT_FIELD)
        return None if value is None else text(value)

    def replace_train_checkpoint(
        self,
        job_id: str,
        sha256: str,
        size_bytes: int,
        tenant_id: str,
        max_stored_bytes: float | None = None,
    ) -> None:
        """Makes the stored object ``sha256`` of ``size_bytes`` the job's latest checkpoint,
        held by the job in tenant ``tenant_id``'s stored bytes in place of the one before
        (NOTE [ Train checkpoint records ]); with ``max_stored_bytes`` (the setting; the
        tenant's own value wins) only if it fits, else
        :class:`~service.errors.QuotaExceededError`."""
        # Only the job's running attempt writes these fields: read once, before the script.
        old = self.client.hget(keys.record("job", job_id), CHECKPOINT_FIELD)
        replace_checkpoint(
            self.client,
            tenant_id,
            job_id,
            sha256,
            size_bytes,
            None if old is None else text(old),
            (CHECKPOINT_FIELD, CHECKPOINT_BYTES_FIELD),
            max_stored_bytes,
        )

    def note_resume(self, job_id: str, resumed_from_step: int) -> list[dict[str, Any]]:
        """Records that the job's current attempt started at optimizer step
        ``resumed_from_step`` (0: from the start); returns every attempt's entry so far."""
        job_key = keys.record("job", job_id)
        attempt_raw, resumes_raw = cast(
            "list[bytes | None]", self.client.hmget(job_key, ["attempt", RESUMES_FIELD])
        )
        attempt = int(text(attempt_raw)) if attempt_raw else 1
        resumes: list[dict[str, Any]] = json.loads(text(resumes_raw)) if resumes_raw else []
        resumes = [r for r in resumes if r["attempt"] != attempt]
        resumes.append({"attempt": attempt, "resumed_from_step": resumed_from_step})
        self.client.hset(job_key, RESUMES_FIELD, json.dumps(resumes))
        return resumes
