"""The S3 prefixes each tenant may import datasets from, as an operator allowed them
(``bnadapt tenants allow-import|list-imports|revoke-import``).

# NOTE [ Import sources ]
``POST /v1/datasets:import`` reads a bucket with the service's own credentials, which can
read more than any one tenant should: buckets opened for other teams, and the store itself,
where every tenant's datasets and weights lie under ``objects/<sha256>``. So a tenant imports
only from the prefixes an operator allowed it, and never from the store:
- **Allowed prefixes.** Each tenant has a set of ``s3://BUCKET/PREFIX/`` sources
  (``keys.tenant_import_sources``). A source is allowed when its bucket is one of them and
  its key starts with that prefix; a prefix always ends in ``/`` (the CLI adds it), so
  ``team-a/`` does not open ``team-ab/``, and ``s3://BUCKET/`` opens the whole bucket.
- **Keys mean what they say.** A source or prefix with a ``.``, ``..`` or empty segment, a
  backslash or a control character is refused before anything is compared
  (``api_schemas.uploads.split_s3_source``): S3 keys are plain strings, but an HTTP client or
  server may resolve ``team-a/../team-b/x`` to ``team-b/x`` after the prefix matched. A folder
  walked for images refuses such keys inside it for the same reason.
- **The store is never a source**, allowed or not: the S3 store refuses its own bucket and
  prefix itself (``S3Store.owns``).
- **One answer for "no".** Not allowed, missing, unreadable (a 403 from the bucket) and the
  store's own keys all get the same 404 and text, so a tenant cannot probe which objects
  exist outside what it was given; and no error of an import repeats bytes, member or key
  names read from the source (service/datasets/imports.py).
"""

from __future__ import annotations

from typing import Final

from api_schemas.uploads import split_s3_source
from service.records import keys
from service.records.base import RedisRecords
from service.records.format import text

__all__ = ["ImportSources", "normalize_prefix"]

# How many sources one tenant may be allowed: a set read whole on every import.
MAX_SOURCES_PER_TENANT: Final = 1000


def normalize_prefix(url: str) -> tuple[str, str]:
    """``s3://BUCKET[/PREFIX[/]]`` -> (bucket, prefix ending in ``/``, or ``""`` for the whole
    bucket); ``ValueError`` saying what to write (see :func:`split_s3_source`)."""
    bucket, key = split_s3_source(url)
    if key and not key.endswith("/"):
        key += "/"
    return bucket, key


class ImportSources(RedisRecords):
    """Each tenant's allowed import sources: allowed, listed, revoked, and matched on every
    import (NOTE [ Import sources ])."""

    def allow_import(self, tenant_id: str, prefix: str) -> str:
        """Allows the tenant to import from everything under ``prefix``; returns the source as
        stored (``s3://BUCKET/PREFIX/``). ``ValueError`` for a malformed prefix or a tenant
        that has :data:`MAX_SOURCES_PER_TENANT` already."""
        bucket, key = normalize_prefix(prefix)
        source = f"s3://{bucket}/{key}"
        name = keys.tenant_import_sources(tenant_id)
        if (
            not self.client.sismember(name, source)
            and self.client.scard(name) >= MAX_SOURCES_PER_TENANT
        ):
            raise ValueError(
                f"the tenant has {MAX_SOURCES_PER_TENANT} import sources already; revoke some, "
                "or allow a prefix that covers several"
            )
        self.client.sadd(name, source)
        return source

    def revoke_import(self, tenant_id: str, prefix: str) -> bool:
        """Removes an allowed source, written as it was allowed (normalized the same way);
        False if the tenant had no such source."""
        bucket, key = normalize_prefix(prefix)
        return bool(self.client.srem(keys.tenant_import_sources(tenant_id), f"s3://{bucket}/{key}"))

    def import_sources(self, tenant_id: str) -> list[str]:
        """The tenant's allowed sources, sorted."""
        return sorted(text(s) for s in self.client.smembers(keys.tenant_import_sources(tenant_id)))

    def may_import(self, tenant_id: str, bucket: str, key: str) -> bool:
        """Whether ``s3://bucket/key`` lies under one of the tenant's allowed sources; the key
        must already have passed :func:`split_s3_source` (the route's schema checks it)."""
        for source in self.import_sources(tenant_id):
            allowed_bucket, allowed_prefix = split_s3_source(source)
            if allowed_bucket == bucket and key.startswith(allowed_prefix):
                return True
        return False
