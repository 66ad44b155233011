"""The computation every kind that changes a model shares, from payload to new weights and
report; no Redis here.

:func:`compute` is what a worker runs for an adapt or train job, and what a test runs
in-process to check the worker's output bitwise: it loads the job (workers/running/loading.py),
measures the model, runs the kind's own :class:`ModelChange`, checks what it left, measures
again and draws up the report (NOTE [ A kind's change to the model ]). The model always runs
through bnadapt/checkpoint.py with the job's checkpoint policy, so its statistics are right
whatever the policy.

What the computation reports to and asks the outside: workers/passes/hooks.py.

One job's computation read top to bottom, from payload to report.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import torch
from torch import nn

from api_schemas import JobPayload
from api_schemas.reports import (
    AffineChange,
    AutoChoice,
    BatchNormChange,
    CheckpointSummary,
    EpochLog,
    PredictionDiagnostics,
    Report,
    StepTimings,
    TensorChange,
    Timings,
    TrainAttempt,
)
from service.store.base import Store
from workers.errors import AdaptError, DataError
from workers.models.architectures import batchnorm_layers, parameter_count, resolve_kwargs
from workers.models.modules import named_modules
from workers.models.policy import CheckpointOutcome
from workers.passes.data import num_batches
from workers.passes.hooks import JobHooks, NoHooks
from workers.passes.steps import Forward, StepClock, step_forward
from workers.running.evaluation import Loss, contract_metrics, evaluate_sums, loss_for
from workers.running.evaluation import Metrics as EvalMetrics
from workers.running.loading import LoadedJob, load_job
from workers.running.reporting import (
    affine_changes,
    batchnorm_changes,
    frozen_norm_names,
    state_snapshot,
    tensor_changes,
)

__all__ = [
    "ChangeResult",
    "ChangeTask",
    "JobOutcome",
    "ModelChange",
    "batchnorm_names",
    "compute",
    "one_sample_batch_explained",
]

# NOTE [ A kind's change to the model ]
#
# Every kind that changes a model runs the same skeleton, :func:`compute`: load the job, take a
# snapshot and measure the labelled data before, let the kind change the model, check the
# statistics it left, measure after, report. The kind's own part is a :class:`ModelChange`,
# which its runner passes in (workers/kinds/), so a new such kind adds nothing to this module.
# Its methods run at fixed points of the skeleton, which the report's timings rely on:
# `before` and `diagnostics` are measurements (counted in `measure_s`, with the labelled
# ones), `run` alone is timed as `compute_s`. The statistics check runs inside `compute_s`,
# on the layers the change says it ran in train mode, before anything is measured after.


@dataclass(frozen=True)
class JobOutcome:
    state_dict: dict[str, torch.Tensor]  # on the CPU, keys of the unwrapped model
    report: Report  # output_model_id is filled in by the caller
    parameter_count: int
    batchnorm_layers: list[dict[str, Any]]
    input_shape: list[int | None]


@dataclass(frozen=True)
class ChangeTask:
    """What a kind's change gets: the loaded job, its hooks, its loss (None without labels)
    and what runs and times optimizer steps (``clock`` None unless the change is timed)."""

    job: LoadedJob
    hooks: JobHooks
    loss: Loss | None
    forward: Forward
    clock: StepClock | None


@dataclass(frozen=True)
class ChangeResult:
    """What a kind's change ran and changed, as the report shows it."""

    # Batches each changed layer ran in train mode (entropy and train: one per step), so
    # num_batches_tracked_after == (0 if reset else before) + batches in the report.
    batches: int
    samples: int
    changed: list[str]  # the BatchNorm layers it ran in train mode: the report's `adapted`
    estimator: str | None = None
    reset: bool = False  # the changed layers' statistics started anew
    epochs: list[EpochLog] = field(default_factory=list)
    auto: AutoChoice | None = None
    # Normalization layers whose affine parameters the change trained (entropy), in order.
    affine: list[str] = field(default_factory=list)
    # The job chose the changed layers (`include`, `exclude`): a layer whose statistics come out
    # non-finite may be left out, and the error says so.
    chosen_layers: bool = False
    # A train job: its attempts (run by a worker), the epoch keep_best kept, the job it
    # resumed from.
    attempts: list[TrainAttempt] = field(default_factory=list)
    best_epoch: int | None = None
    resumed_from_job: str | None = None
    # A change run by several ranks (workers/training/ranks.py): their count and each one's
    # step timings, in rank order; the report's `steps` is then rank 0's.
    world_size: int = 1
    rank_steps: list[StepTimings] = field(default_factory=list)


