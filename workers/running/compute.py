"""One job's computation, from payload to new weights and report; no Redis here.

:func:`compute` is what a worker runs for a job, and what a test runs in-process to check the
worker's output bitwise (:func:`compute_evaluation` for ``evaluate`` jobs). The model always
runs through workers/checkpoint.py with the job's checkpoint policy, so its statistics are
right whatever the policy.

What the computation reports to and asks the outside: workers/running/hooks.py. An adapt job's
estimation step (which estimator runs, or the merge of a sharded job):
workers/estimators/dispatch.py.

One job's computation read top to bottom, from payload to report.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np
import safetensors.torch
import torch
from torch import nn

from api_schemas import AdaptParams, EvaluateParams, JobPayload, Preprocessing, TrainParams
from api_schemas.reports import (
    BatchNormChange,
    EpochLog,
    Metrics,
    PredictionDiagnostics,
    Report,
    TensorChange,
    Timings,
)
from service.formats.arrays import open_arrays
from service.settings import get_settings
from service.store.base import Store
from workers.errors import AdaptError, ArchitectureError, DataError, WorkerError
from workers.estimators.auto import AutoStats
from workers.estimators.dispatch import Estimate, EstimatorTask, run_task
from workers.estimators.running import select_batchnorm
from workers.models.architectures import (
    Architecture,
    batchnorm_layers,
    build_model,
    parameter_count,
    registry,
    resolve_kwargs,
)
from workers.models.modules import named_modules
from workers.models.policy import apply_checkpoint_policy
from workers.running.data import Data, Samples, labels_tensor, num_batches
from workers.running.evaluation import Metrics as EvalMetrics
from workers.running.evaluation import evaluate_sums, loss_for
from workers.running.hooks import JobHooks, NoHooks
from workers.running.images import ImageSamples, array_transform
from workers.running.reporting import (
    MAX_DIAGNOSTIC_SAMPLES,
    PredictionSums,
    TargetSplit,
    batchnorm_changes,
    diagnostics,
    predict,
    split_target,
    state_snapshot,
    tensor_changes,
)
from workers.running.steps import StepClock, step_forward
from workers.running.training import train_model

__all__ = [
    "WORKER_DEVICE_ENV",
    "JobOutcome",
    "LoadedJob",
    "compute",
    "compute_evaluation",
    "contract_metrics",
    "load_job",
    "load_model",
    "one_sample_batch_explained",
    "resolve_device",
    "weights_bytes",
]

# Set by `bnadapt worker --device`; a job's `device: auto` means this worker's device.
WORKER_DEVICE_ENV: Final = "BNADAPT_WORKER_DEVICE"


@dataclass(frozen=True)
class JobOutcome:
    state_dict: dict[str, torch.Tensor]  # on the CPU, keys of the unwrapped model
    report: Report  # output_model_id is filled in by the caller
    parameter_count: int
    batchnorm_layers: list[dict[str, Any]]
    input_shape: list[int | None]


def resolve_device(requested: str) -> torch.device:
    """``auto`` is the worker's device (``BNADAPT_WORKER_DEVICE``), and ``auto`` there is CUDA
    when present. Only called inside a job's process: the worker's parent never touches CUDA."""
    device = os.environ.get(WORKER_DEVICE_ENV, "auto") if requested == "auto" else requested
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise WorkerError(
            f"the job asks for device {requested!r} but this worker has no CUDA device; submit "
            "with device 'auto' or 'cpu', or run a worker on a GPU machine"
        )
    return torch.device(device)


def load_model(payload: JobPayload, store: Store) -> nn.Module:
    """The input model, built and loaded with strict=True."""
    model = build_model(payload.model.architecture, payload.model.kwargs)
    state = safetensors.torch.load_file(str(store.local_path(payload.model.weights_sha256)))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ArchitectureError(
            f"the weights of model {payload.model.id} no longer load into "
            f"{payload.model.architecture}: {exc}"
        ) from exc
    return model


@dataclass(frozen=True)
class LoadedJob:
    """An adapt or train job's inputs, ready to run."""

    model: nn.Module  # on `device`, run through the job's checkpoint policy
    x: Data  # (N, ...) read a batch at a time on the CPU; batches move to `device`
    y: torch.Tensor | None  # (N,) labels or (N, ...) targets, on the CPU
    device: torch.device
    arch: Architecture


