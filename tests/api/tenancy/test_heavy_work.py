"""Long copies and hashes off the request path (NOTE [ Heavy work off the request path ] in
service/api/offload.py): completions of resumable uploads, more of them at once than the
request path has threads, leave ``/healthz`` and the other sync routes answering; and the
threads taken in turns by tenant (NOTE [ Heavy work in turns ]): one tenant's completions
hold its share of them, and another tenant's registration runs before the ones it queued.

The completions are held in place for real: once they have joined their parts, registering the
dataset writes to Redis, and the test pauses Redis' writes (``CLIENT PAUSE WRITE``) so that
every completion that got that far stays there until the test lets it go. Nothing is timed:
``/healthz`` must answer while all of them are still held (before any completes)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis

from harness.inprocess import InProcessApi, running_api
from harness.servers import wait_for
from harness.stack import npz_bytes
from service.api.offload import HeavyWork
from service.local.embedded import free_port
from service.records.connection import redis_client
from service.settings import Settings

# Starlette runs sync routes in anyio's default pool of 40 threads: more completions than that
# held at once would take all of it if they ran there.
REQUEST_PATH_THREADS = 40
COMPLETIONS = REQUEST_PATH_THREADS + 5
COPY_THREADS = 2
TENANT_THREADS = 1  # a tenant's share of them: half, rounded up (the default)
HELD_MS = 120_000  # the pause's own end, should the test fail before it unpauses
WAIT_S = 60.0


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessApi]:
    # More open uploads and requests at once than a tenant's default quotas allow: no limits.
    with running_api(
        tmp_path_factory.mktemp("heavy"),
        api_copy_threads=COPY_THREADS,
        tenant_max_open_uploads=0,
        tenant_rate_per_s=0,
    ) as api:
        yield api


def dataset_file(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(64, 1, 8, 8), dtype=np.uint8)
    return npz_bytes(x=x, y=rng.integers(0, 10, size=64).astype(np.int64))


def started_upload(client: httpx.Client, content: bytes) -> str:
    """An upload of ``content`` in two parts, ready to complete; its id."""
    created = client.post("/v1/uploads", json={"size_bytes": len(content)})
    assert created.status_code == 201, created.text
    upload_id: str = created.json()["id"]
    half = len(content) // 2
    for number, part in ((1, content[:half]), (2, content[half:])):
        sent = client.put(f"/v1/uploads/{upload_id}/parts/{number}", content=part)
        assert sent.status_code == 200, sent.text
    return upload_id


def joined(api: InProcessApi, content: bytes) -> bool:
    """Whether a completion has joined ``content``'s parts into its object in the store."""
    sha256 = hashlib.sha256(content).hexdigest()
    return (api.settings.store_path / "objects" / sha256[:2] / sha256).exists()


@pytest.mark.slow  # a load of completions
def test_completions_beyond_the_request_pool_leave_healthz_answering(api: InProcessApi) -> None:
    client = api.client("heavy").http
    files = [dataset_file(seed) for seed in range(COMPLETIONS)]
    uploads = [started_upload(client, content) for content in files]
    control: redis.Redis = redis_client(api.redis.url)
    probe = httpx.Client(base_url=api.url, timeout=WAIT_S)
    with ThreadPoolExecutor(COMPLETIONS) as pool:
        control.execute_command("CLIENT", "PAUSE", HELD_MS, "WRITE")
        try:
            completions: list[Future[httpx.Response]] = [
                pool.submit(
                    lambda upload_id: httpx.post(
                        f"{api.url}/v1/uploads/{upload_id}:complete",
                        headers=client.headers,
                        json={},
                        timeout=HELD_MS / 1000,
                    ),
                    upload_id,
                )
                for upload_id in uploads
            ]
            # The heavy work is under way: files are joined, their registration held; as
            # many as the tenant's share of the threads, the others waiting for its turns.
            wait_for(
                lambda: sum(joined(api, content) for content in files) >= TENANT_THREADS,
                WAIT_S,
                what="completions to join their parts",
            )
            assert sum(joined(api, content) for content in files) == TENANT_THREADS
            health = probe.get("/healthz")
            page = client.get(f"/v1/uploads/{uploads[0]}")  # a sync route that reads Redis
            assert health.status_code == 200, health.text
            assert page.status_code == 200, page.text
            assert not any(done.done() for done in completions)
        finally:
            control.execute_command("CLIENT", "UNPAUSE")
        answers = [done.result() for done in completions]
    assert [answer.status_code for answer in answers] == [201] * COMPLETIONS
    assert {answer.json()["sha256"] for answer in answers} == {
        hashlib.sha256(content).hexdigest() for content in files
    }
    probe.close()
    control.close()


