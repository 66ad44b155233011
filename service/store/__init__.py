"""The artifact store: content-addressed objects (weights, datasets, reports).

- :mod:`service.store.base` — the :class:`Store` protocol every backend implements;
- :mod:`service.store.local` — a local directory (or a mount shared by API and workers);
- :mod:`service.store.s3` — an S3-compatible bucket, with :mod:`service.store.cache`, each
  machine's bounded copies of the objects it uses;
- :mod:`service.store.gc` — the collector of objects nothing uses;
- :func:`open_store` — the one way to open the store the settings name.
"""

from service.settings import Settings
from service.store.base import Store
from service.store.local import LocalStore

__all__ = ["open_store"]


def open_store(settings: Settings) -> Store:
    """The store the settings name: ``BNADAPT_STORE_URL`` = ``s3://BUCKET/PREFIX`` or a local
    directory; without it ``BNADAPT_STORE_DIR`` (default ``<data dir>/store``). A new backend
    is chosen here, and nowhere else."""
    url = settings.store_url
    if url is not None and url.startswith("s3://"):
        # Imported here: boto3 loads only in processes configured for S3.
        from service.records.connection import redis_client
        from service.store.cache import ObjectCache
        from service.store.s3 import S3Store, parse_s3_url

        bucket, prefix = parse_s3_url(url)
        return S3Store(
            bucket,
            prefix,
            ObjectCache(settings.cache_path, settings.cache_max_bytes),
            redis_client(settings.redis_url),
            part_bytes=settings.s3_part_bytes,
            parts_in_flight=settings.s3_parts_in_flight,
            presign_ttl_s=settings.s3_presign_ttl_s,
            public_endpoint_url=settings.s3_public_endpoint_url,
        )
    return LocalStore(settings.store_path)
