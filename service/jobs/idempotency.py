"""The ``Idempotency-Key`` of ``POST /v1/jobs``: a repeated request answers the job the first
one made (NOTE [ Idempotency lease ])."""

from __future__ import annotations

import hashlib
import json
from typing import Final

from api_schemas import JobPublic
from api_schemas.jobs.kinds import AnyJobCreate
from service.errors import ConflictError, InvalidRequestError
from service.records.sync import Records

__all__ = ["IDEMPOTENCY_TTL_S", "body_sha256", "existing_for_key"]

# How long a key answers the job it made.
IDEMPOTENCY_TTL_S: Final = 24 * 3600

# NOTE [ Idempotency lease ]
# A request with an Idempotency-Key first reserves the key for its new job id with a short
# lease (``idempotency_lease_s``, SET NX), then writes the job, its queue entry and the key's
# 24-hour binding in one MULTI. A retry during the lease answers 409 "retry shortly"; a retry
# after it finds the 24-hour binding and answers the job. If the API process dies between the
# two steps, the lease expires and a retry makes the job anew: a crashed request never blocks
# its key for longer than the lease (it used to block it for the whole 24 hours). The lease
# outlasts the second step by far (a few Redis round trips).


def body_sha256(request: AnyJobCreate) -> str:
    """The digest a key is bound to with its job: the parsed request, so that two bodies
    that differ only in spelling (key order, spaces, defaults left out) are the same request.
    Its keys sorted, so that the order the classes declare their fields in (a field moved to
    a base class comes first) leaves the digest of a request as it was."""
    canonical = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def existing_for_key(
    records: Records, tenant: str, key: str, body_sha256: str, job_id: str, lease_s: float
) -> JobPublic | None:
    """The job an earlier request with this Idempotency-Key made, or None if this is the first
    request with it (the key is then leased to ``job_id``: NOTE [ Idempotency lease ])."""
    bound_body, bound_job = records.remember_idempotency(tenant, key, body_sha256, job_id, lease_s)
    if bound_body != body_sha256:
        raise InvalidRequestError(
            f"Idempotency-Key {key!r} was already used with a different request body; use a "
            "new key for a different job",
        )
    if bound_job == job_id:
        return None
    job = records.get_job(tenant, bound_job)
    if job is None:
        raise ConflictError(
            f"a request with Idempotency-Key {key!r} is still being processed; retry in "
            f"{lease_s:g} s at most (a request that crashed gives up the key by then)",
            retry_after_s=max(1, round(lease_s)),
        )
    return job