def open_dataset(payload: JobPayload, store: Store) -> tuple[Data, torch.Tensor | None]:
    """The job's dataset: ``x`` as :class:`Samples` (memory-mapped where the file allows, read
    and converted a batch at a time) or, for a tar of images, :class:`ImageSamples` (decoded a
    batch at a time by loader processes), both preprocessed by the dataset's spec; ``y`` in
    memory. Opening reads only headers and labels, so the first batch comes as soon for any
    size of dataset."""
    dataset = payload.dataset
    path = store.local_path(dataset.sha256)
    spec = dataset.preprocessing
    if dataset.format == "tar":
        settings = get_settings()
        shape = None if dataset.sample_shape is None else tuple(dataset.sample_shape)
        images, labels = ImageSamples.open(
            path,
            spec or Preprocessing(),
            shape,
            settings.loader_processes,
            settings.max_image_pixels,
        )
        return images, None if labels is None else labels_tensor(labels, len(images))
    arrays = open_arrays(path, dataset.format)
    y = None if arrays.y is None else labels_tensor(arrays.y, len(arrays.x))
    if spec is None:
        return Samples(arrays.x), y
    if arrays.x.dtype != np.uint8 or arrays.x.ndim != 4:
        raise DataError(
            f"a preprocessing spec applies to uint8 images (N, C, H, W), but x is "
            f"{arrays.x.dtype} of shape {list(arrays.x.shape)}; register it without one"
        )
    transform = array_transform(spec, int(arrays.x.shape[1]))
    return Samples(arrays.x, transform=transform, scale=spec.scale), y


def load_job(payload: JobPayload, store: Store) -> LoadedJob:
    """Seeds torch, builds the input model on the job's device with its checkpoint policy and
    reads the dataset: where :func:`compute` and each shard of a sharded job start."""
    params = payload.params
    assert not isinstance(params, EvaluateParams), "evaluate jobs run compute_evaluation"
    torch.manual_seed(params.seed)
    device = resolve_device(params.device)
    model = load_model(payload, store).to(device)
    x, y = open_dataset(payload, store)
    arch = registry()[payload.model.architecture]
    policy = params.checkpoint
    apply_checkpoint_policy(
        model, arch, policy.preset, policy.modules, policy.types, policy.offload_to_cpu
    )
    return LoadedJob(model, x, y, device, arch)


def weights_bytes(state_dict: dict[str, torch.Tensor]) -> bytes:
    return safetensors.torch.save({k: v.contiguous() for k, v in state_dict.items()})


def contract_metrics(found: EvalMetrics | None) -> Metrics | None:
    """The contract's form of evaluation metrics."""
    return None if found is None else Metrics(**asdict(found))


