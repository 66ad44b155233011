"""Settings of the API and the workers, from the environment (prefix ``BNADAPT_``)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Final, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from api_schemas.jobs.params import MAX_JOB_TIMEOUT_S

__all__ = [
    "DEFAULT_JOB_TIMEOUT_MAX_S",
    "DEFAULT_JOB_TIMEOUT_S",
    "DEFAULT_MAX_CLASSES",
    "DEFAULT_MAX_DATASET_BYTES",
    "DEFAULT_MAX_DATASET_ELEMENTS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "DEFAULT_MAX_NPZ_RATIO",
    "DEFAULT_MAX_WEIGHTS_BYTES",
    "DEFAULT_S3_PARTS_IN_FLIGHT",
    "DEFAULT_S3_PART_BYTES",
    "DEVICE_CLASSES",
    "Settings",
    "get_settings",
]

MIB: Final = 1024 * 1024
GIB: Final = 1024 * MIB
DEFAULT_MAX_WEIGHTS_BYTES: Final = 2 * GIB
# S3 multipart transfers, reads and writes: of the part sizes and counts in flight compared
# (16 MiB x 4, 8 MiB x 10 (boto3's defaults) and others), a read of 16 MiB x 8 took the least
# wall time and as little CPU as any (more, smaller parts cost more CPU: more requests, more
# threads); writes did not differ (bench/history/2026-12-03-s3-store-reads-hashed-as-they.md;
# figures `s3-read` and `s3-write` in bench/RESULTS.md).
# Memory per transfer: their product. 10,000 parts (S3's limit) of 16 MiB hold 156 GiB.
DEFAULT_S3_PART_BYTES: Final = 16 * MIB
DEFAULT_S3_PARTS_IN_FLIGHT: Final = 8
# NOTE [ Dataset limits ]
# One set of limits, read by the API (upload routes, registration) and the workers alike, all
# from these settings. A worker reads a dataset a batch at a time (NOTE [ Reading datasets in
# bounded memory ] in service/formats/arrays.py), so none of them bounds a worker's memory:
# they bound disk, upload time and what one tenant may ask of the service.
DEFAULT_MAX_DATASET_BYTES: Final = 64 * GIB
DEFAULT_MAX_DATASET_ELEMENTS: Final = 64 * GIB  # x and y together; a uint8 x of 64 GiB
DEFAULT_MAX_CLASSES: Final = 100_000
# numpy.savez_compressed shrinks real image data 2-20 times; zeros shrink ~1000 times.
DEFAULT_MAX_NPZ_RATIO: Final = 100.0
# An image's pixels (width x height), checked from its header before it is decoded: a
# decompression bomb (a small PNG that declares 100000 x 100000 pixels) is refused unread.
DEFAULT_MAX_IMAGE_PIXELS: Final = 64 * 1024 * 1024
# NOTE [ Queues by device ]
# A job that asks for `auto` waits in the queue `<queue>`, which every worker serves; one that
# asks for a device class waits in `<queue>-<class>` (`cuda:1` -> `<queue>-cuda`), served only
# by workers of that class (`bnadapt worker --device cuda:0` serves `<queue>-cuda` and
# `<queue>`). A CUDA job thus waits for a CUDA worker instead of failing on a CPU one, and its
# progress says so until a worker takes it.
DEVICE_CLASSES: Final = ("cpu", "cuda", "mps")
# A job's timeout: hours, not days, unless the operator raises the cap.
DEFAULT_JOB_TIMEOUT_S: Final = 6 * 3600
DEFAULT_JOB_TIMEOUT_MAX_S: Final = 48 * 3600


class Settings(BaseSettings):
    """One process's configuration. Nothing reads it at import time: see :func:`get_settings`."""

    model_config = SettingsConfigDict(env_prefix="BNADAPT_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    data_dir: Path = Path("data")
    # The artifact store: a local directory, or s3://BUCKET/PREFIX (endpoint and credentials
    # from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION).
    # Not set: BNADAPT_STORE_DIR, else <data_dir>/store.
    store_url: str | None = Field(default=None, min_length=1)
    store_dir: Path | None = None
    # Where a machine keeps its copies of S3 objects (service/store/cache.py); <data_dir>/cache
    # when not set. Least recently used objects go once the copies pass cache_max_bytes.
    cache_dir: Path | None = None
    cache_max_bytes: int = Field(default=20 * 1024 * MIB, ge=0)
    # S3 multipart part size, and parts in flight at once per transfer (memory: their product).
    s3_part_bytes: int = Field(default=DEFAULT_S3_PART_BYTES, ge=5 * MIB, le=5 * 1024 * MIB)
    s3_parts_in_flight: int = Field(default=DEFAULT_S3_PARTS_IN_FLIGHT, ge=1, le=64)
    # Lifetime of presigned URLs (weight downloads, direct uploads).
    s3_presign_ttl_s: int = Field(default=900, ge=1, le=7 * 24 * 3600)
    # The S3 endpoint as clients outside see it, for presigned URLs; AWS_ENDPOINT_URL if unset.
    s3_public_endpoint_url: str | None = None
    # RQ queue the API enqueues jobs on and workers listen to.
    queue: str = Field(default="bnadapt", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    max_weights_bytes: int = Field(default=DEFAULT_MAX_WEIGHTS_BYTES, ge=1)
    # The dataset limits (NOTE [ Dataset limits ]): a dataset file's bytes (also the body
    # limit of the upload routes), the numbers x and y hold, the classes of class labels.
    max_dataset_bytes: int = Field(default=DEFAULT_MAX_DATASET_BYTES, ge=1)
    max_dataset_elements: int = Field(default=DEFAULT_MAX_DATASET_ELEMENTS, ge=1)
    max_classes: int = Field(default=DEFAULT_MAX_CLASSES, ge=1)
    # Resumable uploads (/v1/uploads): the largest part, and how long a session (and the parts
    # it received) lasts after it was started.
    max_upload_part_bytes: int = Field(default=1 * GIB, ge=1)
    upload_ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    # An uploaded npz member may hold at most this many times its compressed size: reading
    # it allocates the uncompressed size (service/formats/arrays.py).
    max_npz_ratio: float = Field(default=DEFAULT_MAX_NPZ_RATIO, ge=1)
    # Image datasets (docs/datasets.md): the pixels of one image, and the processes that
    # decode a job's images (0: the job's own process decodes them; unset: chosen from the
    # worker's cores, NOTE [ Decoding in loader processes ] in workers/passes/images.py).
    max_image_pixels: int = Field(default=DEFAULT_MAX_IMAGE_PIXELS, ge=1)
    loader_processes: int | None = Field(default=None, ge=0, le=64)
    # Where a CUDA worker decodes a job's JPEGs: "auto" on the GPU where torchvision can, "cpu",
    # or "gpu" (a job fails where it cannot): NOTE [ Decoding on the GPU ] in
    # workers/passes/gpu_decoding.py.
    decode: Literal["auto", "cpu", "gpu"] = "auto"
    # How long an Idempotency-Key stays reserved for a POST /v1/jobs that has not written its
    # job yet (NOTE [ Idempotency lease ] in service/jobs/idempotency.py).
    idempotency_lease_s: float = Field(default=10.0, gt=0)
    # How long a running job keeps retrying its Redis writes (with backoff) through an outage
    # before it stops and its attempt counts as interrupted.
    redis_outage_s: float = Field(default=30.0, gt=0)
    # Threads of the API that copy and hash large objects (joining an upload's parts, checking
    # a dataset file, a direct upload or import, an uploaded weights file), apart from those
    # of the request path (NOTE [ Heavy work off the request path ] in service/api/offload.py).
    api_copy_threads: int = Field(default=4, ge=1, le=64)
    # How many of them one tenant may hold at once; the waiting work takes turns by tenant
    # (NOTE [ Heavy work in turns ]). Unset: half of them, rounded up.
    api_copy_tenant_threads: int | None = Field(default=None, ge=1, le=64)
    # How much lower those threads' processor priority is than the requests' (a nice value, on
    # Linux): NOTE [ Bytes at a lower priority ] in service/api/offload.py. 0 keeps them equal.
    api_copy_nice: int = Field(default=19, ge=0, le=19)
    # How much lower than it was started with an API process runs, requests and all (a nice
    # value): for API processes of their own for upload bytes (below).
    api_nice: int = Field(default=0, ge=0, le=19)
    # The base URL of API processes of their own for the bytes of resumable uploads (parts and
    # completion), run at a lower priority: NOTE [ Upload bytes in processes of their own ] in
    # service/api/routes/uploads.py. Unset: this API takes them.
    uploads_url: str | None = Field(default=None, pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")
    # How long POST /v1/models waits for a worker to check the weights; a worker's inspector
    # stops a build that takes longer.
    inspect_timeout_s: float = Field(default=60.0, gt=0)
    # What one model inspection may allocate, in bytes, beyond what its process holds idle
    # (NOTE [ Bounded builds ] in workers/models/sizing.py): a model estimated past it is
    # refused before it is built, and the build's process is held to it. None: three times
    # max_weights_bytes plus 2 GiB (inspect_memory_limit).
    inspect_memory_bytes: int | None = Field(default=None, ge=1)
    # How many models a worker's inspector builds at once, each in a builder process of its
    # own held to inspect_memory_bytes (so the inspector may take that many times as much).
    # A tenant has at most one build in flight (NOTE [ Inspection turns ] in
    # workers/processes/inspector.py): with 2, one tenant's large build never holds another's.
    inspect_builders: int = Field(default=2, ge=1, le=16)
    # A running job whose worker has not written a heartbeat for this long is failed.
    heartbeat_timeout_s: float = Field(default=30.0, gt=0)
    # Longest a job may run before its worker stops it and fails it (NOTE [ Job bounds ] in
    # service/jobs/submission.py): the default of a job that gives no `timeout_s`, and the
    # most a job may ask for.
    job_timeout_s: int = Field(default=DEFAULT_JOB_TIMEOUT_S, ge=1, le=MAX_JOB_TIMEOUT_S)
    job_timeout_max_s: int = Field(default=DEFAULT_JOB_TIMEOUT_MAX_S, ge=1, le=MAX_JOB_TIMEOUT_S)
    # The memory a job's activations may use on a worker, in bytes: a worker with it set
    # publishes it (else its machine's memory, or its GPU's), and its job processes may not
    # allocate more; the API refuses a job whose estimated activations do not fit the
    # smallest figure the live workers of its queue published, or this one when none has.
    # None: workers publish what they measure, and the API checks only against that.
    worker_memory_bytes: int | None = Field(default=None, ge=1)
    page_size_max: int = Field(default=200, ge=1)
    # Store objects nothing uses are deleted once they were written, and last used, this long
    # ago (NOTE [ Store garbage collection ] in service/store/gc.py) ...
    store_gc_grace_s: float = Field(default=3600.0, gt=0)
    # ... by a collection that starts this often in the whole deployment.
    store_gc_interval_s: float = Field(default=600.0, gt=0)
    # torch threads of each job; None: torch's default, a thread per core. Fewer leave cores
    # to the API and Redis where they share a small machine.
    worker_threads: int | None = Field(default=None, ge=1)

    # Ended jobs (their records, logs and reports) are deleted this long after they ended, by
    # housekeeping (service/upkeep/retention.py): 30 days. An ended job holds its inputs and
    # training checkpoint in its tenant's stored bytes until then (NOTE [ Tenant quotas ]).
    # None keeps them until deleted by hand.
    job_retention_s: float | None = Field(default=30 * 24 * 3600.0, gt=0)

    # NOTE [ Checks at the edge ] in service/api/edge.py: the body limit of every route that
    # takes JSON (the streaming routes keep theirs: weights, dataset files, upload parts), and
    # how deep a JSON body may nest.
    max_json_body_bytes: int = Field(default=1 * MIB, ge=1024)
    max_json_depth: int = Field(default=64, ge=2, le=512)
    # GET /metrics: the bearer token a scraper sends (Prometheus' `authorization` setting);
    # unset, only clients on this machine (loopback) of an API that listens on loopback may
    # scrape (api_host below). The deployment's figures (jobs, queue, workers, store) are
    # recomputed at most this often, by one API process.
    metrics_token: SecretStr | None = None
    metrics_refresh_s: float = Field(default=30.0, ge=1)
    # The address this API listens on, as given to uvicorn's --host (`bnadapt up` and
    # `bnadapt api` set it): without metrics_token, GET /metrics answers only an API that
    # listens on loopback alone, as this says and (on Linux) its listening sockets show (NOTE
    # [ Cheap scrapes ] in service/api/metrics.py).
    api_host: str | None = Field(default=None, min_length=1)
    # GET /readyz checks Redis and the store at most this often per API process, and answers
    # the last result in between (NOTE [ Cheap readiness ] in service/api/routes/health.py).
    ready_check_s: float = Field(default=5.0, gt=0)

    # Quotas per tenant (NOTE [ Tenant quotas ] in service/records/tenancy/quotas.py), each answered
    # 429 with Retry-After; 0 means no limit. `bnadapt tenants set-quota` gives a tenant its own.
    # Active (queued + running) jobs; bytes of the models and datasets a tenant holds; open
    # uploads (resumable and direct); open job event streams; requests per second, a token
    # bucket shared by every API process, holding up to tenant_rate_burst requests (0: as many
    # as one second's rate).
    tenant_max_active_jobs: int = Field(default=100, ge=0)
    tenant_max_stored_bytes: int = Field(default=100 * GIB, ge=0)
    tenant_max_open_uploads: int = Field(default=20, ge=0)
    tenant_max_streams: int = Field(default=10, ge=0)
    tenant_rate_per_s: float = Field(default=50.0, ge=0)
    tenant_rate_burst: int = Field(default=100, ge=0)

    # How every process writes its log lines: `text`, or `json`, one object per line
    # (NOTE [ JSON logs ] in service/log_format.py).
    log_format: Literal["text", "json"] = "text"

    @property
    def store_path(self) -> Path:
        """The local store's directory (when ``store_url`` is not an ``s3://`` URL)."""
        if self.store_url is not None and not self.store_url.startswith("s3://"):
            return Path(self.store_url)
        return self.store_dir if self.store_dir is not None else self.data_dir / "store"

    @property
    def inspect_memory_limit(self) -> int:
        """``inspect_memory_bytes``, or what the largest weights allowed need (three copies:
        NOTE [ Bounded builds ]) and 2 GiB for the activations of the inspection's probe."""
        if self.inspect_memory_bytes is not None:
            return self.inspect_memory_bytes
        return 3 * self.max_weights_bytes + 2 * GIB

    @property
    def cache_path(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else self.data_dir / "cache"

    def job_queue(self, device: str) -> str:
        """The RQ queue of a job asking for ``device``: NOTE [ Queues by device ]."""
        device_class = device.partition(":")[0]
        if device_class == "auto":
            return self.queue
        return f"{self.queue}-{device_class}"

    @property
    def job_queues(self) -> tuple[str, ...]:
        """Every queue a job may wait in."""
        return tuple(self.job_queue(device) for device in ("auto", *DEVICE_CLASSES))


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read from the environment on first use."""
    return Settings()
