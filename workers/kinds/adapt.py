"""The ``adapt`` row's runner: one worker computes and registers, or, with ``shards > 1``,
the shards are queued (NOTE [ Sharded adaptation ] in workers/sharding/compute.py). Its change
to the model, which a sharded job's merge runs too, is workers/running/adaptation.py."""

from __future__ import annotations

from api_schemas import AdaptParams, JobPayload
from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store
from workers.kinds.changing import run_change
from workers.running.adaptation import Adaptation
from workers.running.runtime import JobRuntime
from workers.sharding.jobs import start_shards

__all__ = ["change", "run"]


def change(payload: JobPayload) -> Adaptation:
    """The adapt job's change to its model: its estimator on its selected layers."""
    params = payload.params
    assert isinstance(params, AdaptParams), f"{payload.kind} jobs do not adapt"
    return Adaptation(params)


def run(job: JobPayload, records: Records, store: Store, settings: Settings) -> dict[str, str]:
    """Adapts and registers the new model, unless the job is sharded: then it returns once the
    shards are queued, since waiting here for them could deadlock a single worker."""
    adaptation = change(job)
    if adaptation.params.shards == 1:
        return run_change(job, records, store, settings, adaptation)
    with JobRuntime(
        records, job.job_id, settings.heartbeat_timeout_s, settings.redis_outage_s
    ) as runtime:
        return start_shards(job, records, store, runtime, settings)