def compute(
    payload: JobPayload,
    store: Store,
    hooks: JobHooks | None = None,
    estimate: Estimate | None = None,
    measure: bool = True,
) -> JobOutcome:
    """Runs the adapt or train job the payload describes and returns the new weights and the
    report; ``estimate`` replaces an adapt job's estimator (see :data:`Estimate`). Without
    ``measure`` the model is not evaluated on the labels before and after (a sharded job's
    evaluation children do it); an adapt job's prediction diagnostics are measured either way
    (they look at a bounded number of held-out samples, the same as one worker's)."""
    hooks = hooks or NoHooks()
    started = time.perf_counter()
    params = payload.params
    job = load_job(payload, store)
    model, x, y, device, arch = job.model, job.x, job.y, job.device, job.arch
    loss = None if y is None else (getattr(params, "loss", None) or loss_for(y))

    # The first samples, bounded by an adapt job's measure_batches (a short adaptation of a
    # large dataset is not dominated by measuring it); a train job measures all.
    measured = params.measured_samples(len(x)) if isinstance(params, AdaptParams) else len(x)

    def measure_on_all(phase: str) -> EvalMetrics | None:
        if y is None or loss is None or not measure:
            return None
        # In the job's own batches: the size the user chose to fit the device's memory. Counted
        # batch by batch, and stopped at the next batch by a cancel, like every other phase.
        batch_size = params.batch_size
        hooks.start_phase(phase, num_batches(measured, batch_size), "batches", float(batch_size))
        return evaluate_sums(
            model,
            x[:measured],
            y[:measured],
            batch_size=batch_size,
            loss=loss,
            device=device,
            progress=hooks.report,
            should_stop=hooks.should_stop,
        ).metrics()

    loaded = time.perf_counter()
    before = state_snapshot(model)
    metrics_before = measure_on_all("evaluate before")
    # The input model's predictions for the report's diagnostics: a measurement like the one
    # above, so outside compute_s (which times the adaptation or training alone).
    target = None
    if isinstance(params, AdaptParams):
        target = _target_before(model, x, params, device)
    computing = time.perf_counter()
    all_bn = [name for name, _ in _batchnorm_names(model)]
    epochs: list[EpochLog] = []
    adapted: list[str] = []
    reset = False
    auto = None
    # NOTE [ Compiled jobs ] (api_schemas/jobs/params.py): train jobs and backward-pass
    # estimators time their steps, and with `compile` run them through torch.compile.
    assert not isinstance(params, EvaluateParams), "evaluate jobs run compute_evaluation"
    backend = params.compile_backend if params.compile else None
    clock = None
    if isinstance(params, TrainParams) or params.spec.backward:
        clock = StepClock(device, backend)
    forward = step_forward(model, backend)
    if isinstance(params, AdaptParams):
        assert target is not None
        adapted = select_batchnorm(model, params.include, params.exclude)
        reset = params.effective_reset()
        given = x if params.spec.holds_out else target.split.estimation
        task = EstimatorTask(model, params, adapted, hooks, given, reset, device, forward, clock)
        with one_sample_batch_explained(len(given), params.batch_size, params.max_batches):
            stats = (estimate or run_task)(task)
        _check_statistics_finite(model, adapted)
        if isinstance(stats, AutoStats):  # whether statistics started anew depends on its choice
            reset, auto = stats.reset, stats.choice
        # `batches` is what each adapted layer ran in train mode (entropy: one per step), so
        # num_batches_tracked_after == (0 if reset else before) + batches in the report.
        batches, samples, estimator = stats.batches, stats.samples, params.estimator
    else:
        assert isinstance(params, TrainParams)
        assert y is not None, "the API only accepts train jobs on labelled datasets"
        assert loss is not None  # set whenever there are labels
        hooks.start_phase("train", 0, "steps", float(params.batch_size))

        def progress(done: int, total: int) -> None:
            if done <= 1:
                hooks.start_phase("train", total, "steps", float(params.batch_size))
            hooks.report(done)

        with one_sample_batch_explained(None, params.batch_size, None):
            trained = train_model(
                model,
                x,
                y,
                epochs=params.epochs,
                batch_size=params.batch_size,
                optimizer=params.optimizer,
                lr=params.lr,
                momentum=params.momentum,
                weight_decay=params.weight_decay,
                loss=loss,
                validation_fraction=params.validation_fraction,
                seed=params.seed,
                device=device,
                progress=progress,
                should_stop=hooks.should_stop,
                forward=forward,
                clock=clock,
            )
        epochs = [EpochLog(**asdict(e)) for e in trained.epochs]
        batches, samples, estimator = trained.steps, trained.samples, None
        adapted = all_bn
        _check_statistics_finite(model, adapted, adapting=False)
    computed = time.perf_counter()
    metrics_after = measure_on_all("evaluate after")
    found_diagnostics = None if target is None else _target_after(model, target, device)
    measured_at = time.perf_counter()
    after = state_snapshot(model)
    report = Report(
        job_id=payload.job_id,
        kind=payload.kind,
        input_model_id=payload.model.id,
        output_model_id=payload.model.id,  # replaced by the caller once registered
        device=str(device),
        torch_version=torch.__version__,
        torch_threads=torch.get_num_threads(),
        estimator=estimator,
        batches=batches,
        samples=samples,
        timings=Timings(
            load_s=loaded - started,
            compute_s=computed - computing,
            measure_s=(computing - loaded) + (measured_at - computed),
            total_s=time.perf_counter() - started,
        ),
        batchnorm=[
            BatchNormChange(**asdict(c))
            for c in batchnorm_changes(before, after, all_bn, set(adapted), batches, reset)
        ],
        tensors=[TensorChange(**asdict(c)) for c in tensor_changes(before, after)],
        metrics_before=contract_metrics(metrics_before),
        metrics_after=contract_metrics(metrics_after),
        epochs=epochs,
        preprocessing=payload.dataset.preprocessing,
        diagnostics=found_diagnostics,
        auto=auto,
        steps=None if clock is None or clock.steps == 0 else clock.timings(),
    )
    kwargs = resolve_kwargs(payload.model.architecture, payload.model.kwargs)
    return JobOutcome(
        state_dict=after,
        report=report,
        parameter_count=parameter_count(model),
        batchnorm_layers=batchnorm_layers(model),
        input_shape=list(arch.input_shape(kwargs)),
    )