class ModelChange(ABC):
    """A kind's own part of :func:`compute` (NOTE [ A kind's change to the model ]): what
    changes the model, and what the kind measures around it besides the labelled metrics."""

    @property
    def timed(self) -> bool:
        """Whether the change runs optimizer steps: timed one by one (the report's ``steps``)
        and, with the job's ``compile``, through torch.compile (NOTE [ Compiled jobs ])."""
        return False

    def measured_samples(self, num_samples: int) -> int:
        """How many of the dataset's first samples the labelled measurements use."""
        return num_samples

    def before(self, job: LoadedJob) -> None:
        """Measures, before the change, what :meth:`diagnostics` compares after it."""
        return

    @abstractmethod
    def run(self, task: ChangeTask) -> ChangeResult:
        """Changes ``task.job.model`` in place."""

    def diagnostics(self, job: LoadedJob) -> PredictionDiagnostics | None:
        """The report's diagnostics, measured after the change."""
        return None


def compute(
    payload: JobPayload,
    store: Store,
    change: ModelChange,
    hooks: JobHooks | None = None,
    measure: bool = True,
) -> JobOutcome:
    """Runs the job the payload describes with the kind's ``change`` and returns the new
    weights and the report. Without ``measure`` the model is not evaluated on the labels before
    and after (a sharded job's evaluation children do it); the change's own measurements (an
    adapt job's prediction diagnostics) run either way (they look at a bounded number of
    held-out samples, the same as one worker's)."""
    hooks = hooks or NoHooks()
    started = time.perf_counter()
    job = load_job(payload, store)
    loss = None if job.y is None else (getattr(job.params, "loss", None) or loss_for(job.y))
    measured = change.measured_samples(len(job.x))
    labelled = _LabelledMeasurement(job, hooks, loss if measure else None, measured)
    loaded = time.perf_counter()
    before = state_snapshot(job.model)
    metrics_before = labelled.metrics("evaluate before")
    change.before(job)
    computing = time.perf_counter()
    all_bn = batchnorm_names(job.model)
    result, clock = _change_model(job, change, hooks, loss)
    computed = time.perf_counter()
    metrics_after = labelled.metrics("evaluate after")
    diagnostics = change.diagnostics(job)
    measured_at = time.perf_counter()
    after = state_snapshot(job.model)
    timings = Timings(
        load_s=loaded - started,
        compute_s=computed - computing,
        measure_s=(computing - loaded) + (measured_at - computed),
        total_s=time.perf_counter() - started,
    )
    # In _Run's field order, which these names spell.
    run = _Run(
        result, before, after, all_bn, metrics_before, metrics_after, diagnostics, timings, clock
    )
    report = _report(payload, job, run)
    kwargs = resolve_kwargs(payload.model.architecture, payload.model.kwargs)
    return JobOutcome(
        state_dict=after,
        report=report,
        parameter_count=parameter_count(job.model),
        batchnorm_layers=batchnorm_layers(job.model),
        input_shape=list(job.arch.input_shape(kwargs)),
    )


@dataclass(frozen=True)
class _LabelledMeasurement:
    """The model's metrics on the dataset's first ``samples`` labelled samples, before and
    after the change; none without a loss (no labels, or a job that does not measure)."""

    job: LoadedJob
    hooks: JobHooks
    loss: Loss | None
    samples: int

    def metrics(self, phase: str) -> EvalMetrics | None:
        job, hooks, measured = self.job, self.hooks, self.samples
        if job.y is None or self.loss is None:
            return None
        # In the job's own batches: the size the user chose to fit the device's memory. Counted
        # batch by batch, and stopped at the next batch by a cancel, like every other phase.
        batch_size = job.params.batch_size
        hooks.start_phase(phase, num_batches(measured, batch_size), "batches", float(batch_size))
        return evaluate_sums(
            job.model,
            job.x[:measured],
            job.y[:measured],
            batch_size=batch_size,
            loss=self.loss,
            device=job.device,
            progress=hooks.report,
            should_stop=hooks.should_stop,
        ).metrics()


def _change_model(
    job: LoadedJob, change: ModelChange, hooks: JobHooks, loss: Loss | None
) -> tuple[ChangeResult, StepClock | None]:
    """Runs the kind's change (timed and compiled as the change and the job ask) and checks
    the statistics it left; the clock that timed its steps, if it was timed."""
    params = job.params
    # NOTE [ Compiled jobs ] (api_schemas/jobs/params.py): train jobs and backward-pass
    # estimators time their steps, and with `compile` run them through torch.compile.
    backend = params.compile_backend if params.compile else None
    clock = StepClock(job.device, backend) if change.timed else None
    forward = step_forward(job.model, backend)
    result = change.run(ChangeTask(job, hooks, loss, forward, clock))
    _check_statistics_finite(job.model, result.changed, result.chosen_layers)
    return result, clock


@dataclass(frozen=True)
class _Run:
    """What one run of :func:`compute` saw, which its report is drawn from."""

    result: ChangeResult
    before: dict[str, torch.Tensor]  # state snapshots on the CPU
    after: dict[str, torch.Tensor]
    all_bn: list[str]  # the model's BatchNorm layers with running statistics
    metrics_before: EvalMetrics | None
    metrics_after: EvalMetrics | None
    diagnostics: PredictionDiagnostics | None
    timings: Timings
    clock: StepClock | None


