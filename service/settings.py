"""Settings of the API and the workers, from the environment (prefix ``BNADAPT_``)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Final

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "DEFAULT_MAX_DATASET_BYTES",
    "DEFAULT_MAX_NPZ_RATIO",
    "DEFAULT_MAX_WEIGHTS_BYTES",
    "Settings",
    "get_settings",
]

MIB: Final = 1024 * 1024
DEFAULT_MAX_WEIGHTS_BYTES: Final = 2048 * MIB
DEFAULT_MAX_DATASET_BYTES: Final = 4096 * MIB
# numpy.savez_compressed shrinks real image data 2-20 times; zeros shrink ~1000 times.
DEFAULT_MAX_NPZ_RATIO: Final = 100.0


class Settings(BaseSettings):
    """One process's configuration. Nothing reads it at import time: see :func:`get_settings`."""

    model_config = SettingsConfigDict(env_prefix="BNADAPT_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    data_dir: Path = Path("data")
    # The artifact store; <data_dir>/store when not set.
    store_dir: Path | None = None
    # RQ queue the API enqueues jobs on and workers listen to.
    queue: str = Field(default="bnadapt", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    max_weights_bytes: int = Field(default=DEFAULT_MAX_WEIGHTS_BYTES, ge=1)
    max_dataset_bytes: int = Field(default=DEFAULT_MAX_DATASET_BYTES, ge=1)
    # Largest x a dataset may hold, in elements (bounds the memory a worker needs).
    max_dataset_elements: int = Field(default=2_000_000_000, ge=1)
    # An uploaded npz member may hold at most this many times its compressed size: reading
    # it allocates the uncompressed size (service/formats/arrays.py).
    max_npz_ratio: float = Field(default=DEFAULT_MAX_NPZ_RATIO, ge=1)
    # How long an Idempotency-Key stays reserved for a POST /v1/jobs that has not written its
    # job yet (NOTE [ Idempotency lease ] in service/api/routes/jobs.py).
    idempotency_lease_s: float = Field(default=10.0, gt=0)
    # How long a running job keeps retrying its Redis writes (with backoff) through an outage
    # before it stops and its attempt counts as interrupted.
    redis_outage_s: float = Field(default=30.0, gt=0)
    # How long POST /v1/models waits for a worker to check the weights.
    inspect_timeout_s: float = Field(default=60.0, gt=0)
    # A running job whose worker has not written a heartbeat for this long is failed.
    heartbeat_timeout_s: float = Field(default=30.0, gt=0)
    # Longest a job may run before RQ stops it.
    job_timeout_s: int = Field(default=7 * 24 * 3600, ge=1)
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
    # housekeeping (service/upkeep/retention.py); None keeps them until deleted by hand.
    job_retention_s: float | None = Field(default=None, gt=0)

    @property
    def store_path(self) -> Path:
        return self.store_dir if self.store_dir is not None else self.data_dir / "store"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read from the environment on first use."""
    return Settings()
