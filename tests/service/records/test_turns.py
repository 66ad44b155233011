"""Fair turns between tenants (NOTE [ Fair turns ] in service/records/tenancy/turns.py) on a real
Redis-compatible server: jobs queued as the API and the sweep queue them (``enqueue_run``),
taken as a worker takes them (``Turns.take``, what the RQ worker's dequeue runs), with no
worker running them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from rq import Queue

from service.local.cli import main
from service.records.connection import redis_client
from service.records.job_life.queue import enqueue_run
from service.records.sync import Records
from service.records.tenancy.turns import Turns, turn_queue_name

BASE = "turn-tests"
CUDA = "turn-tests-cuda"
_ids: Iterator[int] = itertools.count()


@pytest.fixture
def turns(redis_url: str) -> Turns:
    return Turns(redis_client(redis_url))


def queue(turns: Turns, tenant: str, priority: int = 0, base: str = BASE) -> str:
    """Queues one job of ``tenant``; returns its RQ id (which names the tenant)."""
    rq_id = f"{tenant}-{next(_ids)}-p{priority}"
    payload = {"job_id": rq_id, "tenant_id": tenant, "priority": priority}
    connection = turns.client
    enqueue_run(Queue(base, connection=connection, serializer="json"), payload, rq_id, 60, rq_id)
    return rq_id


def take(turns: Turns, n: int, bases: tuple[str, ...] = (BASE,)) -> list[str]:
    """The RQ ids of the next ``n`` jobs a worker of ``bases`` takes (fewer if none waits)."""
    taken = []
    for _ in range(n):
        got = turns.take(bases)
        if got is None:
            break
        taken.append(got[1])
    return taken


def tenants(rq_ids: list[str]) -> str:
    return "".join(rq_id.split("-")[0][-1] for rq_id in rq_ids)


def test_one_job_behind_a_hundred_waits_one_turn(turns: Turns) -> None:
    for _ in range(100):
        queue(turns, "tn_a")
    assert tenants(take(turns, 3)) == "aaa"  # alone, A takes every turn
    one = queue(turns, "tn_b")
    # B's job is next: A's turns came first, and B saved up none before it queued anything.
    assert take(turns, 1) == [one]
    assert tenants(take(turns, 3)) == "aaa"


def test_turns_alternate_and_a_tenant_that_was_idle_saves_up_no_credit(turns: Turns) -> None:
    for _ in range(5):
        queue(turns, "tn_a")
    assert tenants(take(turns, 5)) == "aaaaa"
    for _ in range(4):
        queue(turns, "tn_a")
        queue(turns, "tn_b")
    assert tenants(take(turns, 8)) == "babababa"
    assert take(turns, 1) == []


def test_weights_give_turns_in_proportion(turns: Turns) -> None:
    turns.set_weight("tn_a", 2)
    assert turns.weights() == {"tn_a": 2.0}
    for _ in range(12):
        queue(turns, "tn_a")
        queue(turns, "tn_b")
    order = tenants(take(turns, 9))
    assert (order.count("a"), order.count("b")) == (6, 3)
    turns.set_weight("tn_a", 1)
    assert turns.weights() == {}
    with pytest.raises(ValueError, match="weight"):
        turns.set_weight("tn_a", 0)


def test_priority_orders_a_tenants_own_jobs_first_in_first_out_within_one(turns: Turns) -> None:
    first = queue(turns, "tn_c", 0)
    second = queue(turns, "tn_c", 0)
    urgent = queue(turns, "tn_c", 5)
    low = queue(turns, "tn_c", -1)
    assert take(turns, 5) == [urgent, first, second, low]


def test_priority_never_jumps_another_tenants_turn(turns: Turns) -> None:
    for _ in range(3):
        queue(turns, "tn_b", 0)
    for _ in range(3):
        queue(turns, "tn_a", 10)
    assert tenants(take(turns, 6)) in ("ababab", "bababa")


def test_a_workers_own_device_queue_first_then_auto(turns: Turns) -> None:
    anywhere = queue(turns, "tn_a")
    on_cuda = queue(turns, "tn_b", base=CUDA)
    assert take(turns, 1, (BASE,)) == [anywhere]
    queue(turns, "tn_a")
    assert take(turns, 1, (CUDA, BASE)) == [on_cuda]


def test_jobs_an_earlier_release_queued_are_taken_first(turns: Turns) -> None:
    queue(turns, "tn_a")
    Queue(BASE, connection=turns.client, serializer="json").enqueue_call(
        "workers.running.job.run_job", args=({},), job_id="legacy"
    )
    assert take(turns, 1) == ["legacy"]


def test_jobs_put_back_by_rq_itself_are_found(turns: Turns) -> None:
    """RQ moves a sharded job's children to their queue once their dependencies end, without
    announcing them: the tenant's queue is registered already and is read all the same."""
    queue(turns, "tn_a")
    take(turns, 1)
    name = turn_queue_name(BASE, "tn_a", 0)
    Queue(name, connection=turns.client, serializer="json").enqueue_call(
        "workers.running.job.run_job", args=({},), job_id="dependent"
    )
    assert take(turns, 1) == ["dependent"]
    assert turns.queue_names(BASE) == [name]


def test_an_operator_sets_a_tenants_weight(
    turns: Turns, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tenant_id = Records(turns.client).create_api_key("heavy").tenant_id
    assert main(["tenants", "set-weight", "heavy", "3", "--redis-url", redis_url]) == 0
    assert turns.weights() == {tenant_id: 3.0}
    assert main(["tenants", "weights", "--redis-url", redis_url]) == 0
    assert capsys.readouterr().out.split() == [tenant_id, "heavy", "3"]
    assert main(["tenants", "set-weight", "nobody", "3", "--redis-url", redis_url]) == 1
    assert "no tenant named 'nobody'" in capsys.readouterr().err
    assert main(["tenants", "set-weight", "heavy", "-1", "--redis-url", redis_url]) == 1
    assert "weight is in (0, 1000]" in capsys.readouterr().err
    assert main(["tenants", "set-weight", "heavy", "1", "--redis-url", redis_url]) == 0
    assert turns.weights() == {}
