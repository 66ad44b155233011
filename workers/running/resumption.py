"""A worker's side of a train job's training checkpoints: the latest one read back for a
retried attempt (or the one ``resume_from`` named), each new one written to the store and
named in the job's record (NOTE [ Train checkpoint records ] in
service/records/train_checkpoints.py)."""

from __future__ import annotations

import logging

from api_schemas.reports import TrainAttempt
from service.records.sync import Records
from service.store.base import Store
from workers.running.train_state import TrainState, load_state, state_bytes

__all__ = ["StoredCheckpoints"]

log = logging.getLogger(__name__)


class StoredCheckpoints:
    """The training checkpoints of job ``job_id``; ``resume_sha256``: the checkpoint of
    another job to start from when the job has none of its own yet (``resume_from``)."""

    def __init__(
        self, records: Records, store: Store, job_id: str, resume_sha256: str | None = None
    ) -> None:
        self.records = records
        self.store = store
        self.job_id = job_id
        self.resume_sha256 = resume_sha256

    def latest(self) -> TrainState | None:
        """The job's latest checkpoint; else the one it resumes from; else None."""
        sha256 = self.records.train_checkpoint(self.job_id) or self.resume_sha256
        if sha256 is None:
            return None
        state = load_state(self.store.local_path(sha256))
        log.info("training resumes from step %d (epoch %d)", state.step, state.epoch)
        return state

    def save(self, state: TrainState) -> None:
        # The store commits the object whole or not at all, under its digest; only then does
        # the record name it (NOTE [ Train checkpoint records ]).
        sha256 = self.store.put_bytes(state_bytes(state))
        self.records.replace_train_checkpoint(self.job_id, sha256)

    def note_attempt(self, resumed_from_step: int) -> list[TrainAttempt]:
        """Records where this attempt started; returns every attempt's start so far."""
        return [
            TrainAttempt.model_validate(entry)
            for entry in self.records.note_resume(self.job_id, resumed_from_step)
        ]
