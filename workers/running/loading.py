"""A job's inputs, loaded: its device, its model from the store and its dataset.

:func:`load_job` is where every job that changes a model starts (workers/running/compute.py,
and each child of a sharded job); an ``evaluate`` job loads the model and dataset alone
(workers/kinds/evaluate.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

import numpy as np
import safetensors.torch
import torch
from torch import nn

from api_schemas import JobPayload, ModelJobParams, Preprocessing
from service.formats.arrays import open_arrays
from service.settings import get_settings
from service.store.base import Store
from workers.errors import ArchitectureError, DataError, WorkerError
from workers.models.architectures import Architecture, build_model, load_weights, registry
from workers.models.policy import CheckpointOutcome, checkpoint_model
from workers.passes.data import Data, Samples, labels_tensor
from workers.passes.gpu_decoding import gpu_decodes
from workers.passes.images import ImageSamples, array_transform, auto_loader_processes

__all__ = [
    "WORKER_DEVICE_ENV",
    "LoadedJob",
    "load_job",
    "load_model",
    "open_dataset",
    "resolve_device",
]

# Set by `bnadapt worker --device`; a job's `device: auto` means this worker's device.
WORKER_DEVICE_ENV: Final = "BNADAPT_WORKER_DEVICE"


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
        load_weights(model, state)
    except RuntimeError as exc:
        raise ArchitectureError(
            f"the weights of model {payload.model.id} no longer load into "
            f"{payload.model.architecture}: {exc}"
        ) from exc
    return model


@dataclass(frozen=True)
class LoadedJob:
    """An adapt or train job's inputs, ready to run."""

    params: ModelJobParams  # the payload's params (an adapt or train job's)
    model: nn.Module  # on `device`, run through the job's checkpoint policy
    x: Data  # (N, ...) read a batch at a time on the CPU; batches move to `device`
    y: torch.Tensor | None  # (N,) labels or (N, ...) targets, on the CPU
    device: torch.device
    arch: Architecture
    checkpointed: CheckpointOutcome | None = None  # what the job's checkpoint policy wrapped


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
        device = resolve_device(payload.params.device)
        loaders = settings.loader_processes
        if loaders is None:
            loaders = auto_loader_processes(device.type, len(os.sched_getaffinity(0)))
        spec = spec or Preprocessing()
        gpu_decode = gpu_decodes(settings.decode, device, spec)
        images, labels = ImageSamples.open(
            path, spec, shape, loaders, settings.max_image_pixels, gpu_decode
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
    reads the dataset: where :func:`~workers.running.compute.compute` and each child of a
    sharded job start."""
    params = payload.params
    # Only the runners of kinds that change a model load a job here (an evaluate job loads
    # its model and dataset alone), so the params derive from ModelJobParams.
    assert isinstance(params, ModelJobParams), f"{payload.kind} jobs do not change a model"
    torch.manual_seed(params.seed)
    device = resolve_device(params.device)
    model = load_model(payload, store).to(device)
    x, y = open_dataset(payload, store)
    arch = registry()[payload.model.architecture]
    policy = params.checkpoint
    checkpointed = checkpoint_model(
        model, arch, policy.preset, policy.modules, policy.types, policy.offload_to_cpu
    )
    return LoadedJob(params, model, x, y, device, arch, checkpointed)
