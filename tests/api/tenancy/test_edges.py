"""The API's edges (issue 27, points 2, 3 and 9): nothing read before the key is checked, a
body limit on every route, JSON depth; /metrics behind its own credential and cheap, /readyz
cheap and silent; no internals in what a tenant sees; event streams end with their key; a
deleted job's Idempotency-Key free again.

Against the API in process (harness/inprocess.py) over real sockets; the memory check runs the
API as its own process (uvicorn, as deployed)."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import numpy as np
import pytest

from harness.answers import created, problem
from harness.digits import digits_npz
from harness.inprocess import InProcessApi
from harness.servers import stop_process, wait_for
from harness.stack import REPO, Client
from service.api.edge import nesting_depth
from service.api.metrics import SNAPSHOT_KEY
from service.local.embedded import RedisServer, free_port
from service.local.up import api_command

GIB: Final = 1024**3
MIB: Final = 1024**2
_PROBE_SHA256: Final = hashlib.sha256(b"bnadapt readiness probe\n").hexdigest()


def _tiny_npz() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def client(api: InProcessApi) -> Client:
    return api.client("edges")


def _raw_request(port: int, head: bytes, body: bytes) -> tuple[socket.socket, bytes]:
    """Sends ``head`` and the start of a body on a new connection; returns the socket and the
    response's head (status line and headers), read before anything more is sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head + body)
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed without answering: {received!r}"
        received += chunk
    return sock, received


def _rest_until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a timeout fails the test: the
    server kept the connection open to read the body's rest)."""
    sock.settimeout(30)
    rest = b""
    try:
        while chunk := sock.recv(65536):
            rest += chunk
    except ConnectionResetError:
        pass
    return rest


def _huge_post(path: str, authorization: str | None = None, length: int = GIB) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {length}",
    ]
    if authorization is not None:
        lines.append(f"Authorization: {authorization}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize(
    "path", ["/v1/uploads", "/v1/jobs", "/v1/datasets:import", "/v1/models", "/v1/datasets"]
)
def test_anonymous_1gib_body_is_401_before_the_body_is_read(api: InProcessApi, path: str) -> None:
    # Before: FastAPI read (and parsed) the JSON body, then ran the key check: 422 after
    # holding the whole body.
    sock, head = _raw_request(api.port, _huge_post(path), b"{" + b" " * 1023)
    with sock:
        status_line, _, headers = head.partition(b"\r\n")
        assert status_line.split()[1] == b"401", head
        assert b"connection: close" in headers.lower()
        assert b"no API key" in head + _rest_until_closed(sock)


def test_a_wrong_key_is_401_before_the_body_too(api: InProcessApi) -> None:
    for authorization in ("Bearer bna_0123_nope", "Basic abc", "Bearer"):
        sock, head = _raw_request(api.port, _huge_post("/v1/jobs", authorization), b"{")
        with sock:
            assert head.split()[1] == b"401", head
            assert b"not valid" in head + _rest_until_closed(sock)


def test_a_known_key_with_a_body_over_the_json_limit_is_413_unread(
    api: InProcessApi, client: Client
) -> None:
    authorization = client.http.headers["Authorization"]
    sock, head = _raw_request(api.port, _huge_post("/v1/uploads", authorization), b"{")
    with sock:
        assert head.split()[1] == b"413", head
        assert b"BNADAPT_MAX_JSON_BODY_BYTES" in head + _rest_until_closed(sock)


def test_a_chunked_json_body_over_the_limit_is_413(api: InProcessApi, client: Client) -> None:
    limit = api.settings.max_json_body_bytes

    def chunks() -> Iterator[bytes]:
        yield b'{"name": "'
        for _ in range(limit // (64 * 1024) + 2):
            yield b"a" * 64 * 1024
        yield b'"}'

    response = client.http.post(
        "/v1/uploads", content=chunks(), headers={"Content-Type": "application/json"}
    )
    problem(response, 413, "BNADAPT_MAX_JSON_BODY_BYTES")


def test_json_nested_100000_deep_is_422_not_500(client: Client) -> None:
    # Before: RecursionError in the json parser, a 500.
    body = b"[" * 100_000 + b"]" * 100_000
    for path in ("/v1/jobs", "/v1/uploads", "/v1/direct-uploads"):
        response = client.http.post(
            path, content=body, headers={"Content-Type": "application/json"}
        )
        problem(response, 422, "nests 100000 levels", "BNADAPT_MAX_JSON_DEPTH")


def test_json_nesting_up_to_the_limit_passes_the_edge(api: InProcessApi, client: Client) -> None:
    depth = api.settings.max_json_depth
    deep_ok = '{"name": "deep", "x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    response = client.http.post(
        "/v1/uploads", content=deep_ok, headers={"Content-Type": "application/json"}
    )
    # The edge lets it through; the route refuses the unknown field or takes the upload.
    assert response.status_code in (201, 422), response.text
    assert "nests" not in response.text
    too_deep = '{"name": "deep", "x": ' + "[" * depth + "]" * depth + "}"
    response = client.http.post(
        "/v1/uploads", content=too_deep, headers={"Content-Type": "application/json"}
    )
    problem(response, 422, f"nests {depth + 1} levels")


