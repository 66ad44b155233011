"""Submitting a job: the checks that the model and dataset fit it, the payload a worker
receives, the Idempotency-Key (service/jobs/idempotency.py) and the one MULTI that writes the
record and the queue entry. ``POST /v1/jobs`` (service/api/routes/jobs.py) parses the body and
calls :func:`submit_job`."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

import redis
from rq import Queue

from api_schemas import (
    ESTIMATORS,
    JOB_KINDS,
    AdaptParams,
    DatasetPublic,
    JobPayload,
    JobPayloadDataset,
    JobPayloadModel,
    JobPublic,
    JobStatus,
    ModelPublic,
    Progress,
    TrainParams,
    new_id,
    utc_now,
)
from api_schemas.jobs.kinds import AnyJobCreate
from api_schemas.jobs.params import num_batches
from service.datasets.preprocessing import model_spec, with_job_spec
from service.errors import InvalidRequestError, QuotaExceededError, ResourceNotFoundError
from service.jobs.idempotency import IDEMPOTENCY_TTL_S, body_sha256, existing_for_key
from service.jobs.queues import job_queue, waiting_progress
from service.records import keys
from service.records.job_life.capacity import WorkerMemory
from service.records.job_life.queue import enqueue_run
from service.records.sync import Records
from service.records.tenancy.quotas import CHECKPOINT_BYTES_FIELD
from service.settings import Settings

__all__ = [
    "MEMORY_HEADROOM",
    "check_fit",
    "check_memory",
    "check_room_for_output",
    "check_running_statistics",
    "job_holds",
    "job_inputs",
    "job_payload",
    "job_timeout",
    "needed_memory",
    "resume_checkpoint",
    "submit_job",
    "worker_memory",
]


def submit_job(
    records: Records,
    settings: Settings,
    default_queue: Queue,
    tenant: str,
    request: AnyJobCreate,
    idempotency_key: str | None,
) -> JobPublic:
    """Checks ``request`` against its model and dataset and queues it; returns the new job, or
    the one an earlier request with the same ``idempotency_key`` made. 404 for a model or
    dataset the tenant does not have, 422 when they do not fit the job, 409 or 422 from the
    key (NOTE [ Idempotency lease ] in service/jobs/idempotency.py)."""
    model, dataset = job_inputs(records, tenant, request)
    check_fit(request, model, dataset)
    timeout_s = job_timeout(request, settings)
    check_memory(request, model, dataset, worker_memory(records, settings, request))
    check_running_statistics(request, model)
    resume_sha256 = resume_checkpoint(records, tenant, request)

    job_id = new_id("job")
    binding = None
    if idempotency_key is not None:
        binding = _KeyBinding(idempotency_key, body_sha256(request))
        existing = existing_for_key(
            records, tenant, binding.key, binding.body_sha256, job_id, settings.idempotency_lease_s
        )
        if existing is not None:
            return existing

    job = JobPublic(
        id=job_id,
        kind=request.kind,
        status=JobStatus.QUEUED,
        model_id=model.id,
        dataset_id=dataset.id,
        params=request.params,
        created_at=utc_now(),
        max_attempts=request.max_attempts,
        tags=request.tags,
        priority=request.priority,
        timeout_s=timeout_s,
    )
    writes = _QueueWrites(
        records=records,
        tenant=tenant,
        job=job,
        payload=job_payload(job_id, tenant, request, model, dataset, timeout_s, resume_sha256),
        queue=job_queue(default_queue, settings, request.params.device),
        timeout_s=timeout_s,
        waiting=waiting_progress(request.params.device),
        binding=binding,
    )
    with _undone_on_failure(records, tenant, job, idempotency_key):
        check_room_for_output(records, settings, tenant, request, model)
        records.create_job(
            tenant,
            job,
            writes.payload,
            uses=job_holds(records, request, model, dataset, resume_sha256),
            enqueue=writes,
            max_active_jobs=settings.tenant_max_active_jobs,
        )
    # The progress lives in its own key (written with the record), not in the record.
    return job if writes.waiting is None else job.model_copy(update={"progress": writes.waiting})


def job_inputs(
    records: Records, tenant: str, request: AnyJobCreate
) -> tuple[ModelPublic, DatasetPublic]:
    """The job's model, and its dataset as the job sees it (after the job's own preprocessing
    spec); 404 for either when the tenant does not have it, 422 for a spec that cannot apply."""
    model, dataset = records.get_model_and_dataset(tenant, request.model_id, request.dataset_id)
    if model is None:
        raise ResourceNotFoundError("model", request.model_id)
    if dataset is None:
        raise ResourceNotFoundError("dataset", request.dataset_id)
    return model, with_job_spec(dataset, model_spec(request.params.preprocessing, model))


@dataclass(frozen=True)
class _KeyBinding:
    """An Idempotency-Key and the digest of the request it is bound to."""

    key: str
    body_sha256: str


@dataclass(frozen=True)
class _QueueWrites:
    """What the MULTI that writes a job's record writes with it: the progress of a job that
    waits for a device class, the queue entry, and the Idempotency-Key's long binding (NOTE
    [ Idempotency lease ] in service/jobs/idempotency.py)."""

    records: Records
    tenant: str
    job: JobPublic
    payload: JobPayload
    queue: Queue
    timeout_s: int
    waiting: Progress | None
    binding: _KeyBinding | None

    def __call__(self, pipe: redis.client.Pipeline) -> None:
        job = self.job
        if self.waiting is not None:
            pipe.set(keys.job_progress(job.id), self.waiting.model_dump_json())
        enqueue_run(
            self.queue,
            self.payload.model_dump(mode="json"),
            job.id,
            self.timeout_s,
            f"{job.kind} {job.model_id} on {job.dataset_id}",
            pipeline=pipe,
        )
        if self.binding is not None:
            self.records.bind_idempotency(
                pipe,
                self.tenant,
                self.binding.key,
                self.binding.body_sha256,
                job.id,
                IDEMPOTENCY_TTL_S,
            )


@contextmanager
def _undone_on_failure(
    records: Records, tenant: str, job: JobPublic, idempotency_key: str | None
) -> Iterator[None]:
    """Leaves the Idempotency-Key free again, and no trace of ``job``, when writing it fails."""
    try:
        yield
    except QuotaExceededError:
        # Past the tenant's stored bytes or active jobs (429): nothing was written, and the
        # key is free again for the retry Retry-After asks for.
        if idempotency_key is not None:
            records.forget_idempotency(tenant, idempotency_key)
        raise
    except redis.RedisError:
        # The MULTI wrote all or nothing, but its answer may have been lost: undo it, so that
        # a retry with the same Idempotency-Key makes the job anew.
        with contextlib.suppress(redis.RedisError):
            records.delete_job(tenant, job)
            if idempotency_key is not None:
                records.forget_idempotency(tenant, idempotency_key)
        raise


def check_room_for_output(
    records: Records,
    settings: Settings,
    tenant: str,
    request: AnyJobCreate,
    model: ModelPublic,
) -> None:
    """429 naming ``max_stored_bytes`` for a job that registers a model (train, adapt) while
    its tenant has no room left for one of its input's size: the model a job registers is
    never refused once the job runs (NOTE [ Tenant quotas ] in service/records/tenancy/quotas.py),
    so the quota holds here. A job that only measures (evaluate) is not refused."""
    if JOB_KINDS[request.kind].registers_model:
        records.check_stored_bytes(tenant, model.size_bytes, settings.tenant_max_stored_bytes)


def job_holds(
    records: Records,
    request: AnyJobCreate,
    model: ModelPublic,
    dataset: DatasetPublic,
    resume_sha256: str | None,
) -> dict[str, int]:
    """The store objects a job holds from its creation (sha256 -> size): its model's weights,
    its dataset and the training checkpoint it resumes from."""
    held = {model.sha256: model.size_bytes, dataset.sha256: dataset.size_bytes}
    if resume_sha256 is not None and isinstance(request.params, TrainParams):
        size = records.client.hget(
            keys.record("job", str(request.params.resume_from)), CHECKPOINT_BYTES_FIELD
        )
        held[resume_sha256] = int(size or 0)
    return held


def _shape_fits(expected: list[int | None], got: list[int]) -> bool:
    return len(expected) == len(got) and all(
        e is None or e == g for e, g in zip(expected, got, strict=True)
    )


def check_fit(request: AnyJobCreate, model: ModelPublic, dataset: DatasetPublic) -> None:
    """422, saying what to change, when the job cannot run ``model`` on ``dataset`` as the
    job sees it (after its own preprocessing spec): sample shapes, labels the kind needs, the
    loss against the label kind, an adapt job's shards against its batches."""
    if not _shape_fits(model.input_shape, dataset.sample_shape):
        wanted = "x".join("any" if d is None else str(d) for d in model.input_shape)
        raise InvalidRequestError(
            f"dataset {dataset.id} has samples of shape {dataset.sample_shape} but model "
            f"{model.id} ({model.architecture}) takes samples of shape [{wanted}]; upload x as "
            f"(N, {', '.join('any' if d is None else str(d) for d in model.input_shape)})",
        )
    if JOB_KINDS[request.kind].needs_labels and not dataset.has_labels:
        raise InvalidRequestError(
            f"{request.kind} jobs need labels but dataset {dataset.id} has no y; upload a "
            "dataset with y (int64 class labels or float targets)",
        )
    loss = getattr(request.params, "loss", None)
    if loss is not None:
        if loss == "cross_entropy" and dataset.label_kind != "class":
            raise InvalidRequestError(
                f"loss cross_entropy needs int64 class labels but dataset {dataset.id} has "
                "float targets; use loss mse, or upload class labels",
            )
        if loss == "mse" and dataset.label_kind != "target":
            raise InvalidRequestError(
                f"loss mse needs float targets but dataset {dataset.id} has int64 class "
                "labels; use loss cross_entropy, or upload float targets",
            )
    params = request.params
    if isinstance(params, TrainParams):
        _check_train_fit(params, dataset)
    if isinstance(params, AdaptParams) and params.shards > 1:
        batches = params.estimation_batches(dataset.num_samples)
        holdout = params.effective_holdout()
        held = f", holdout {holdout:g} held out of estimation" if holdout > 0 else ""
        if params.shards > batches:
            raise InvalidRequestError(
                f"shards={params.shards} but the job runs only {batches} batches "
                f"({dataset.num_samples} samples of dataset {dataset.id}, batch_size "
                f"{params.batch_size}, max_batches {params.max_batches}{held}) and each shard "
                f"needs at least one whole batch; use shards <= {batches}, or a smaller "
                "batch_size",
            )


