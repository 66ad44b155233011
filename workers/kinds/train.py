"""The ``train`` row's runner and its change to the model: every parameter trained on the
labelled dataset with the job's recipe (workers/running/training.py), resuming from the
latest training checkpoint (workers/running/resumption.py); then the new model is saved and
registered."""

from __future__ import annotations

import logging
from dataclasses import asdict

from api_schemas import JobPayload, TrainParams
from api_schemas.reports import EpochLog, TrainAttempt
from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store
from workers.kinds.changing import run_change
from workers.running.compute import (
    ChangeResult,
    ChangeTask,
    ModelChange,
    batchnorm_names,
    one_sample_batch_explained,
)
from workers.running.ranks import train_in_ranks
from workers.running.resumption import StoredCheckpoints
from workers.running.train_state import EpochLog as TrainedEpoch
from workers.running.training import Checkpointing, Recipe, train_model

__all__ = ["Training", "change", "run"]

log = logging.getLogger(__name__)


class Training(ModelChange):
    """The job's epochs of optimizer steps on all parameters, every BatchNorm layer in train
    mode. With ``checkpoints`` (a worker's run) it resumes from the latest training checkpoint
    and writes new ones as the job's params ask; without (in-process runs) it starts afresh
    and writes none."""

    def __init__(
        self,
        params: TrainParams,
        payload: JobPayload,
        checkpoints: StoredCheckpoints | None = None,
    ) -> None:
        self.params = params
        self.payload = payload  # what ranks load the job from (workers/running/ranks.py)
        self.checkpoints = checkpoints

    @property
    def timed(self) -> bool:
        return True

    def run(self, task: ChangeTask) -> ChangeResult:
        params, job, hooks, loss = self.params, task.job, task.hooks, task.loss
        assert job.y is not None, "the API only accepts train jobs on labelled datasets"
        assert loss is not None  # set whenever there are labels
        samples_per_step = float(params.batch_size * params.accumulate_steps)
        hooks.start_phase("train", 0, "steps", samples_per_step)
        if params.processes > 1:
            return self._run_in_ranks(task)
        started: list[bool] = []

        def progress(done: int, total: int) -> None:
            if not started:
                hooks.start_phase("train", total, "steps", samples_per_step)
                started.append(True)
            hooks.report(done)

        def on_epoch(epoch: TrainedEpoch) -> None:
            # The job's log, and so its events stream (NOTE [ Job events ]): one line an epoch.
            log.info(
                "epoch %d of %d: train_loss %.6g, val_loss %s, val_accuracy %s",
                epoch.epoch,
                params.epochs,
                epoch.train_loss,
                "null" if epoch.val_loss is None else f"{epoch.val_loss:.6g}",
                "null" if epoch.val_accuracy is None else f"{epoch.val_accuracy:.6g}",
            )

        checkpointing = None
        attempts: list[TrainAttempt] = []
        if self.checkpoints is not None:
            resume = self.checkpoints.latest()
            attempts = self.checkpoints.note_attempt(0 if resume is None else resume.step)
            save = params.save_every_steps is not None or params.save_every_s is not None
            if save or resume is not None:
                checkpointing = Checkpointing(
                    save=self.checkpoints.save if save else _keep_none,
                    every_steps=params.save_every_steps,
                    every_s=None if params.save_every_s is None else float(params.save_every_s),
                    resume=resume,
                )

        with one_sample_batch_explained(None, params.batch_size, None):
            trained = train_model(
                job.model,
                job.x,
                job.y,
                epochs=params.epochs,
                batch_size=params.batch_size,
                optimizer=params.optimizer,
                lr=params.lr,
                momentum=params.momentum,
                weight_decay=params.weight_decay,
                loss=loss,
                validation_fraction=params.validation_fraction,
                seed=params.seed,
                device=job.device,
                recipe=Recipe.of(params),
                checkpointing=checkpointing,
                progress=progress,
                should_stop=hooks.should_stop,
                on_epoch=on_epoch,
                forward=task.forward,
                clock=task.clock,
            )
        return ChangeResult(
            batches=trained.batches,
            samples=trained.samples,
            changed=batchnorm_names(job.model),
            epochs=[EpochLog(**asdict(e)) for e in trained.epochs],
            attempts=attempts,
            best_epoch=trained.best_epoch,
            resumed_from_job=params.resume_from,
        )

    def _run_in_ranks(self, task: ChangeTask) -> ChangeResult:
        """The same training in ``processes`` ranks under DDP (docs/distributed.md)."""
        ran = train_in_ranks(self.payload, self.params, task.job, task.hooks)
        first = ran[0]  # rank 0: its validation, its statistics in the model
        return ChangeResult(
            batches=first.steps,
            samples=first.samples,
            changed=batchnorm_names(task.job.model),
            epochs=first.epochs,
            world_size=len(ran),
            rank_steps=[r.timings for r in ran if r.timings is not None],
        )


def _keep_none(state: object) -> None:
    """A resumed job that asks for no checkpoints of its own writes none."""


def change(payload: JobPayload) -> Training:
    """The train job's change to its model."""
    params = payload.params
    assert isinstance(params, TrainParams), f"{payload.kind} jobs do not train"
    return Training(params, payload)


def run(job: JobPayload, records: Records, store: Store, settings: Settings) -> dict[str, str]:
    """Trains, saves weights and report, registers the new model and marks the job succeeded;
    returns the RQ job's result."""
    checkpoints = StoredCheckpoints(records, store, job.job_id, job.resume_sha256)
    return run_change(job, records, store, settings, Training(change(job).params, job, checkpoints))