def test_nesting_depth_ignores_brackets_in_strings() -> None:
    assert nesting_depth(b"1") == 0
    assert nesting_depth(b'{"a": ["[[[[", "\\"[[", {"b": []}]}') == 4
    assert nesting_depth(b"[]" * 1000) == 1
    assert nesting_depth(b"[" * 500) == 500


def test_public_routes_take_no_key_and_streaming_routes_still_stream(
    api: InProcessApi, client: Client
) -> None:
    anonymous = api.anonymous()
    assert anonymous.http.get("/healthz").status_code == 200
    assert anonymous.http.get("/openapi.json").status_code == 200
    assert anonymous.http.get("/ui/").status_code == 200
    assert anonymous.http.post("/healthz", content=b"{}").status_code == 405
    # A body without a key on a tenant route: the edge's 401, in the API's problem shape.
    problem(anonymous.http.post("/v1/uploads", json={}), 401, "no API key")
    # With a key, the streamed routes and the JSON routes work as before.
    upload = created(client.http.post("/v1/uploads", json={"name": "edge"}))
    part = client.http.put(f"/v1/uploads/{upload['id']}/parts/1", content=b"x" * 1000)
    assert part.status_code == 200, part.text


def _rss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError(f"no RssAnon for process {pid}")


@pytest.fixture
def api_process(redis_server: RedisServer, tmp_path: Path) -> Iterator[tuple[int, int]]:
    """The API as its own process (as deployed); yields (port, pid)."""
    port = free_port()
    env = {
        "BNADAPT_REDIS_URL": redis_server.url,
        "BNADAPT_DATA_DIR": str(tmp_path / "data"),
        "PYTHONPATH": str(REPO),
        "PATH": "/usr/bin:/bin",
    }
    process = subprocess.Popen(api_command("127.0.0.1", port), env=env, cwd=REPO)

    def ready() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, timeout_s=60, what="the API process to answer /healthz")
        yield port, process.pid
    finally:
        stop_process(process)


