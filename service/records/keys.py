"""Names of every Redis key the service and the workers use, in one place.

Records never expire: a job, model or dataset stays until it is deleted. Only liveness keys
(heartbeats, the architecture catalog, inspection replies), idempotency keys and the store
collector's schedule have a TTL.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = [
    "ARCHITECTURES",
    "ARCHITECTURES_DIGEST",
    "FINISHED_JOBS",
    "INSPECTORS_ALIVE",
    "INSPECT_BELL",
    "INSPECT_CLOCK",
    "INSPECT_REQUESTS",
    "INSPECT_TENANTS",
    "QUEUED_JOBS",
    "RUNNING_JOBS",
    "STORE_GC_LOCK",
    "STORE_GC_STARTED",
    "STORE_RELEASED",
    "STORE_WRITTEN",
    "TURN_WEIGHTS",
    "ResourceKind",
    "api_key",
    "direct_upload",
    "idempotency",
    "inspect_busy",
    "inspect_reply",
    "inspect_requests",
    "job_cancel",
    "job_child_result",
    "job_epochs",
    "job_heartbeat",
    "job_log_seq",
    "job_logs",
    "job_output",
    "job_progress",
    "job_shard_progress",
    "job_shards",
    "record",
    "rq_job_holder",
    "rq_job_unheld_since",
    "rq_worker_holds",
    "sha_refs",
    "store_deleting",
    "tenant",
    "tenant_active_jobs",
    "tenant_by_name",
    "tenant_held_counts",
    "tenant_held_sizes",
    "tenant_holders",
    "tenant_holdings_counted",
    "tenant_import_sources",
    "tenant_index",
    "tenant_quotas",
    "tenant_rate",
    "tenant_stored_bytes",
    "tenant_streams",
    "tenant_upload_holds",
    "tenant_uploads",
    "turns",
    "upload",
    "upload_part_holders",
    "upload_parts",
    "worker_memory",
]

PREFIX: Final = "bnadapt"
ResourceKind = Literal["model", "dataset", "job"]

# The architectures the workers can build, published by each inspector (JSON, with a TTL).
ARCHITECTURES: Final = f"{PREFIX}:architectures"
# The SHA-256 of that JSON, so that an inspector renews the catalog's expiry rather than
# rewrite about 1 MB every few seconds when it is the one already there.
ARCHITECTURES_DIGEST: Final = f"{PREFIX}:architectures:sha256"
# Set while at least one inspector runs (TTL refreshed by each).
INSPECTORS_ALIVE: Final = f"{PREFIX}:inspectors-alive"
# List of inspection requests (JSON) an earlier release's API pushed, before the requests
# waited per tenant (inspect_requests): inspectors take what is there first.
INSPECT_REQUESTS: Final = f"{PREFIX}:inspect:requests"
# NOTE [ Inspection turns ] in workers/processes/inspector.py: the sorted set of tenants
# with inspection requests, scored by their next turn; the turns' clock; the bell idle
# inspectors wait on.
INSPECT_TENANTS: Final = f"{PREFIX}:inspect:tenants"
INSPECT_CLOCK: Final = f"{PREFIX}:inspect:clock"
INSPECT_BELL: Final = f"{PREFIX}:inspect:bell"
# Set of job ids whose status is `running`, for the reaper.
RUNNING_JOBS: Final = f"{PREFIX}:jobs:running"
# Set of job ids whose status is `queued`, for the reaper to compare with RQ's view.
QUEUED_JOBS: Final = f"{PREFIX}:jobs:queued"
# Sorted set: ids of ended jobs (succeeded, failed, canceled), scored by when they ended
# (seconds since the epoch), for the retention sweep (BNADAPT_JOB_RETENTION_S).
FINISHED_JOBS: Final = f"{PREFIX}:jobs:finished"
# Sorted set: store objects whose reference was dropped, scored by when (seconds since the
# epoch); see NOTE [ Store garbage collection ] in service/store/gc.py.
STORE_RELEASED: Final = f"{PREFIX}:store:released"
# Sorted set: S3 store objects scored by when a writer last wrote (or found) them; the S3
# store's stand-in for a file's mtime (NOTE [ Collecting an S3 store ] in
# service/store/s3/collection.py).
STORE_WRITTEN: Final = f"{PREFIX}:store:written"
# Held by the one store collection running (a redis-py lock).
STORE_GC_LOCK: Final = f"{PREFIX}:store:gc-lock"
# Present (with a TTL of the collection interval) once a collection started.
STORE_GC_STARTED: Final = f"{PREFIX}:store:gc-started"
# Hash: tenant id -> the weight of its turns (NOTE [ Fair turns ] in
# service/records/tenancy/turns.py); a tenant not in it has weight 1.
TURN_WEIGHTS: Final = f"{PREFIX}:turns:weights"


def api_key(key_id: str) -> str:
    """Hash: tenant_id, secret_sha256, created_at."""
    return f"{PREFIX}:apikey:{key_id}"


def tenant(tenant_id: str) -> str:
    """Hash: name, created_at."""
    return f"{PREFIX}:tenant:{tenant_id}"


def tenant_by_name(name: str) -> str:
    return f"{PREFIX}:tenant-name:{name}"


def tenant_quotas(tenant_id: str) -> str:
    """Hash: quota name -> the tenant's own value, where it has one
    (service/records/tenancy/quotas.py)."""
    return f"{PREFIX}:tenant:{tenant_id}:quota-overrides"


def tenant_active_jobs(tenant_id: str) -> str:
    """Sorted set: the tenant's queued and running jobs, each scored +inf, and the slots
    reserved for submissions whose record is not written yet, scored by when the reservation
    lapses (Redis server time, s). NOTE [ Tenant quotas ]. (The set of earlier releases was
    ``...:active-jobs``.)"""
    return f"{PREFIX}:tenant:{tenant_id}:active-job-slots"


def tenant_stored_bytes(tenant_id: str) -> str:
    """Counter: the bytes of the distinct store objects the tenant holds, reservations of its
    open uploads included (NOTE [ Tenant quotas ])."""
    return f"{PREFIX}:tenant:{tenant_id}:stored-bytes"


def tenant_held_sizes(tenant_id: str) -> str:
    """Hash: sha256 (or ``upload:<id>``, an open upload's reservation) -> the size in bytes of
    each object the tenant holds (NOTE [ Tenant quotas ])."""
    return f"{PREFIX}:tenant:{tenant_id}:held-sizes"


def tenant_held_counts(tenant_id: str) -> str:
    """Hash: sha256 -> how many of the tenant's holders hold it."""
    return f"{PREFIX}:tenant:{tenant_id}:held-counts"


def tenant_holders(tenant_id: str) -> str:
    """Hash: ``<sha256> <holder id>`` -> 1 for each hold (a model, dataset, job or
    ``upload:<id>``)."""
    return f"{PREFIX}:tenant:{tenant_id}:holders"


def tenant_holdings_counted(tenant_id: str) -> str:
    """Present once the tenant's holdings were counted from its records (a tenant from before
    they were kept: ``ensure_stored_bytes_counted``)."""
    return f"{PREFIX}:tenant:{tenant_id}:holdings-counted"


def tenant_upload_holds(tenant_id: str) -> str:
    """Hash: open upload id -> JSON list of what it holds (its reservation, its parts)."""
    return f"{PREFIX}:tenant:{tenant_id}:upload-holds"


def tenant_uploads(tenant_id: str) -> str:
    """Sorted set: the tenant's open uploads (resumable and direct), scored by when they expire
    (seconds since the epoch)."""
    return f"{PREFIX}:tenant:{tenant_id}:open-uploads"


def tenant_streams(tenant_id: str) -> str:
    """Sorted set: leases of the tenant's open event streams, scored by when they expire
    (Redis server time, ms); with a TTL."""
    return f"{PREFIX}:tenant:{tenant_id}:event-streams"


def tenant_rate(tenant_id: str) -> str:
    """Hash: the tenant's request token bucket (tokens, ts); with a TTL."""
    return f"{PREFIX}:tenant:{tenant_id}:rate-bucket"


def tenant_import_sources(tenant_id: str) -> str:
    """Set: the ``s3://BUCKET/PREFIX/`` sources the tenant may import datasets from
    (service/records/tenancy/import_sources.py)."""
    return f"{PREFIX}:tenant:{tenant_id}:import-sources"


def record(kind: ResourceKind, resource_id: str) -> str:
    """Hash holding one model, dataset or job (see service.records.sync)."""
    return f"{PREFIX}:{kind}:{resource_id}"


def tenant_index(tenant_id: str, kind: ResourceKind) -> str:
    """Sorted set (all scores 0) of ``<created_at_us>:<id>`` members, for paging by range."""
    return f"{PREFIX}:tenant:{tenant_id}:{kind}s"


def sha_refs(sha256: str) -> str:
    """Set of ids (models, datasets, jobs' reports) that use this store object."""
    return f"{PREFIX}:sha-refs:{sha256}"


def job_output(job_id: str) -> str:
    """The id of the model a job registered: at most one per job, whatever its attempts."""
    return f"{PREFIX}:job:{job_id}:output"


def store_deleting(sha256: str) -> str:
    """Present (with a TTL) while a collection deletes this S3 object; writers wait for it."""
    return f"{PREFIX}:store:deleting:{sha256}"


def job_progress(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:progress"


def job_logs(job_id: str) -> str:
    """List: what the job's processes logged (JSON entries, the latest few hundred kept)."""
    return f"{PREFIX}:job:{job_id}:logs"


def job_epochs(job_id: str) -> str:
    """Hash: a train job's validated epochs, epoch number -> its ``EpochEvent`` (JSON); an
    epoch a retried attempt does again writes the same field (NOTE [ Job events ])."""
    return f"{PREFIX}:job:{job_id}:epochs"


def job_log_seq(job_id: str) -> str:
    """Counter: the sequence number of the job's last log entry (entries trimmed from the
    list keep theirs, so a follower's position survives the trim)."""
    return f"{PREFIX}:job:{job_id}:log-seq"


def job_cancel(job_id: str) -> str:
    """Present when a cancel was asked for; the job's loop polls it."""
    return f"{PREFIX}:job:{job_id}:cancel"


def job_heartbeat(job_id: str) -> str:
    """Refreshed by a running job (or a running shard or merge job of a sharded one, under
    its RQ job id); its absence means the job's process is gone."""
    return f"{PREFIX}:job:{job_id}:heartbeat"


def rq_worker_holds(worker_name: str) -> str:
    """Refreshed by a live RQ worker process: the RQ id of the job it took from its queue and
    runs, or "" (NOTE [ Dequeued and lost ] in service/upkeep/reaper.py)."""
    return f"{PREFIX}:rq-worker:{worker_name}:holds"


def rq_job_holder(rq_id: str) -> str:
    """The name of the RQ worker that took RQ job ``rq_id`` from its queue, until it is done
    with it (NOTE [ Dequeued and lost ])."""
    return f"{PREFIX}:rq-job:{rq_id}:holder"


def rq_job_unheld_since(rq_id: str) -> str:
    """When a sweep first found RQ job ``rq_id`` taken from its queue with no holder (Redis
    server time, ms) (NOTE [ Dequeued and lost ])."""
    return f"{PREFIX}:rq-job:{rq_id}:unheld-since"


def job_shards(job_id: str) -> str:
    """Hash: the state of each shard and merge job of a sharded job
    (service.records.job_life.shards)."""
    return f"{PREFIX}:job:{job_id}:shards"


def job_shard_progress(job_id: str) -> str:
    """Hash: each shard's own progress (JSON), summed into ``job_progress(job_id)``."""
    return f"{PREFIX}:job:{job_id}:shard-progress"


def job_child_result(job_id: str, child: str) -> str:
    """What child ``child`` of a sharded job hands on (JSON), e.g. the statistics a shard
    collected, for the merge; with a TTL."""
    return f"{PREFIX}:job:{job_id}:result:{child}"


def upload(upload_id: str) -> str:
    """Hash: a resumable upload's tenant, name, created_at, expires_at; with a TTL."""
    return f"{PREFIX}:upload:{upload_id}"


def upload_parts(upload_id: str) -> str:
    """Hash: part number -> ``<sha256>:<size>`` of each part received; same TTL as the upload."""
    return f"{PREFIX}:upload:{upload_id}:parts"


def upload_part_holders(sha256: str) -> str:
    """Sorted set: the ids of the upload sessions that sent a part with these bytes, each
    scored by the session's expiry (NOTE [ Upload parts in the store ] in
    service/records/stored/uploads.py); expires with the latest of them."""
    return f"{PREFIX}:upload-part:{sha256}:holders"


def direct_upload(upload_id: str) -> str:
    """Hash: a direct upload to the S3 store in progress (service/api/routes/direct_uploads.py);
    with a TTL."""
    return f"{PREFIX}:direct-upload:{upload_id}"


def idempotency(tenant_id: str, key: str) -> str:
    return f"{PREFIX}:idem:{tenant_id}:{key}"


def inspect_reply(request_id: str) -> str:
    return f"{PREFIX}:inspect:reply:{request_id}"


def inspect_requests(tenant_id: str) -> str:
    """List: the tenant's inspection requests (JSON), first in, first out."""
    return f"{PREFIX}:inspect:requests:{tenant_id}"


def inspect_busy(tenant_id: str) -> str:
    """String with a TTL: the inspector building one of the tenant's models holds it."""
    return f"{PREFIX}:inspect:busy:{tenant_id}"


def turns(base_queue: str) -> str:
    """Prefix of the keys that take turns between the tenants of the RQ queue ``base_queue``
    (NOTE [ Fair turns ] in service/records/tenancy/turns.py): ``<prefix>:tenants``,
    ``<prefix>:clock``, ``<prefix>:bell``, ``<prefix>:queues:<tenant id>``."""
    return f"{PREFIX}:turns:{base_queue}"


def worker_memory(queue: str) -> str:
    """Hash: worker name -> ``<bytes> <expires at, epoch s>``, the memory each live worker
    serving ``queue`` offers a job (service/records/job_life/capacity.py)."""
    return f"{PREFIX}:worker-memory:{queue}"
