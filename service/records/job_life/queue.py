"""Putting a job's run on the RQ queue: by the API for a job's first attempt, by the sweep for
each later one (NOTE [ Job attempts ] in service/records/job_life/retries.py), in the queue of its
tenant and priority (NOTE [ Fair turns ] in service/records/tenancy/turns.py)."""

from __future__ import annotations

from typing import Any, Final

import redis
from rq import Queue

from service.records.tenancy.turns import announce, turn_queue

__all__ = ["JOB_FUNCTION", "RQ_FAILURE_TTL_S", "RQ_RESULT_TTL_S", "enqueue_run"]

# Enqueued by dotted path: the service never imports workers (or torch).
JOB_FUNCTION: Final = "workers.running.job.run_job"
# RQ's own job hash may go after this; our records never expire.
RQ_RESULT_TTL_S: Final = 24 * 3600
RQ_FAILURE_TTL_S: Final = 7 * 24 * 3600


def enqueue_run(
    queue: Queue,
    payload: dict[str, Any],
    rq_id: str,
    timeout_s: int,
    description: str,
    pipeline: redis.client.Pipeline | None = None,
) -> None:
    """Queues one attempt of the job ``payload`` describes under the RQ id ``rq_id``, in the
    device queue ``queue``'s turns: the queue of the job's tenant and priority there. Without
    a pipeline the id must be new: a second enqueue of it raises RQ's ``DuplicateJobError``
    (two sweeps enqueueing the same attempt at once)."""
    tenant, priority = str(payload["tenant_id"]), int(payload.get("priority", 0))
    own = turn_queue(queue.connection, queue.name, tenant, priority)
    own.enqueue_call(
        JOB_FUNCTION,
        args=(payload,),
        job_id=rq_id,
        timeout=timeout_s,
        result_ttl=RQ_RESULT_TTL_S,
        failure_ttl=RQ_FAILURE_TTL_S,
        description=description,
        pipeline=pipeline,
        unique=pipeline is None,
    )
    announce(queue.connection if pipeline is None else pipeline, queue.name, tenant, priority)
