"""The API's side of model inspection: ask a worker's inspector, wait for its answer.

See api_schemas/inspection.py for why the API cannot answer these questions itself.
"""

from __future__ import annotations

import secrets
import time
from typing import Final

import redis
import redis.asyncio
from pydantic import TypeAdapter

from api_schemas.inspection import InspectFailure, InspectRequest, InspectSuccess
from service.api.problems import ApiError
from service.records import keys
from service.records.connection import REDIS_BLOCK_SLICE_S

__all__ = ["inspect_model", "published_catalog"]

_REPLY: Final[TypeAdapter[InspectSuccess | InspectFailure]] = TypeAdapter(
    InspectSuccess | InspectFailure
)

NO_WORKER: Final = (
    "no worker is running to build models; start one with `bnadapt worker` "
    "(or `bnadapt up` on one machine) and retry"
)


def new_request_id() -> str:
    return secrets.token_urlsafe(12)


async def inspect_model(
    client: redis.asyncio.Redis, request: InspectRequest, timeout_s: float
) -> InspectSuccess:
    """Sends ``request`` to an inspector and waits for the reply on the event loop, holding no
    thread of the request path however long the inspector takes (a registration waits for
    it up to ``timeout_s``; many waiting at once must not stall the sync routes). Raises
    ``ApiError`` with the inspector's status (404, 422) for a wrong request and 503 when no
    worker answers."""
    if not await client.exists(keys.INSPECTORS_ALIVE):
        raise ApiError(503, NO_WORKER, headers={"Retry-After": "5"})
    reply_key = keys.inspect_reply(request.request_id)
    # At the tail: inspectors pop the head, so requests are served first in, first out.
    await client.rpush(keys.INSPECT_REQUESTS, request.model_dump_json())
    deadline = time.monotonic() + timeout_s
    popped = None
    while popped is None and (left := deadline - time.monotonic()) > 0:
        popped = await client.blpop([reply_key], timeout=min(left, REDIS_BLOCK_SLICE_S))
    if popped is None:
        # Nobody took it (or took too long): make sure no inspector takes it later.
        await client.lrem(keys.INSPECT_REQUESTS, 1, request.model_dump_json())
        raise ApiError(
            503,
            f"no worker answered within {timeout_s:g} s; they may all be busy or stopped: "
            f"{NO_WORKER}",
            headers={"Retry-After": "10"},
        )
    reply = _REPLY.validate_json(popped[1])
    if isinstance(reply, InspectFailure):
        raise ApiError(reply.status, reply.detail, errors=reply.errors)
    return reply


def published_catalog(client: redis.Redis) -> bytes:
    """The catalog as the inspector published it: a JSON list of ``ArchitecturePublic``,
    about 1 MB with the zoo installed (some 1,450 architectures), so the API passes it on
    without parsing it again. Raises 503 when no worker runs."""
    raw = client.get(keys.ARCHITECTURES)
    if raw is None:
        raise ApiError(503, NO_WORKER, headers={"Retry-After": "5"})
    return raw.encode() if isinstance(raw, str) else bytes(raw)
