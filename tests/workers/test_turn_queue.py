"""The RQ worker's side of fair turns (NOTE [ Fair turns ] in service/records/tenancy/turns.py): its
dequeue and its maintenance, on a real Redis-compatible server with RQ's own worker class."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from rq import Queue
from rq.exceptions import DequeueTimeout

from service.records.connection import redis_client
from service.records.job_life.queue import enqueue_run
from service.records.sync import Records
from service.records.tenancy.turns import turn_queue_name
from workers.processes.rq_worker import TurnQueue, _Worker

BASE = "turn-worker-tests"


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis_client(redis_url)


def queue(client: redis.Redis, tenant: str, rq_id: str) -> None:
    payload = {"job_id": rq_id, "tenant_id": tenant, "priority": 0}
    enqueue_run(Queue(BASE, connection=client, serializer="json"), payload, rq_id, 60, rq_id)


def dequeue(client: redis.Redis, timeout: int | None) -> tuple[str, str] | None:
    found = TurnQueue.dequeue_any(
        [TurnQueue(BASE, connection=client, serializer="json")],
        timeout,
        connection=client,
        serializer="json",
    )
    return None if found is None else (found[0].id, found[1].name)


def test_the_dequeue_takes_turns_and_names_the_tenants_queue(client: redis.Redis) -> None:
    for i in range(3):
        queue(client, "tn_a", f"a{i}")
    queue(client, "tn_b", "b0")
    taken = [dequeue(client, None) for _ in range(4)]
    assert taken == [
        ("a0", turn_queue_name(BASE, "tn_a", 0)),
        ("b0", turn_queue_name(BASE, "tn_b", 0)),
        ("a1", turn_queue_name(BASE, "tn_a", 0)),
        ("a2", turn_queue_name(BASE, "tn_a", 0)),
    ]
    assert dequeue(client, None) is None  # burst: nothing waits
    with pytest.raises(DequeueTimeout):
        dequeue(client, 1)


def test_an_idle_worker_wakes_when_a_job_is_queued(client: redis.Redis) -> None:
    later = threading.Timer(0.3, queue, args=(client, "tn_a", "late"))
    later.start()
    try:
        assert dequeue(client, 30) == ("late", turn_queue_name(BASE, "tn_a", 0))
    finally:
        later.cancel()


def test_maintenance_cleans_the_registries_of_the_tenants_queues(client: redis.Redis) -> None:
    queue(client, "tn_a", "a0")
    own = turn_queue_name(BASE, "tn_a", 0)
    # An entry whose expiry passed long ago, as RQ leaves a finished job's.
    client.zadd(f"rq:finished:{own}", {"long-gone": time.time() - 3600})
    worker = _Worker(
        [TurnQueue(BASE, connection=client, serializer="json")],
        connection=client,
        serializer="json",
        queue_class=TurnQueue,
        records=Records(client),
    )
    worker.clean_registries()
    assert client.zcard(f"rq:finished:{own}") == 0
    assert [queue.name for queue in worker.queues] == [BASE]