def test_another_tenant_s_registration_runs_before_the_completions_a_tenant_queued(
    api: InProcessApi,
) -> None:
    """NOTE [ Heavy work in turns ]: tenant A completes more uploads at once than there are
    threads; tenant B's small dataset, completed after them, takes a thread before any of A's
    waiting completions does. Held as in the test above: Redis' writes paused, so the work
    that got a thread stays in it once it has joined its parts. First come, B's completion
    would wait behind all of A's."""
    flood, small = api.client("turns-flood").http, api.client("turns-small").http
    files = [dataset_file(seed) for seed in range(200, 200 + COPY_THREADS + 3)]
    uploads = [started_upload(flood, content) for content in files]
    mine = dataset_file(300)
    my_upload = started_upload(small, mine)
    control: redis.Redis = redis_client(api.redis.url)

    def complete(client: httpx.Client, upload_id: str) -> httpx.Response:
        return httpx.post(
            f"{api.url}/v1/uploads/{upload_id}:complete",
            headers=client.headers,
            json={},
            timeout=HELD_MS / 1000,
        )

    with ThreadPoolExecutor(len(files) + 1) as pool:
        control.execute_command("CLIENT", "PAUSE", HELD_MS, "WRITE")
        try:
            completions = [pool.submit(complete, flood, upload_id) for upload_id in uploads]
            wait_for(
                lambda: sum(joined(api, content) for content in files) >= TENANT_THREADS,
                WAIT_S,
                what="A's completions to join their parts",
            )
            registration = pool.submit(complete, small, my_upload)
            # B's parts are joined (its completion took a thread) while A's others still wait.
            wait_for(lambda: joined(api, mine), WAIT_S, what="B's completion to join its parts")
            assert sum(joined(api, content) for content in files) == TENANT_THREADS
            assert not registration.done()  # its registration is held at its write
        finally:
            control.execute_command("CLIENT", "UNPAUSE")
        answers = [done.result() for done in completions]
        mine_answer = registration.result()
    assert mine_answer.status_code == 201, mine_answer.text
    assert mine_answer.json()["sha256"] == hashlib.sha256(mine).hexdigest()
    assert [answer.status_code for answer in answers] == [201] * len(files)
    control.close()


def test_registrations_waiting_for_the_inspector_leave_the_sync_routes_answering(
    api: InProcessApi,
) -> None:
    """A registration waits for a worker's inspector (up to BNADAPT_INSPECT_TIMEOUT_S): more
    of them waiting than the request path has threads must not take it. Here Redis' writes
    are paused, so each registration waits at its request to the inspector; a sync route
    that reads Redis must still answer while all of them wait."""
    client = api.client("inspector-waits").http
    assert client.get("/v1/models").status_code == 200  # the tenant is known
    created = client.post("/v1/datasets", files={"file": ("d.npz", dataset_file(0))})
    assert created.status_code == 201, created.text  # its stored bytes are counted
    control: redis.Redis = redis_client(api.redis.url)

    def held_requests() -> int:
        """Registrations whose request to the inspector the pause holds."""
        return sum(
            1
            for client in control.client_list()
            if client.get("cmd") == "rpush" and "b" in client.get("flags", "")
        )

    meta = '{"architecture": "digits_cnn", "kwargs": {"width": 4}}'
    with ThreadPoolExecutor(COMPLETIONS) as pool:
        control.execute_command("CLIENT", "PAUSE", HELD_MS, "WRITE")
        try:
            registrations: list[Future[httpx.Response]] = [
                pool.submit(
                    lambda: httpx.post(
                        f"{api.url}/v1/models",
                        headers=client.headers,
                        data={"meta": meta},
                        timeout=HELD_MS / 1000,
                    )
                )
                for _ in range(COMPLETIONS)
            ]
            # As many waiting as the request path has threads (all of them, where the
            # wait held one).
            wait_for(
                lambda: held_requests() >= REQUEST_PATH_THREADS,
                WAIT_S,
                what="the registrations to wait on Redis",
            )
            page = client.get("/v1/models", timeout=WAIT_S)  # a sync route that reads Redis
            assert page.status_code == 200, page.text
            assert not any(done.done() for done in registrations)
        finally:
            control.execute_command("CLIENT", "UNPAUSE")
        answers = [done.result() for done in registrations]
    assert [answer.status_code for answer in answers] == [201] * COMPLETIONS
    control.close()


