"""The ``train`` row's runner and its change to the model: every parameter trained on the
labelled dataset with the job's recipe (workers/training/training.py), in one process or in
several (workers/training/ranks.py), resuming from the latest training checkpoint
(workers/training/resumption.py); then the new model is saved and registered."""

from __future__ import annotations

from dataclasses import asdict
from functools import partial

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
from workers.training.ranks import train_in_ranks
from workers.training.resumption import StoredCheckpoints
from workers.training.training import Checkpointing, TrainHooks, train_with_params

__all__ = ["Training", "change", "run"]


class Training(ModelChange):
    """The job's epochs of optimizer steps on all parameters, every BatchNorm layer in train
    mode. With ``checkpoints`` (a worker's run) it resumes from the latest training checkpoint,
    writes new ones as the job's params ask and publishes each epoch; without (in-process runs)
    it starts afresh and writes none. In one process or in ``processes`` ranks alike."""

    def __init__(
        self,
        params: TrainParams,
        payload: JobPayload,
        checkpoints: StoredCheckpoints | None = None,
    ) -> None:
        self.params = params
        self.payload = payload  # what ranks load the job from (workers/training/ranks.py)
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
        resume_sha256 = None if self.checkpoints is None else self.checkpoints.latest_sha256()
        if params.processes > 1:
            return self._run_in_ranks(task, resume_sha256)
        resume = None
        attempts: list[TrainAttempt] = []
        if self.checkpoints is not None:
            resume = None if resume_sha256 is None else self.checkpoints.load(resume_sha256)
            attempts = self.checkpoints.note_attempt(0 if resume is None else resume.step)
        started: list[bool] = []

        def progress(done: int, total: int) -> None:
            if not started:
                hooks.start_phase("train", total, "steps", samples_per_step)
                started.append(True)
            hooks.report(done)

        checkpointing = on_epoch = None
        if self.checkpoints is not None:
            checkpointing = Checkpointing.of(params, self.checkpoints.save, resume)
            on_epoch = partial(self.checkpoints.publish_epoch, epochs=params.epochs)

        with one_sample_batch_explained(None, params.batch_size, None):
            trained = train_with_params(
                params,
                job.model,
                job.x,
                job.y,
                loss=loss,
                device=job.device,
                checkpointing=checkpointing,
                hooks=TrainHooks(
                    progress=progress,
                    should_stop=hooks.should_stop,
                    on_epoch=on_epoch,
                    forward=task.forward,
                    clock=task.clock,
                ),
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

    def _run_in_ranks(self, task: ChangeTask, resume_sha256: str | None) -> ChangeResult:
        """The same training in ``processes`` ranks under DDP (docs/distributed.md), each
        resuming from the checkpoint ``resume_sha256`` itself; rank 0 writes the checkpoints
        and publishes the epochs of a worker's run."""
        attempts: list[TrainAttempt] = []
        if self.checkpoints is not None:
            step = 0 if resume_sha256 is None else self.checkpoints.step_of(resume_sha256)
            attempts = self.checkpoints.note_attempt(step)
        ran = train_in_ranks(
            self.payload,
            self.params,
            task.job,
            task.hooks,
            resume_sha256=resume_sha256,
            keep_checkpoints=self.checkpoints is not None,
        )
        first = ran[0]  # rank 0: its validation, its statistics in the model
        return ChangeResult(
            batches=first.steps,
            samples=first.samples,
            changed=batchnorm_names(task.job.model),
            epochs=first.epochs,
            attempts=attempts,
            best_epoch=first.best_epoch,
            resumed_from_job=self.params.resume_from,
            world_size=len(ran),
            rank_steps=[r.timings for r in ran if r.timings is not None],
        )


def change(payload: JobPayload) -> Training:
    """The train job's change to its model."""
    params = payload.params
    assert isinstance(params, TrainParams), f"{payload.kind} jobs do not train"
    return Training(params, payload)


def run(job: JobPayload, records: Records, store: Store, settings: Settings) -> dict[str, str]:
    """Trains, saves weights and report, registers the new model and marks the job succeeded;
    returns the RQ job's result."""
    checkpoints = StoredCheckpoints(records, store, job, settings.tenant_max_stored_bytes)
    return run_change(job, records, store, settings, Training(change(job).params, job, checkpoints))
