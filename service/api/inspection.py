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
from service.records.tenancy.turns import BELL_TOKENS_MAX

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
    client: redis.asyncio.Redis, tenant: str, request: InspectRequest, timeout_s: float
) -> InspectSuccess:
    """Sends ``tenant``'s ``request`` to an inspector, which takes it in the tenant's turn
    (NOTE [ Inspection turns ] in workers/processes/inspector.py), and waits for the reply on
    the event loop, holding no thread of the request path however long the inspector takes (a
    registration waits for it up to ``timeout_s``; many waiting at once must not stall the
    sync routes). Raises ``ApiError`` with the inspector's status (404, 422) for a wrong
    request and 503 when no worker answers."""
    if not await client.exists(keys.INSPECTORS_ALIVE):
        raise ApiError(503, NO_WORKER, headers={"Retry-After": "5"})
    reply_key = keys.inspect_reply(request.request_id)
    queue = keys.inspect_requests(tenant)
    seconds, microseconds = await client.time()  # the clock every inspector reads too
    deadline_s = seconds + microseconds / 1e6 + timeout_s
    body = request.model_copy(update={"deadline_s": deadline_s}).model_dump_json()
    # At the tail: inspectors pop the head, first in, first out within a tenant. Pushed
    # before the tenant joins the turns: an inspector that finds the tenant's list empty
    # may drop the tenant, never leave a pushed request without it.
    await client.rpush(queue, body)
    pipe = client.pipeline(transaction=False)
    pipe.zadd(keys.INSPECT_TENANTS, {tenant: 0}, nx=True)
    pipe.lpush(keys.INSPECT_BELL, "1")
    pipe.ltrim(keys.INSPECT_BELL, 0, BELL_TOKENS_MAX - 1)
    await pipe.execute()
    deadline = time.monotonic() + timeout_s
    popped = None
    while popped is None and (left := deadline - time.monotonic()) > 0:
        popped = await client.blpop([reply_key], timeout=min(left, REDIS_BLOCK_SLICE_S))
    if popped is None:
        # Nobody took it (or took too long): make sure no inspector takes it later.
        await client.lrem(queue, 1, body)
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