def _push(port: int, path: str, total: int) -> tuple[bytes, int]:
    """Declares a 1 GiB body and pushes up to ``total`` bytes of it, as fast as the server
    takes them; returns the response's status line and the bytes the server let in."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sent = 0
    piece = b" " * (1024 * 1024)
    with sock:
        sock.sendall(_huge_post(path))
        sock.settimeout(5)
        try:
            while sent < total:
                sent += sock.send(piece)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
        sock.settimeout(30)
        try:
            answer = sock.recv(65536)
        except ConnectionResetError:
            answer = b""
    return answer.split(b"\r\n", 1)[0], sent


def test_anonymous_bodies_do_not_grow_the_api_process(
    api_process: tuple[int, int], tmp_path: Path
) -> None:
    # Before: an anonymous 512 MiB body to POST /v1/uploads grew the API by 640 MiB.
    port, pid = api_process
    httpx.post(f"http://127.0.0.1:{port}/v1/uploads", json={})  # warm up the route
    before = _rss_anon_kib(pid)
    for path in ("/v1/uploads", "/v1/jobs", "/v1/models", "/v1/datasets"):
        status, sent = _push(port, path, 256 * MIB)
        assert sent < 256 * MIB, f"{path}: the API took the whole body ({sent} bytes)"
        assert status in (b"", b"HTTP/1.1 401 Unauthorized"), status
    time.sleep(0.5)  # let the server drop what its socket buffers held
    grown_kib = _rss_anon_kib(pid) - before
    assert grown_kib < 32 * 1024, f"the API grew by {grown_kib} KiB"
    leftovers = [p for p in (tmp_path / "data").rglob("*") if p.is_file() and "tmp" in p.parts]
    assert leftovers == []


METRICS_TOKEN: Final = "scrape-secret-0123456789"


@pytest.fixture(scope="module")
def guarded_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessApi]:
    """An API with a metrics token, and figures and readiness that stay cached for the
    module (so that what a scrape or a probe does is seen, not timed)."""
    from harness.inprocess import running_api

    data_dir = tmp_path_factory.mktemp("guarded")
    with running_api(
        data_dir, metrics_token=METRICS_TOKEN, metrics_refresh_s=3600, ready_check_s=3600
    ) as running:
        yield running


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics:\n{text[:2000]}")


def test_metrics_need_the_metrics_token(guarded_api: InProcessApi) -> None:
    tenant = guarded_api.client("scraper")
    anonymous = guarded_api.anonymous()
    # Before: anyone could scrape.
    problem(anonymous.http.get("/metrics"), 401, "BNADAPT_METRICS_TOKEN")
    problem(tenant.http.get("/metrics"), 401, "BNADAPT_METRICS_TOKEN")  # a tenant's key
    for wrong in (
        "Bearer nope",
        f"Bearer {METRICS_TOKEN}x",
        METRICS_TOKEN,
        f"Basic {METRICS_TOKEN}",
    ):
        response = anonymous.http.get("/metrics", headers={"Authorization": wrong})
        problem(response, 401, "BNADAPT_METRICS_TOKEN")
    good = anonymous.http.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert good.status_code == 200, good.text
    assert "bnadapt_queue_depth " in good.text


def test_metrics_without_a_token_answer_only_loopback(api: InProcessApi) -> None:
    anonymous = api.anonymous()
    assert anonymous.http.get("/metrics").status_code == 200
    # A client behind a proxy on this machine (uvicorn trusts X-Forwarded-For from loopback).
    outside = anonymous.http.get("/metrics", headers={"X-Forwarded-For": "203.0.113.7"})
    problem(outside, 403, "BNADAPT_METRICS_TOKEN")


def test_a_scrape_answers_the_snapshot_without_reading_the_store(
    guarded_api: InProcessApi,
) -> None:
    # Before: every scrape read up to 10,000 job records and listed every store object.
    scraper = guarded_api.anonymous()
    headers = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    first = scraper.http.get("/metrics", headers=headers).text
    objects = _gauge(first, "bnadapt_store_objects")
    client = guarded_api.client("snapshot")
    created(client.http.post("/v1/datasets", files={"file": ("d.npz", _tiny_npz())}))
    for _ in range(5):
        again = scraper.http.get("/metrics", headers=headers).text
        assert _gauge(again, "bnadapt_store_objects") == objects
        assert _gauge(again, "bnadapt_metrics_snapshot_age_seconds") >= 0
    # A new snapshot (what the refresh every BNADAPT_METRICS_REFRESH_S does) sees the dataset.
    guarded_api.records().client.delete(SNAPSHOT_KEY)
    fresh = scraper.http.get("/metrics", headers=headers).text
    assert _gauge(fresh, "bnadapt_store_objects") > objects


def test_readyz_checks_at_most_every_ready_check_s(guarded_api: InProcessApi) -> None:
    anonymous = guarded_api.anonymous()
    assert anonymous.http.get("/readyz").status_code == 200
    probe = next((guarded_api.settings.store_path / "objects").rglob(_PROBE_SHA256))
    os.utime(probe, (1, 1))
    for _ in range(10):
        ready = anonymous.http.get("/readyz")
        assert ready.json() == {
            "status": "ready",
            "checks": {"redis": "ok", "workers": "ok", "store": "ok"},
        }
    # Before: every probe wrote the probe object again (a store write, a PUT on S3).
    assert probe.stat().st_mtime == 1


def test_readyz_names_what_is_not_ready_and_nothing_more(tmp_path: Path) -> None:
    from harness.inprocess import running_api

    with running_api(tmp_path) as broken:
        store = broken.settings.store_path
        store.mkdir(parents=True, exist_ok=True)
        (store / "tmp").write_text("not a directory")  # every write into the store fails
        response = broken.anonymous().http.get("/readyz")
    assert response.status_code == 503
    # Before: "not writable: [Errno 20] Not a directory: '/tmp/.../store/tmp/...'".
    assert response.json() == {
        "status": "not ready",
        "checks": {"redis": "ok", "workers": "ok", "store": "not writable"},
    }


def _queued_job(client: Client, **headers: str) -> dict[str, Any]:
    model = created(client.add_model("digits_cnn", {"width": 4}, seed=1))
    dataset = created(client.add_dataset(digits_npz(n=40)))
    body = {
        "kind": "adapt",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"batch_size": 10, "estimator": "cumulative"},
    }
    return created(client.submit(body, **headers), 202) | {"_body": body}


def test_a_deleted_jobs_idempotency_key_makes_a_new_job(api: InProcessApi) -> None:
    client = api.client("idempotency-delete")
    first = _queued_job(client, **{"Idempotency-Key": "nightly-42"})
    body = first.pop("_body")
    assert (
        created(client.submit(body, **{"Idempotency-Key": "nightly-42"}), 202)["id"]
        == (first["id"])
    )
    assert client.http.post(f"/v1/jobs/{first['id']}:cancel").status_code == 202
    assert client.http.delete(f"/v1/jobs/{first['id']}").status_code == 204
    # Before: 409 "still being processed" for the key's 24 hours.
    again = created(client.submit(body, **{"Idempotency-Key": "nightly-42"}), 202)
    assert again["id"] != first["id"]
    # The new binding holds as the first did.
    repeat = created(client.submit(body, **{"Idempotency-Key": "nightly-42"}), 202)
    assert repeat["id"] == again["id"]


def test_an_event_stream_ends_when_its_key_is_revoked(api: InProcessApi) -> None:
    records = api.records()
    key = records.create_api_key("revoked-stream").key
    client = Client(api.url, key)
    job = _queued_job(client)
    events: list[str] = []
    with client.http.stream(
        "GET", f"/v1/jobs/{job['id']}/events", timeout=httpx.Timeout(30)
    ) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("event: "):
                events.append(line.removeprefix("event: "))
                break
        assert records.revoke_api_key(key)
        # Before: the stream went on polling for as long as the job lived.
        rest = list(lines)  # ends: the server closes the stream
    assert events == ["status"]
    assert "event: error" in rest
    assert any('"status":401' in line and "revoked" in line for line in rest), rest
    assert client.http.get(f"/v1/jobs/{job['id']}").status_code == 401


def test_a_job_error_never_shows_paths_hosts_or_buckets() -> None:
    import redis

    from service.errors import ObjectNotFoundError
    from workers.running.saving import error_message

    store_path = "/srv/bnadapt/data/store/objects/ab/" + "ab" * 32
    hidden = {
        # Before: each text went to the job's record as it was.
        OSError(2, "No such file or directory", store_path): "system error",
        ObjectNotFoundError("cannot read s3://team-bucket/bnadapt/objects/ab: 403"): "store",
        redis.ConnectionError("Error 111 connecting to 10.0.0.7:6379."): "Redis",
        RuntimeError(f"failed to open {store_path} at http://seaweed:8333/x"): "failed to open",
    }
    for exc, phrase in hidden.items():
        text = error_message(exc)
        assert phrase in text, text
        for secret in ("/srv", "team-bucket", "10.0.0.7", "seaweed", socket.gethostname()):
            assert secret not in text, text
    shapes = RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x10 and 12x5)")
    assert error_message(shapes) == str(shapes)  # the job's own failure says what it was


def test_workers_are_named_without_their_hostname() -> None:
    from workers.running import job
    from workers.sharding import child

    for name in (job._worker_name(), child.process_name()):
        assert socket.gethostname() not in name
        assert name == job._worker_name().rsplit(":", 1)[0] + f":{os.getpid()}"


def test_a_missing_part_is_409_without_the_stores_path(api: InProcessApi) -> None:
    client = api.client("edges-part-gone")
    upload = created(client.http.post("/v1/uploads", json={"name": "gone"}))
    part = client.http.put(f"/v1/uploads/{upload['id']}/parts/1", content=b"y" * 4096).json()
    store = api.settings.store_path
    (store / "objects" / part["sha256"][:2] / part["sha256"]).unlink()
    response = client.http.post(f"/v1/uploads/{upload['id']}:complete", json={})
    # Before: "... no longer in the store (no object <sha256> in /tmp/.../store); ...".
    body = problem(response, 409, "no longer in the store")
    assert str(store) not in body["detail"] and "/tmp" not in body["detail"]
