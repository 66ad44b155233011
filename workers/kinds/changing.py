"""What the runner of every kind that changes a model does, and the same computation in this
process.

:func:`run_change` is a runner's whole work: the shared computation with the kind's
:class:`~workers.running.compute.ModelChange` (NOTE [ A kind's change to the model ]), then the
new model saved, registered and the job marked succeeded. :func:`compute` runs the computation
alone for a payload of any such kind, as its runner would: what tests and benchmarks call.
"""

from __future__ import annotations

from collections.abc import Callable

from api_schemas import JOB_KINDS, JobPayload
from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store
from workers import import_path
from workers.passes.hooks import JobHooks
from workers.running import compute as computation
from workers.running.compute import JobOutcome, ModelChange
from workers.running.runtime import JobRuntime
from workers.running.saving import mark_succeeded, save_outcome

__all__ = ["compute", "model_change", "run_change"]


def run_change(
    job: JobPayload, records: Records, store: Store, settings: Settings, change: ModelChange
) -> dict[str, str]:
    """Runs the job's computation with ``change``, saves weights and report, registers the new
    model and marks the job succeeded; returns the RQ job's result."""
    with JobRuntime(
        records, job.job_id, settings.heartbeat_timeout_s, settings.redis_outage_s
    ) as runtime:
        outcome = computation.compute(job, store, change, runtime)
        saved = save_outcome(job, outcome, records, store, runtime)
    return mark_succeeded(job, saved, records)


def model_change(payload: JobPayload) -> ModelChange:
    """The change of the payload's kind: the ``change`` function beside the runner that the
    kind's row of the job-kind table names."""
    module, _, _ = JOB_KINDS[payload.kind].runner.partition(":")
    change: Callable[[JobPayload], ModelChange] = import_path(f"{module}:change")
    return change(payload)


def compute(
    payload: JobPayload, store: Store, hooks: JobHooks | None = None, measure: bool = True
) -> JobOutcome:
    """:func:`workers.running.compute.compute` with the change of the payload's kind."""
    return computation.compute(payload, store, model_change(payload), hooks, measure)
