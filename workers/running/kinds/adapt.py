"""The ``adapt`` row's runner: one worker computes and registers, or, with ``shards > 1``,
the shards are queued (NOTE [ Sharded adaptation ] in workers/sharding/compute.py)."""

from __future__ import annotations

from api_schemas import AdaptParams, JobPayload
from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store
from workers.running.kinds import train
from workers.running.runtime import JobRuntime
from workers.sharding.jobs import start_shards

__all__ = ["run"]


def run(job: JobPayload, records: Records, store: Store, settings: Settings) -> dict[str, str]:
    """Adapts as a train job trains (the computation tells the two apart), unless the job is
    sharded: then it returns once the shards are queued, since waiting here for them could
    deadlock a single worker."""
    params = job.params
    assert isinstance(params, AdaptParams), f"{job.kind} jobs do not run the adapt runner"
    if params.shards == 1:
        return train.run(job, records, store, settings)
    with JobRuntime(
        records, job.job_id, settings.heartbeat_timeout_s, settings.redis_outage_s
    ) as runtime:
        return start_shards(job, records, store, runtime, settings)
