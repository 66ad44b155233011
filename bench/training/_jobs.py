"""The train benchmarks' workloads, and one train job run in this process through
``compute()``, the function the worker runs (bench/training/compile.py,
bench/training/processes.py).

Two workloads: digits (the digits CNN, width 16, on sklearn's 1,797 8x8 digits) and resnet (the
resnet architecture, depth 4, width 16, on random 3x32x32 images, as many as the bench asks);
``quick``: a smaller digits job only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits

from api_schemas import JobPayload, Report, TrainParams
from api_schemas.jobs.public import JobPayloadDataset, JobPayloadModel
from harness.stack import npz_bytes
from service.store.local import LocalStore
from workers.kinds.changing import compute
from workers.models.architectures import build_model
from workers.running.saving import weights_bytes


@dataclass(frozen=True)
class Workload:
    name: str
    architecture: str
    kwargs: dict[str, Any]
    x: np.ndarray
    y: np.ndarray
    params: dict[str, Any]


def workloads(quick: bool, resnet_images: int, resnet_batch: int) -> list[Workload]:
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)  # (1797, 1, 8, 8)
    y = data.target.astype(np.int64)
    digits = Workload(
        "digits",
        "digits_cnn",
        {"width": 16},
        x[:400] if quick else x,
        y[:400] if quick else y,
        {"epochs": 1 if quick else 3, "batch_size": 64, "lr": 0.02},
    )
    if quick:
        return [digits]
    rng = np.random.default_rng(0)
    images = rng.random((resnet_images, 3, 32, 32), dtype=np.float32)
    labels = rng.integers(0, 10, resnet_images).astype(np.int64)
    resnet = Workload(
        "resnet",
        "resnet",
        {"depth": 4, "width": 16},
        images,
        labels,
        {"epochs": 2, "batch_size": resnet_batch, "lr": 0.02},
    )
    return [digits, resnet]


def run_job(store: LocalStore, workload: Workload, **params: Any) -> Report:
    """The workload as one train job without validation, with ``params`` (``device``,
    ``compile``, ``processes``) over the workload's own; its report."""
    torch.manual_seed(0)
    model = build_model(workload.architecture, workload.kwargs)
    payload = JobPayload(
        job_id="job_bench",
        tenant_id="tn_bench",
        kind="train",
        model=JobPayloadModel(
            id="mdl_bench",
            architecture=workload.architecture,
            kwargs=workload.kwargs,
            weights_sha256=store.put_bytes(weights_bytes(model.state_dict())),
        ),
        dataset=JobPayloadDataset(
            id="ds_bench",
            sha256=store.put_bytes(npz_bytes(x=workload.x, y=workload.y)),
            format="npz",
        ),
        params=TrainParams.model_validate(
            {**workload.params, **params, "validation_fraction": 0.0}
        ),
    )
    return compute(payload, store).report