def _thread_nice(task: Path) -> int | None:
    """The nice value of one of this process's threads (/proc/self/task/<tid>), None if it
    ended meanwhile."""
    try:
        return int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
    except (OSError, IndexError, ValueError):
        return None


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")
def test_an_upload_s_bytes_are_hashed_below_the_requests_priority(api: InProcessApi) -> None:
    """NOTE [ Bytes at a lower priority ]: the in-process API's threads that hashed an upload's
    pieces and joined its parts run at BNADAPT_API_COPY_NICE below this process."""
    lowered = os.nice(0) + api.settings.api_copy_nice
    assert api.settings.api_copy_nice > 0  # the default lowers them
    client = api.client("priority").http
    upload_id = started_upload(client, dataset_file(7))
    done = client.post(f"/v1/uploads/{upload_id}:complete", json={})
    assert done.status_code == 201, done.text
    nices = [_thread_nice(task) for task in Path("/proc/self/task").iterdir()]
    # The pieces' threads and the joining one: at least those, and never the request path.
    assert nices.count(min(lowered, 19)) >= 2, nices
    assert _thread_nice(Path(f"/proc/self/task/{threading.get_native_id()}")) == os.nice(0)


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")
def test_heavy_work_and_pieces_run_at_the_lowered_priority() -> None:
    async def nices() -> tuple[int, int]:
        heavy = HeavyWork(1, 7)
        try:
            return await heavy.run(_own_nice), await heavy.piece(_own_nice)
        finally:
            heavy.close()

    base = os.nice(0)
    assert asyncio.run(nices()) == (min(base + 7, 19), min(base + 7, 19))
    assert _own_nice() == base  # the caller's thread kept its own


def test_a_piece_never_waits_behind_long_work() -> None:
    """The pieces of streamed uploads keep flowing while every thread for long work is held."""
    release = threading.Event()

    async def scenario() -> str:
        heavy = HeavyWork(1)
        try:
            long = asyncio.ensure_future(heavy.run(release.wait, WAIT_S))
            piece = await asyncio.wait_for(heavy.piece(lambda: "piece"), WAIT_S)
            assert not long.done()
            release.set()
            assert await long
            return piece
        finally:
            release.set()
            heavy.close()

    assert asyncio.run(scenario()) == "piece"


def test_a_canceled_request_waits_for_its_work_to_end() -> None:
    """A request canceled (its client gone) while its work runs waits for that work before it
    goes on to close what the work uses: no store writer is closed under a running write."""
    started, release = threading.Event(), threading.Event()
    ended: list[str] = []

    def work() -> None:
        started.set()
        release.wait(WAIT_S)
        ended.append("work")

    async def scenario() -> None:
        heavy = HeavyWork(1)
        try:
            task = asyncio.ensure_future(heavy.run(work))
            await asyncio.to_thread(started.wait, WAIT_S)
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done()  # still waiting for the work
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert ended == ["work"]
        finally:
            release.set()
            heavy.close()

    asyncio.run(scenario())


class _Gate:
    """Work that records its start under a name and, if held, waits for :meth:`open`."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._open = threading.Event()
        self._lock = threading.Lock()

    def work(self, name: str, held: bool = False) -> str:
        with self._lock:
            self.started.append(name)
        if held:
            assert self._open.wait(WAIT_S)
        return name

    def open(self) -> None:
        self._open.set()


async def _until(predicate: Callable[[], bool]) -> None:
    """Yields to the event loop and the threads until ``predicate`` holds."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "the work did not start"
        await asyncio.sleep(0.005)


def test_waiting_work_takes_turns_by_tenant_not_first_come() -> None:
    """One thread: A's first work holds it, A queues three more, then B one. B's is served
    next, then A's in their order."""
    gate = _Gate()

    async def scenario() -> list[str]:
        heavy = HeavyWork(1)
        a, b = heavy.for_tenant("a"), heavy.for_tenant("b")
        try:
            first = asyncio.ensure_future(a.run(gate.work, "a0", True))
            await _until(lambda: gate.started == ["a0"])
            queued = [asyncio.ensure_future(a.run(gate.work, f"a{i}")) for i in (1, 2, 3)]
            await asyncio.sleep(0)  # A's wait for their turns before B's
            queued.append(asyncio.ensure_future(b.run(gate.work, "b0")))
            await asyncio.sleep(0.05)
            assert gate.started == ["a0"]
            gate.open()
            await asyncio.gather(first, *queued)
            return gate.started
        finally:
            gate.open()
            heavy.close()

    assert asyncio.run(scenario()) == ["a0", "b0", "a1", "a2", "a3"]