def _report(payload: JobPayload, job: LoadedJob, run: _Run) -> Report:
    """The job's report; ``output_model_id`` is the input's until the caller registers one."""
    result, before, after = run.result, run.before, run.after
    return Report(
        job_id=payload.job_id,
        kind=payload.kind,
        input_model_id=payload.model.id,
        output_model_id=payload.model.id,
        device=str(job.device),
        torch_version=torch.__version__,
        torch_threads=torch.get_num_threads(),
        estimator=result.estimator,
        batches=result.batches,
        samples=result.samples,
        timings=run.timings,
        batchnorm=[
            BatchNormChange(**asdict(c))
            for c in batchnorm_changes(
                before, after, run.all_bn, set(result.changed), result.batches, result.reset
            )
        ],
        tensors=[TensorChange(**asdict(c)) for c in tensor_changes(before, after)],
        metrics_before=contract_metrics(run.metrics_before),
        metrics_after=contract_metrics(run.metrics_after),
        epochs=result.epochs,
        preprocessing=payload.dataset.preprocessing,
        diagnostics=run.diagnostics,
        auto=result.auto,
        steps=_steps(run.clock, result),
        world_size=result.world_size,
        rank_steps=result.rank_steps,
        checkpoint=checkpoint_summary(job.checkpointed, job.params.checkpoint.preset),
        frozen_norms=frozen_norm_names(job.model),
        affine=[
            AffineChange(**asdict(c))
            for c in affine_changes(job.model, before, after, result.affine)
        ],
        attempts=result.attempts,
        best_epoch=result.best_epoch,
        resumed_from_job=result.resumed_from_job,
    )


def _steps(clock: StepClock | None, result: ChangeResult) -> StepTimings | None:
    """The report's ``steps``: rank 0's when ranks ran the change, else this process's."""
    if result.rank_steps:
        return result.rank_steps[0]
    return None if clock is None or clock.steps == 0 else clock.timings()


def checkpoint_summary(outcome: CheckpointOutcome | None, preset: str) -> CheckpointSummary | None:
    """The report's ``checkpoint``: what the job's policy wrapped (NOTE [ The blocks rule ])."""
    if outcome is None:
        return None
    return CheckpointSummary(
        preset=preset,
        blocks_rule=outcome.blocks_rule,
        wrapped=len(outcome.wrapped),
        modules=outcome.wrapped,
        note=outcome.note,
    )


def batchnorm_names(model: nn.Module) -> list[str]:
    """The names of the model's BatchNorm layers with running statistics, in module order."""
    return [
        name
        for name, module in named_modules(model)
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats
    ]


# What torch's batch_norm raises in train mode on one value per channel: a (1, C) batch.
_ONE_VALUE_PER_CHANNEL: Final = "Expected more than 1 value per channel when training"


@contextmanager
def one_sample_batch_explained(
    num_samples: int | None, batch_size: int, max_batches: int | None
) -> Iterator[None]:
    """Turns torch's error on a one-sample batch in train mode into one that says what to do.

    A last batch of one sample (``num_samples % batch_size == 1``) cannot give a BatchNorm1d
    layer over (B, C) features a variance. It is refused rather than dropped: dropping it
    would silently leave a sample out and change the batch count the report checks the
    statistics against, so the user chooses instead."""
    try:
        yield
    except ValueError as exc:
        if _ONE_VALUE_PER_CHANNEL not in str(exc):
            raise
        if num_samples is None:
            where = "a batch of the training split holds one sample"
            fix = "choose a batch_size for which the training split does not leave one sample"
        else:
            full = num_samples // batch_size
            where = (
                f"the last batch holds one sample ({num_samples} samples in batches of "
                f"{batch_size})"
            )
            fix = (
                f"use a batch_size that does not leave one sample over (e.g. {batch_size + 1}), "
                f"or max_batches={full} to leave the last sample out"
                if max_batches is None or max_batches > full
                else "use a different batch_size"
            )
        raise DataError(
            f"{where}, and a BatchNorm layer in train mode cannot compute statistics from one "
            f"value per channel; {fix}"
        ) from exc


def _check_statistics_finite(model: nn.Module, layers: list[str], chosen_layers: bool) -> None:
    """Raises :class:`AdaptError` naming the first layer whose running statistics are NaN or
    infinite: such a model would compute NaN for every input, so it is not registered."""
    modules = dict(named_modules(model))
    for name in layers:
        module = modules[name]
        for buffer in ("running_mean", "running_var"):
            value = getattr(module, buffer, None)
            if isinstance(value, torch.Tensor) and not bool(torch.isfinite(value).all()):
                bad = int((~torch.isfinite(value)).sum())
                raise AdaptError(
                    f"the {buffer} of BatchNorm layer {name!r} came out non-finite ({bad} of "
                    f"{value.numel()} channels NaN or Inf): its inputs overflowed or held NaN. "
                    "Check the dataset's scale (x is used as given; uint8 is scaled to [0, 1]) "
                    "and the model's weights"
                    + (f", or leave the layer out with exclude=[{name!r}]" if chosen_layers else "")
                )
