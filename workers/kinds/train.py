"""The ``train`` row's runner and its change to the model: every parameter trained on the
labelled dataset (workers/running/training.py); then the new model is saved and registered."""

from __future__ import annotations

from dataclasses import asdict

from api_schemas import JobPayload, TrainParams
from api_schemas.reports import EpochLog
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
from workers.running.training import train_model

__all__ = ["Training", "change", "run"]


class Training(ModelChange):
    """The job's epochs of optimizer steps on all parameters, every BatchNorm layer in train
    mode."""

    def __init__(self, params: TrainParams, payload: JobPayload) -> None:
        self.params = params
        self.payload = payload  # what ranks load the job from (workers/running/ranks.py)

    @property
    def timed(self) -> bool:
        return True

    def run(self, task: ChangeTask) -> ChangeResult:
        params, job, hooks, loss = self.params, task.job, task.hooks, task.loss
        assert job.y is not None, "the API only accepts train jobs on labelled datasets"
        assert loss is not None  # set whenever there are labels
        hooks.start_phase("train", 0, "steps", float(params.batch_size))
        if params.processes > 1:
            return self._run_in_ranks(task)

        def progress(done: int, total: int) -> None:
            if done <= 1:
                hooks.start_phase("train", total, "steps", float(params.batch_size))
            hooks.report(done)

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
                progress=progress,
                should_stop=hooks.should_stop,
                forward=task.forward,
                clock=task.clock,
            )
        return ChangeResult(
            batches=trained.steps,
            samples=trained.samples,
            changed=batchnorm_names(job.model),
            epochs=[EpochLog(**asdict(e)) for e in trained.epochs],
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


def change(payload: JobPayload) -> Training:
    """The train job's change to its model."""
    params = payload.params
    assert isinstance(params, TrainParams), f"{payload.kind} jobs do not train"
    return Training(params, payload)


def run(job: JobPayload, records: Records, store: Store, settings: Settings) -> dict[str, str]:
    """Trains, saves weights and report, registers the new model and marks the job succeeded;
    returns the RQ job's result."""
    return run_change(job, records, store, settings, change(job))
