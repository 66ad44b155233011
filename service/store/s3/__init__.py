"""The content-addressed store in an S3-compatible bucket (AWS S3, MinIO, SeaweedFS, Ceph, R2).

Keys under the prefix (``s3://BUCKET/PREFIX``)::

    objects/<sha256>   committed objects, never modified
    tmp/<random>       objects that reached the bucket directly, being checked

Bookkeeping (references, release and write times, deletion markers, the collector's lock)
lives in Redis, never in the bucket. boto3 is imported only when this package is, and
:func:`service.store.open_store` imports it only for an ``s3://`` store: an API on a local
store starts without it.

One backend, one concern a module, each with the NOTE blocks that map it:

- :mod:`~service.store.s3.client`: this process's boto3 clients, how they sign object bytes
  (NOTE [ What checks the bytes of a part ]), the clients made before a fork, and the bucket
  with its keys;
- :mod:`~service.store.s3.transfers`: multipart uploads, ranged downloads into a file
  (NOTE [ Downloading into the cache ]), server-side copies;
- :mod:`~service.store.s3.store`: :class:`S3Store` and its writer (NOTE [ Atomic commit on
  S3 ]), reads, presigned URLs, direct uploads and imports;
- :mod:`~service.store.s3.collection`: the writes recorded in Redis, the deletion markers
  and the removal of what nothing uses (NOTE [ Collecting an S3 store ]).
"""

from service.store.s3.client import parse_s3_url, warm_up
from service.store.s3.collection import DELETE_MARKER_TTL_S
from service.store.s3.store import S3Store

__all__ = ["DELETE_MARKER_TTL_S", "S3Store", "parse_s3_url", "warm_up"]
