"""Fair turns between tenants, priorities and the inspector's order on the running stack: a
real Redis-compatible server, the API under uvicorn and one worker (one job slot). Orders are
read from the job records' start times, never from the test's own clock."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from api_schemas.inspection import InspectRequest
from harness.answers import created
from harness.digits import digits_npz
from harness.servers import wait_for
from harness.stack import Client, Stack, running_stack
from service.records import keys

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("stack")) as stack:
        yield stack


def small_job(client: Client) -> dict[str, Any]:
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=32)))
    return {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}


def submit(client: Client, body: dict[str, Any], priority: int | None = None) -> str:
    extra = {} if priority is None else {"priority": priority}
    return str(created(client.submit({**body, **extra, "max_attempts": 1}), 202)["id"])


def ended(client: Client, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    jobs = {job_id: client.wait(job_id, timeout_s=300) for job_id in job_ids}
    for job in jobs.values():
        assert job["status"] == "succeeded", job
    return jobs


def at(job: dict[str, Any], field: str) -> datetime:
    return datetime.fromisoformat(job[field])


def test_one_job_behind_anothers_many_starts_within_one_job_slot(stack: Stack) -> None:
    a, b = stack.client("turns-a"), stack.client("turns-b")
    a_body, b_body = small_job(a), small_job(b)
    a_ids = [submit(a, a_body) for _ in range(8)]
    b_id = submit(b, b_body)
    a_jobs = ended(a, a_ids)
    b_job = ended(b, [b_id])[b_id]
    created_b, started_b = at(b_job, "created_at"), at(b_job, "started_at")
    after_b = [j for j in a_jobs.values() if at(j, "started_at") > created_b]
    # A's backlog was there when B submitted: otherwise this would show nothing.
    assert len(after_b) >= 3, [j["started_at"] for j in a_jobs.values()]
    # Of A's jobs still waiting when B's was queued, at most the one whose turn came first
    # started before it; first in, first out, all of them would have.
    ahead = [j["id"] for j in after_b if at(j, "started_at") < started_b]
    assert len(ahead) <= 1, ahead


def test_priority_orders_a_tenants_own_jobs_and_never_jumps_turns(stack: Stack) -> None:
    c, d = stack.client("turns-c"), stack.client("turns-d")
    c_body, d_body = small_job(c), small_job(d)
    stack.stop_worker()  # everything below is queued before a worker takes any of it
    try:
        first, second = submit(c, c_body), submit(c, c_body)
        urgent, low = submit(c, c_body, priority=5), submit(c, c_body, priority=-1)
        d_ids = [submit(d, d_body, priority=10) for _ in range(3)]
        listed = c.http.get(f"/v1/jobs/{urgent}").json()
        assert listed["priority"] == 5
    finally:
        stack.start_worker()
    c_jobs = ended(c, [first, second, urgent, low])
    d_jobs = ended(d, d_ids)
    by_start = sorted(c_jobs, key=lambda job_id: at(c_jobs[job_id], "started_at"))
    assert by_start == [urgent, first, second, low]
    # D's priority 10 orders D's own jobs only: the tenants took turns.
    both = {**{k: "c" for k in c_jobs}, **{k: "d" for k in d_jobs}}
    jobs = {**c_jobs, **d_jobs}
    order = "".join(both[k] for k in sorted(jobs, key=lambda k: at(jobs[k], "started_at")))
    assert order in ("cdcdcdc", "dcdcdcc"), order


def test_inspector_requests_are_served_first_in_first_out(stack: Stack) -> None:
    """Model registrations wait for a busy inspector in the order they came: the one the
    inspector pops next (the head of the list) is the oldest."""
    client = stack.client("turns-inspect")
    redis = stack.records().client
    # One tenant's requests wait in its own list (NOTE [ Inspection turns ]).
    waiting_list = keys.inspect_requests(stack.records().create_api_key("turns-inspect").tenant_id)
    stack.stop_worker()
    answers: list[Any] = []
    threads = []
    try:
        # The inspector is stopped, as one busy with a long request would look to the API.
        redis.set(keys.INSPECTORS_ALIVE, "1", ex=60)
        for seed in range(3):
            thread = threading.Thread(
                target=lambda s=seed: answers.append(client.add_model("digits_cnn", seed=s))
            )
            thread.start()
            threads.append(thread)
            wait_for(
                lambda n=seed + 1: redis.llen(waiting_list) == n,
                timeout_s=30,
                what=f"request {seed + 1} to wait for the inspector",
            )
        waiting = [
            InspectRequest.model_validate_json(raw).seed
            for raw in redis.lrange(waiting_list, 0, -1)
        ]
        assert waiting == [0, 1, 2]
    finally:
        stack.start_worker()
        for thread in threads:
            thread.join(timeout=120)
    assert [r.status_code for r in answers] == [201, 201, 201], [r.text for r in answers]
