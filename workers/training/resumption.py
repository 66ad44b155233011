"""A worker's side of a train job's training checkpoints and epochs: the latest checkpoint read
back for a retried attempt (or the one ``resume_from`` named), each new one written to the
store, named in the job's record and counted in its tenant's stored bytes (NOTE [ Train
checkpoint records ] in service/records/stored/train_checkpoints.py), and each validated epoch
published for the job's events stream (NOTE [ Job events ] in service/api/routes/jobs.py).
A job in several processes does all of it from rank 0 (workers/training/ranks.py)."""

from __future__ import annotations

import logging

from api_schemas import EpochEvent, JobPayload
from api_schemas.reports import TrainAttempt
from service.errors import QuotaExceededError
from service.records.sync import Records
from service.store.base import Store
from workers.errors import TrainError
from workers.training.train_state import (
    EpochLog,
    TrainState,
    load_state,
    state_bytes,
    state_position,
)

__all__ = ["StoredCheckpoints"]

log = logging.getLogger(__name__)


class StoredCheckpoints:
    """The training checkpoints and epochs of the train job ``payload``: its own, and, while
    it has none yet, the checkpoint of the job it resumes from (``resume_from``).
    ``max_stored_bytes``: the stored-bytes quota's setting (NOTE [ Tenant quotas ])."""

    def __init__(
        self,
        records: Records,
        store: Store,
        payload: JobPayload,
        max_stored_bytes: float | None = None,
    ) -> None:
        self.records = records
        self.store = store
        self.payload = payload
        self.max_stored_bytes = max_stored_bytes

    @property
    def job_id(self) -> str:
        return self.payload.job_id

    def latest_sha256(self) -> str | None:
        """The job's latest checkpoint; else the one it resumes from; else None."""
        return self.records.train_checkpoint(self.job_id) or self.payload.resume_sha256

    def load(self, sha256: str) -> TrainState:
        state = load_state(self.store.local_path(sha256))
        log.info("training resumes from step %d (epoch %d)", state.step, state.epoch)
        return state

    def step_of(self, sha256: str) -> int:
        """The optimizer step of checkpoint ``sha256``, its tensors left unread (the ranks of
        a job in several processes read them)."""
        step, epoch = state_position(self.store.local_path(sha256))
        log.info("training resumes from step %d (epoch %d)", step, epoch)
        return step

    def latest(self) -> TrainState | None:
        """The checkpoint :meth:`latest_sha256` names, read; None when there is none."""
        sha256 = self.latest_sha256()
        return None if sha256 is None else self.load(sha256)

    def save(self, state: TrainState) -> None:
        # The store commits the object whole or not at all, under its digest; only then does
        # the record name it (NOTE [ Train checkpoint records ]).
        data = state_bytes(state)
        sha256 = self.store.put_bytes(data)
        try:
            self.records.replace_train_checkpoint(
                self.job_id, sha256, len(data), self.payload.tenant_id, self.max_stored_bytes
            )
        except QuotaExceededError as exc:
            # Not retried: the next attempt's checkpoint would not fit either. The object
            # nothing names is the collector's (NOTE [ Store garbage collection ]).
            raise TrainError(
                f"the training checkpoint at step {state.step} ({len(data)} bytes) does not "
                f"fit the tenant's stored bytes: {exc}. Or submit the job without "
                "save_every_steps and save_every_s"
            ) from exc

    def note_attempt(self, resumed_from_step: int) -> list[TrainAttempt]:
        """Records where this attempt started; returns every attempt's start so far."""
        return [
            TrainAttempt.model_validate(entry)
            for entry in self.records.note_resume(self.job_id, resumed_from_step)
        ]

    def publish_epoch(self, epoch: EpochLog, epochs: int) -> None:
        """One validated epoch of ``epochs``, for the job's events stream and its log."""
        log.info(
            "epoch %d of %d: train_loss %.6g, val_loss %s, val_accuracy %s",
            epoch.epoch,
            epochs,
            epoch.train_loss,
            "null" if epoch.val_loss is None else f"{epoch.val_loss:.6g}",
            "null" if epoch.val_accuracy is None else f"{epoch.val_accuracy:.6g}",
        )
        self.records.publish_epoch(
            self.job_id,
            EpochEvent(
                epoch=epoch.epoch,
                epochs=epochs,
                train_loss=epoch.train_loss,
                val_loss=epoch.val_loss,
                val_accuracy=epoch.val_accuracy,
                lr=epoch.lr,
                best=epoch.best,
            ),
        )
