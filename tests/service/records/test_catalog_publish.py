"""The inspector's catalog in Redis (workers/processes/inspector.py ``publish``): written
when it is another or gone, only renewed when it is the one already there, on a real Redis."""

from __future__ import annotations

from service.records import keys
from service.records.connection import redis_client
from workers.processes.inspector import ALIVE_TTL_S, publish

CATALOG = '[{"name": "resnet"}]'


def test_the_catalog_is_written_once_and_renewed_after(redis_url: str) -> None:
    client = redis_client(redis_url)
    assert publish(client, CATALOG)  # none there: written
    assert client.get(keys.ARCHITECTURES) in (CATALOG, CATALOG.encode())
    assert client.get(keys.INSPECTORS_ALIVE) is not None
    # The same catalog again: renewed, not rewritten (what is stored stays as it was, its
    # expiry is renewed).
    client.expire(keys.ARCHITECTURES, 3)
    assert not publish(client, CATALOG)
    assert client.ttl(keys.ARCHITECTURES) > 3
    assert 0 < client.ttl(keys.ARCHITECTURES) <= ALIVE_TTL_S
    # Another inspector's catalog (another digest): written.
    other = '[{"name": "resnet"}, {"name": "mlp"}]'
    assert publish(client, other)
    assert client.get(keys.ARCHITECTURES) in (other, other.encode())
    # Gone (expired or flushed) with its digest still there: written again.
    client.delete(keys.ARCHITECTURES)
    assert publish(client, other)
    assert client.get(keys.ARCHITECTURES) in (other, other.encode())