@dataclass(frozen=True)
class _Target:
    """An adapt job's samples split by its holdout, and the input model's predictions on the
    diagnostics' samples."""

    split: TargetSplit
    batch_size: int
    samples: int  # how many of the held-out samples the diagnostics cover
    before: PredictionSums | None  # None: the model's output is not class logits


def _target_before(model: nn.Module, x: Data, params: AdaptParams, device: torch.device) -> _Target:
    """NOTE [ Held-out target samples ] (workers/running/reporting.py): the split, and the
    predictions before estimation."""
    split = split_target(
        x, params.batch_size, params.max_batches, params.effective_holdout(), params.seed
    )
    # Bounded like the labelled measurement (measure_batches) and by MAX_DIAGNOSTIC_SAMPLES.
    samples = min(len(split.held_out), MAX_DIAGNOSTIC_SAMPLES)
    if params.measure_batches is not None:
        samples = min(samples, params.measure_batches * params.batch_size)
    before = predict(model, split.held_out[:samples], batch_size=params.batch_size, device=device)
    return _Target(split, params.batch_size, samples, before)


def _target_after(
    model: nn.Module, target: _Target, device: torch.device
) -> PredictionDiagnostics | None:
    """The report's diagnostics: the output model's predictions on the same samples."""
    sample = target.split.held_out[: target.samples]
    after = predict(model, sample, batch_size=target.batch_size, device=device)
    return diagnostics(target.before, after, target.split.is_held_out)


def compute_evaluation(payload: JobPayload, store: Store, hooks: JobHooks | None = None) -> Report:
    """Runs an ``evaluate`` job: the input model's metrics on the labelled dataset, as the
    report's ``metrics_before``; the model is not changed and nothing is registered."""
    hooks = hooks or NoHooks()
    started = time.perf_counter()
    params = payload.params
    assert isinstance(params, EvaluateParams), f"{payload.kind} jobs run compute"
    device = resolve_device(params.device)
    model = load_model(payload, store).to(device)
    x, y = open_dataset(payload, store)  # (N, ...) on the CPU; batches move to `device`
    if y is None:
        raise DataError(
            f"dataset {payload.dataset.id} has no labels (y) to evaluate the model against; "
            "upload it with y"
        )
    loaded = time.perf_counter()
    batches = num_batches(len(x), params.batch_size)
    hooks.start_phase("evaluate", batches, "batches", float(params.batch_size))
    found = evaluate_sums(
        model,
        x,
        y,
        batch_size=params.batch_size,
        loss=params.loss or loss_for(y),
        device=device,
        progress=hooks.report,
        should_stop=hooks.should_stop,
    ).metrics()
    computed = time.perf_counter()
    return Report(
        job_id=payload.job_id,
        kind=payload.kind,
        input_model_id=payload.model.id,
        output_model_id=None,
        device=str(device),
        torch_version=torch.__version__,
        torch_threads=torch.get_num_threads(),
        batches=batches,
        samples=len(x),
        timings=Timings(
            load_s=loaded - started, compute_s=computed - loaded, total_s=computed - started
        ),
        batchnorm=[],
        tensors=[],
        metrics_before=contract_metrics(found),
        preprocessing=payload.dataset.preprocessing,
    )


def _batchnorm_names(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
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


def _check_statistics_finite(model: nn.Module, layers: list[str], adapting: bool = True) -> None:
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
                    + (f", or leave the layer out with exclude=[{name!r}]" if adapting else "")
                )
