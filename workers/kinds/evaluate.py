"""The ``evaluate`` row's runner: measure (:func:`compute_evaluation`), store the report,
register nothing."""

from __future__ import annotations

import time

import torch

from api_schemas import EvaluateParams, JobPayload, JobResultLinks, JobStatus
from api_schemas.reports import Report, Timings
from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store
from workers.errors import DataError, JobCanceled
from workers.passes.data import num_batches
from workers.passes.hooks import JobHooks, NoHooks
from workers.running.evaluation import contract_metrics, evaluate_sums, loss_for
from workers.running.loading import load_model, open_dataset, resolve_device
from workers.running.runtime import JobRuntime

__all__ = ["compute_evaluation", "run"]


def run(job: JobPayload, records: Records, store: Store, settings: Settings) -> dict[str, str]:
    """Evaluates, stores the report and marks the job succeeded; no model is registered."""
    with JobRuntime(
        records, job.job_id, settings.heartbeat_timeout_s, settings.redis_outage_s
    ) as runtime:
        report = compute_evaluation(job, store, runtime)
        if runtime.check_cancel_now():
            raise JobCanceled(f"job {job.job_id} was canceled")
        report_sha256 = store.put_bytes(report.model_dump_json(indent=2).encode())
        records.add_sha_ref(report_sha256, job.job_id)
    # Marked once the runtime has stopped: it would take the new status for a verdict from
    # elsewhere. If the reaper gave up on the job meanwhile, its verdict stands.
    links = JobResultLinks(
        model_id=None, weights_url=None, report_url=f"/v1/jobs/{job.job_id}/report"
    )
    records.mark_finished(
        job.job_id, JobStatus.SUCCEEDED, result=links, report_sha256=report_sha256
    )
    return {"job_id": job.job_id, "status": str(records.job_status(job.job_id))}


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