def _check_train_fit(params: TrainParams, dataset: DatasetPublic) -> None:
    """A train job's recipe against its dataset: label smoothing needs class labels, and the
    warm-up must end before the job's last optimizer step."""
    if params.label_smoothing > 0 and dataset.label_kind != "class":
        raise InvalidRequestError(
            f"label_smoothing needs int64 class labels but dataset {dataset.id} has float "
            "targets; drop label_smoothing, or upload class labels",
        )
    if params.augmentation is not None and len(dataset.sample_shape) != 3:
        raise InvalidRequestError(
            f"augmentation crops and flips images (C, H, W), and dataset {dataset.id} has "
            f"samples of shape {dataset.sample_shape}; drop augmentation, or use an image "
            "dataset",
        )
    # As workers/training/training.py splits and batches (split_indices, batch_bounds).
    num_val = max(1, int(dataset.num_samples * params.validation_fraction))
    train = dataset.num_samples - (num_val if params.validation_fraction > 0 else 0)
    batches = num_batches(train, params.batch_size)
    if params.batch_size > 1 and batches > 1 and train % params.batch_size == 1:
        batches -= 1
    steps = params.epochs * -(-batches // params.accumulate_steps)
    if params.warmup_steps >= steps:
        raise InvalidRequestError(
            f"warmup_steps={params.warmup_steps} but the job takes {steps} optimizer steps "
            f"({params.epochs} epochs of {batches} batches of {params.batch_size} samples, "
            f"accumulate_steps {params.accumulate_steps}); use warmup_steps below {steps}",
        )


# What a job that resumes another must share with it: its data order and its optimizer.
_RESUME_SAME: Final = (
    "seed",
    "batch_size",
    "accumulate_steps",
    "validation_fraction",
    "optimizer",
    # A checkpoint holds each rank's own RNG and loss sums, of its world size (NOTE [ Ranks
    # in a checkpoint ] in workers/training/train_state.py).
    "processes",
)


def resume_checkpoint(records: Records, tenant: str, request: AnyJobCreate) -> str | None:
    """The training checkpoint a train job with ``resume_from`` starts from: the latest of
    that job (NOTE [ Train checkpoint records ]). 404 for a job the tenant does not have
    (another tenant's reads the same as one that does not exist) or that is not a train job;
    422 for one still running, one that kept no checkpoint, or one that differs in what
    fixes the data order and the optimizer's state."""
    params = request.params
    if not isinstance(params, TrainParams) or params.resume_from is None:
        return None
    source = records.get_job(tenant, params.resume_from)
    if source is None or not isinstance(source.params, TrainParams):
        raise ResourceNotFoundError("job", params.resume_from)
    if not source.status.is_terminal:
        raise InvalidRequestError(
            f"job {source.id} is {source.status.value}; resume_from takes a job that has "
            "ended: wait for it, or cancel it first",
        )
    sha256 = records.train_checkpoint(source.id)
    if sha256 is None:
        raise InvalidRequestError(
            f"job {source.id} kept no training checkpoint (it ran without save_every_steps "
            "and save_every_s, or ended before its first); train anew, with save_every_steps "
            "to make a job others can resume",
        )
    differ = [
        f"{name} {getattr(params, name)!r} (job {source.id}: {getattr(source.params, name)!r})"
        for name in _RESUME_SAME
        if getattr(params, name) != getattr(source.params, name)
    ]
    differ += [
        f"{name} {getattr(request, name)!r} (job {source.id}: {getattr(source, name)!r})"
        for name in ("model_id", "dataset_id")
        if getattr(request, name) != getattr(source, name)
    ]
    if differ:
        raise InvalidRequestError(
            f"resume_from {source.id}: this job must train the same model on the same data "
            f"in the same order as that job, and differs in {', '.join(differ)}; use that "
            "job's values",
        )
    if source.status is JobStatus.SUCCEEDED and params.epochs <= source.params.epochs:
        raise InvalidRequestError(
            f"job {source.id} trained all its {source.params.epochs} epochs and this job asks "
            f"for epochs={params.epochs}; epochs counts from the start: ask for more than "
            f"{source.params.epochs}",
        )
    return sha256


def check_running_statistics(request: AnyJobCreate, model: ModelPublic) -> None:
    """422 for an adapt job whose estimator estimates running statistics on a model with no
    normalization layer that keeps them (a ViT or ConvNeXt has LayerNorm only; FrozenBatchNorm2d
    keeps none): the job would fail in the worker."""
    params = request.params
    if not isinstance(params, AdaptParams):
        return
    if not ESTIMATORS[params.estimator].needs_running_stats:
        return
    if any(layer.track_running_stats for layer in model.batchnorm_layers):
        return
    others = [name for name, spec in ESTIMATORS.items() if not spec.needs_running_stats]
    raise InvalidRequestError(
        f"estimator {params.estimator!r} re-estimates running statistics, but model {model.id} "
        f"({model.architecture}) has no normalization layer that keeps them (no BatchNorm "
        f"with track_running_stats; LayerNorm, GroupNorm and FrozenBatchNorm2d keep none); use "
        f"estimator {' or '.join(repr(n) for n in others)}, which trains the affine parameters "
        "of its BatchNorm, LayerNorm and GroupNorm layers",
    )


def job_payload(
    job_id: str,
    tenant: str,
    request: AnyJobCreate,
    model: ModelPublic,
    dataset: DatasetPublic,
    timeout_s: int | None = None,
    resume_sha256: str | None = None,
) -> JobPayload:
    """What the worker receives: the job, and what the API knows of its model and dataset
    (the dataset as the job sees it), so that no worker reads a whole dataset to plan."""
    return JobPayload(
        job_id=job_id,
        tenant_id=tenant,
        kind=request.kind,
        model=JobPayloadModel(
            id=model.id,
            architecture=model.architecture,
            kwargs=model.kwargs,
            weights_sha256=model.sha256,
            activations=model.activations,
        ),
        # Every fact the payload carries has its name in DatasetPublic.
        dataset=JobPayloadDataset.model_validate(dataset, from_attributes=True),
        params=request.params,
        priority=request.priority,
        timeout_s=timeout_s,
        resume_sha256=resume_sha256,
    )


def job_timeout(request: AnyJobCreate, settings: Settings) -> int:
    """The seconds the job may run: its own ``timeout_s``, else the service's default; 422
    past the operator's cap (NOTE [ Job bounds ] in api_schemas/jobs/params.py)."""
    if request.timeout_s is None:
        return settings.job_timeout_s
    if request.timeout_s > settings.job_timeout_max_s:
        raise InvalidRequestError(
            f"timeout_s {request.timeout_s} is past this service's cap of "
            f"{settings.job_timeout_max_s} s ({settings.job_timeout_max_s / 3600:g} h); use "
            f"timeout_s <= {settings.job_timeout_max_s}, or split the job (fewer epochs, steps "
            "or batches)",
        )
    return request.timeout_s


# NOTE [ Activation estimate ]
# A job whose activations cannot fit a worker is refused at submission (422, saying the
# largest batch_size that fits) rather than run to an out-of-memory death. The pieces:
# - the model inspector measures, when a model is registered, its activations in bytes per
#   element of its input (ActivationFootprint in api_schemas/models.py; activation_footprint
#   in workers/models/architectures.py), from a train-mode batch of two on the CPU: what the
#   allocator held at its peak (the profiler's memory events), for a forward without
#   gradients ("forward": evaluate, forward-only adapt) and for a forward and backward
#   ("backward": train, and the estimators that run backward passes), or, where more, what
#   the tensors alone come to (a hook on every leaf module). The peak counts what tensors
#   miss: a 3x3 convolution of 8 channels at 512x512 holds about 1.4 times its input and
#   output on the CPU while it runs. A job's model inherits its parent's figures.
# - each worker publishes the memory it offers a job (service/records/job_life/capacity.py): its
#   BNADAPT_WORKER_MEMORY_BYTES when set, else its machine's (or cgroup's) memory, or its
#   GPU's for a CUDA worker (workers/running/capacity.py); the API takes the smallest a
#   live worker of the job's queue published, else its own BNADAPT_WORKER_MEMORY_BYTES, else
#   checks nothing.
# - the estimate: the figure times the batch's input elements (batch_size times the
#   elements of a sample after the job's preprocessing), plus the weights (four copies with
#   backward passes: weights, gradients and two optimizer moments). A job is refused when it
#   is past MEMORY_HEADROOM of the worker's memory: the rest is left to the data loading
#   (decoding and resizing images), the measurement before and after, and the allocator's
#   slack. A job at the batch_size the 422 names ran within a worker holding its jobs to
#   256 MiB (tests/e2e/test_job_bounds_e2e.py).
# A train job in several processes counts each rank's weights and slice (needed_memory).
# What it does not count: activation checkpointing (a job with checkpointed blocks keeps less
# than the "backward" figure: the estimate errs on the safe side), a GPU's own workspaces
# (cuDNN's differ from the CPU's), and a model whose activations grow otherwise than with
# its input. A job that
# gets past the estimate and runs out of memory all the same fails at once, with an error
# saying so (workers/running/failures.py), and is not retried.
MEMORY_HEADROOM: Final = 0.7
_FLOAT_BYTES: Final = 4


def worker_memory(records: Records, settings: Settings, request: AnyJobCreate) -> int | None:
    """The memory a job of ``request`` may count on: the smallest a live worker of its queue
    published, else ``BNADAPT_WORKER_MEMORY_BYTES``, else None (unknown)."""
    queue = settings.job_queue(request.params.device)
    published = WorkerMemory(records.client).smallest(queue)
    return published if published is not None else settings.worker_memory_bytes


def _backward(request: AnyJobCreate) -> bool:
    params = request.params
    if isinstance(params, TrainParams):
        return True
    return isinstance(params, AdaptParams) and (
        params.spec.backward or (params.estimator == "auto" and params.allow_backward)
    )


def needed_memory(request: AnyJobCreate, model: ModelPublic) -> tuple[float, int] | None:
    """The estimate's two terms (NOTE [ Activation estimate ]): bytes per input element of
    the batch, and bytes of the weights; None for a model without a measured footprint."""
    if model.activations is None:
        return None
    backward = _backward(request)
    per_element = (
        model.activations.backward_bytes_per_element
        if backward
        else model.activations.forward_bytes_per_element
    )
    weights = model.parameter_count * _FLOAT_BYTES * (4 if backward else 1)
    params = request.params
    if not isinstance(params, TrainParams) or params.processes == 1:
        return per_element, weights
    # Ranks (NOTE [ A job's memory among its processes ] in workers/training/ranks.py): each
    # holds its own weights, gradients and moments and its slice of the batch. On CUDA each
    # rank has a GPU to itself: one rank's slice and copy against one GPU. Elsewhere they share
    # the worker's memory with the job's own process (one more copy of the weights): every
    # rank's copy, and their slices adding up to the batch.
    ranks = params.processes
    if params.device.startswith("cuda"):
        return per_element / ranks, weights
    return per_element, weights * ranks + model.parameter_count * _FLOAT_BYTES


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def check_memory(
    request: AnyJobCreate, model: ModelPublic, dataset: DatasetPublic, memory: int | None
) -> None:
    """422, saying the largest batch_size that fits, when the job's estimated activations are
    past :data:`MEMORY_HEADROOM` of ``memory`` (NOTE [ Activation estimate ])."""
    estimate = needed_memory(request, model)
    if estimate is None or memory is None:
        return
    per_element, weights = estimate
    per_sample = per_element * math.prod(dataset.sample_shape)
    batch = request.params.batch_size
    needed = per_sample * batch + weights
    if needed <= memory * MEMORY_HEADROOM:
        return
    fits = math.floor((memory * MEMORY_HEADROOM - weights) / per_sample) if per_sample else 0
    shape = "x".join(str(d) for d in dataset.sample_shape)
    smaller = "a smaller resize or center_crop" if dataset.preprocessing else "smaller samples"
    what = (
        f"use batch_size <= {fits}, or {smaller}"
        if fits >= 1
        else f"even batch_size 1 does not fit: use {smaller}, or workers with more memory"
    )
    params = request.params
    if isinstance(params, TrainParams) and params.processes > 1:
        what += (
            f"; or fewer processes than {params.processes}: each rank holds its own copy of "
            "the model and its optimizer state"
        )
    raise InvalidRequestError(
        f"batch_size {batch} at {shape} needs about {_size(needed)} of activations and weights "
        f"for model {model.id} ({model.architecture}); workers have {_size(memory)} (a job may "
        f"use {MEMORY_HEADROOM:.0%} of it): {what}",
    )
