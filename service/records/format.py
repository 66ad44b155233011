"""How records lie in Redis and read back, shared by the sync and async record clients.

Pure functions: nothing here talks to Redis. See :mod:`service.records.sync` for the layout.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ValidationError

from api_schemas import JobAttempt, JobPublic, JobResultLinks, JobStatus, Progress
from service.errors import InvalidPageTokenError

__all__ = [
    "API_KEY_FIELDS",
    "API_KEY_PREFIX",
    "RESOURCE_FIELDS",
    "decode_token",
    "encode_token",
    "hash_secret",
    "index_member",
    "job_from_fields",
    "owned_resource",
    "split_api_key",
    "text",
    "verify_api_key",
]

R = TypeVar("R", bound=BaseModel)

API_KEY_PREFIX: Final = "bna"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def index_member(created_at: datetime, resource_id: str) -> str:
    # Zero-padded microseconds sort as strings in time order; the id breaks ties.
    return f"{int(created_at.timestamp() * 1_000_000):017d}:{resource_id}"


def encode_token(member: str) -> str:
    return base64.urlsafe_b64encode(member.encode()).decode().rstrip("=")


def decode_token(token: str) -> str:
    try:
        member = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except ValueError as exc:
        # binascii.Error and UnicodeDecodeError are ValueErrors, and so is what base64 raises
        # for a token with non-ASCII characters (`page_token=%C3%A9`).
        raise InvalidPageTokenError(
            "page_token is not one this service issued; pass the next_page_token of the "
            "previous page, or none for the first page"
        ) from exc
    if ":" not in member:
        raise InvalidPageTokenError(
            "page_token is not one this service issued; pass the next_page_token of the "
            "previous page, or none for the first page"
        )
    return member


API_KEY_FIELDS: Final = ["tenant_id", "secret_sha256"]


def split_api_key(presented: str) -> tuple[str, str] | None:
    """``bna_<key id>_<secret>`` as (key id, secret), or None for anything else."""
    parts = presented.split("_", 2)
    if len(parts) != 3 or parts[0] != API_KEY_PREFIX or not parts[1].isalnum():
        return None
    return parts[1], parts[2]


def verify_api_key(secret: str, stored: list[bytes | None]) -> str | None:
    """The tenant of a key whose stored :data:`API_KEY_FIELDS` are ``stored``, if ``secret``
    is its secret. Compared in constant time; the key id only selected which hash to read."""
    tenant_id, expected = stored
    if tenant_id is None or expected is None:
        return None
    if not hmac.compare_digest(hash_secret(secret).encode(), expected):
        return None
    return tenant_id.decode()


def job_from_fields(
    tenant_id: str, raw: Mapping[bytes, bytes], progress: bytes | None
) -> JobPublic | None:
    """The job from its record hash and progress value, or None if missing or another
    tenant's."""
    if not raw:
        return None
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    if fields["tenant_id"] != tenant_id:
        return None
    job = JobPublic.model_validate_json(fields["data"])
    update: dict[str, Any] = {"status": JobStatus(fields["status"])}
    for name in ("started_at", "finished_at"):
        if fields.get(name):
            update[name] = datetime.fromisoformat(fields[name])
    if fields.get("error"):
        update["error"] = fields["error"]
    if fields.get("result"):
        update["result"] = JobResultLinks.model_validate_json(fields["result"])
    if fields.get("attempts"):
        update["attempts"] = [JobAttempt.model_validate(a) for a in json.loads(fields["attempts"])]
    if progress is not None:
        try:
            update["progress"] = Progress.model_validate_json(progress)
        except ValidationError:
            update["progress"] = None  # a half-upgraded worker; progress is best effort
    return job.model_copy(update=update)


RESOURCE_FIELDS: Final = ["tenant_id", "data"]


def owned_resource(tenant_id: str, stored: list[bytes | None], schema: type[R]) -> R | None:
    """The resource from its :data:`RESOURCE_FIELDS`, or None if missing or another
    tenant's."""
    owner, data = stored
    if owner is None or data is None or owner.decode() != tenant_id:
        return None
    return schema.model_validate_json(data)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