def test_one_tenant_holds_at_most_its_share_of_the_threads() -> None:
    """Two threads, a share of one: A's second work waits for its first with a thread free,
    which B's work takes. A share of two lets A take both."""
    gate = _Gate()

    async def scenario(tenant_threads: int | None) -> list[str]:
        heavy = HeavyWork(2, tenant_threads=tenant_threads)
        a, b = heavy.for_tenant("a"), heavy.for_tenant("b")
        try:
            works = [asyncio.ensure_future(a.run(gate.work, f"a{i}", True)) for i in (0, 1)]
            await _until(lambda: len(gate.started) >= 1)
            works.append(asyncio.ensure_future(b.run(gate.work, "b0", True)))
            await _until(lambda: len(gate.started) >= 2)
            await asyncio.sleep(0.05)
            seen = list(gate.started)
            gate.open()
            await asyncio.gather(*works)
            return seen
        finally:
            gate.open()
            heavy.close()

    assert asyncio.run(scenario(None)) == ["a0", "b0"]
    gate = _Gate()
    assert asyncio.run(scenario(2)) == ["a0", "a1"]


def test_work_canceled_while_it_waits_is_dropped_and_the_next_tenant_served() -> None:
    gate = _Gate()

    async def scenario() -> list[str]:
        heavy = HeavyWork(1)
        try:
            first = asyncio.ensure_future(heavy.for_tenant("a").run(gate.work, "a0", True))
            await _until(lambda: gate.started == ["a0"])
            dropped = asyncio.ensure_future(heavy.for_tenant("b").run(gate.work, "b0"))
            served = asyncio.ensure_future(heavy.for_tenant("c").run(gate.work, "c0"))
            await asyncio.sleep(0.01)
            dropped.cancel()
            gate.open()
            assert await served == "c0"
            await first
            with pytest.raises(asyncio.CancelledError):
                await dropped
            return gate.started
        finally:
            gate.open()
            heavy.close()

    assert asyncio.run(scenario()) == ["a0", "c0"]


def test_pieces_take_turns_by_tenant_with_no_share() -> None:
    """The pieces' two threads: a lone tenant takes both, and B's piece goes before the ones
    A queued behind them."""
    gate = _Gate()

    async def scenario() -> list[str]:
        heavy = HeavyWork(1)
        a, b = heavy.for_tenant("a"), heavy.for_tenant("b")
        try:
            held = [asyncio.ensure_future(a.piece(gate.work, f"a{i}", True)) for i in (0, 1)]
            await _until(lambda: len(gate.started) == 2)
            queued = [asyncio.ensure_future(a.piece(gate.work, f"a{i}")) for i in (2, 3)]
            await asyncio.sleep(0)
            queued.append(asyncio.ensure_future(b.piece(gate.work, "b0")))
            await asyncio.sleep(0.05)
            gate.open()
            await asyncio.gather(*held, *queued)
            return gate.started
        finally:
            gate.open()
            heavy.close()

    assert asyncio.run(scenario())[2] == "b0"


def test_heavy_work_refuses_a_tenant_share_beyond_the_threads() -> None:
    with pytest.raises(ValueError, match="BNADAPT_API_COPY_TENANT_THREADS"):
        HeavyWork(2, tenant_threads=3)


def test_heavy_work_refuses_a_priority_out_of_range() -> None:
    with pytest.raises(ValueError, match="BNADAPT_API_COPY_NICE"):
        HeavyWork(1, 20)


@pytest.mark.slow  # an API process of its own for the bytes
def test_uploads_name_the_api_for_their_bytes_and_the_client_sends_them_there(
    tmp_path: Path,
) -> None:
    """With ``BNADAPT_UPLOADS_URL`` (NOTE [ Upload bytes in processes of their own ]) every
    upload names it in ``transfer_url`` and the Python client sends the parts there: here
    nothing listens, so the upload fails to connect, having sent this API no part. A client
    that sends the parts to this API anyway is still served."""
    elsewhere = f"http://127.0.0.1:{free_port()}"
    with running_api(tmp_path / "api", uploads_url=elsewhere, tenant_rate_per_s=0) as here:
        client = here.client("transfers")
        path = tmp_path / "data.npz"
        path.write_bytes(dataset_file(0))
        with pytest.raises(httpx.ConnectError):
            client.api.upload_dataset(path, retries=0)
        upload_id = client.api.last_upload_id
        upload = client.http.get(f"/v1/uploads/{upload_id}").json()
        assert upload["transfer_url"] == elsewhere
        assert upload["parts"] == []
        sent = client.http.put(f"/v1/uploads/{upload_id}/parts/1", content=path.read_bytes())
        assert sent.status_code == 200, sent.text
        done = client.http.post(f"/v1/uploads/{upload_id}:complete", json={})
        assert done.status_code == 201, done.text
    with pytest.raises(ValueError, match="uploads_url"):
        Settings(uploads_url="ftp://elsewhere/")
