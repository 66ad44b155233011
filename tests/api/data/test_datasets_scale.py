"""Datasets at scale over HTTP: uploads streamed into the store within the settings' limits
(413 problem bodies naming the setting), resumable uploads that survive a dropped connection,
and jobs that read a memory-mapped dataset a batch at a time."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest
import safetensors.numpy

from harness.inprocess import InProcessApi, running_api
from harness.stack import Stack, npz_bytes

MAX_DATASET_BYTES = 3 * 1024 * 1024
MAX_PART_BYTES = 1024 * 1024


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessApi]:
    """The API in process with small limits, so that tests can cross them cheaply."""
    limits = {"max_dataset_bytes": MAX_DATASET_BYTES, "max_upload_part_bytes": MAX_PART_BYTES}
    with running_api(tmp_path_factory.mktemp("api"), **limits) as api:
        yield api


def http(api: InProcessApi | Stack, tenant: str) -> httpx.Client:
    """A new tenant's connection (the project's client's, with its key and base URL)."""
    return api.client(tenant).http


def problem(response: httpx.Response, status: int, *phrases: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    for phrase in phrases:
        assert phrase.lower() in body["detail"].lower(), body["detail"]
    return body


def ok(response: httpx.Response, status: int = 200) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    return body


def images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, 1, 8, 8), dtype=np.uint8)
    return x, rng.integers(0, 10, size=n).astype(np.int64)


def test_upload_forms_register_the_same_file(api: InProcessApi) -> None:
    client = http(api, "forms")
    x, y = images(40)
    content = npz_bytes(x=x, y=y)
    form = ok(client.post("/v1/datasets", files={"file": ("a.npz", content)}), 201)
    named = ok(
        client.post("/v1/datasets", files={"file": ("a.npz", content)}, data={"name": "n"}), 201
    )
    raw = ok(
        client.post(
            "/v1/datasets?name=raw",
            content=content,
            headers={"Content-Type": "application/octet-stream"},
        ),
        201,
    )
    assert (form["name"], named["name"], raw["name"]) == ("a.npz", "n", "raw")
    assert form["sha256"] == raw["sha256"] == hashlib.sha256(content).hexdigest()
    assert (raw["num_samples"], raw["dtype"], raw["num_classes"]) == (40, "uint8", 10)


def test_over_the_limit_is_a_problem_naming_the_setting(api: InProcessApi) -> None:
    client = http(api, "limits")
    big = npz_bytes(x=np.zeros((MAX_DATASET_BYTES // 4 + 1024, 1), np.float32))
    # Announced by Content-Length: refused before the body is read.
    problem(
        client.post("/v1/datasets", files={"file": ("b.npz", big)}),
        413,
        "BNADAPT_MAX_DATASET_BYTES",
    )
    problem(client.post("/v1/datasets", content=big), 413, "BNADAPT_MAX_DATASET_BYTES")

    # Chunked, no Content-Length: refused when the bytes pass the limit.
    def chunks() -> Iterator[bytes]:
        for start in range(0, len(big), 65536):
            yield big[start : start + 65536]

    problem(client.post("/v1/datasets", content=chunks()), 413, "BNADAPT_MAX_DATASET_BYTES")
    problem(client.post("/v1/datasets", files={"nofile": ("x", b"1")}), 422, "'file'")


def send_half_and_drop(url: str, path: str, key: str, body: bytes) -> None:
    """PUT with a Content-Length of the whole body, send half of it, close the socket: a
    connection dropped in the middle of a part."""
    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port)) as sock:
        head = (
            f"PUT {path} HTTP/1.1\r\nHost: {where.netloc}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body[: len(body) // 2])


def test_resumable_upload_survives_a_dropped_connection(api: InProcessApi, tmp_path: Path) -> None:
    key = api.records().create_api_key("resume").key
    client = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    x, y = images(2000)  # 128 KB of x...
    x = np.repeat(x, 16, axis=2)  # ... times 16: 2 MB, three parts of at most 1 MB
    content = safetensors.numpy.save({"x": x, "y": y})
    part = 800_000
    pieces = [content[i : i + part] for i in range(0, len(content), part)]
    assert len(pieces) == 3
    upload = ok(
        client.post("/v1/uploads", json={"name": "resumed", "size_bytes": len(content)}), 201
    )
    assert upload["parts"] == [] and upload["max_part_bytes"] == MAX_PART_BYTES
    ok(client.put(f"/v1/uploads/{upload['id']}/parts/1", content=pieces[0]))
    # Part 2 dies half way (the upload is at 50%): nothing of it is recorded.
    send_half_and_drop(api.url, f"/v1/uploads/{upload['id']}/parts/2", key, pieces[1])
    seen = ok(client.get(f"/v1/uploads/{upload['id']}"))
    assert [p["number"] for p in seen["parts"]] == [1]
    assert seen["parts"][0]["sha256"] == hashlib.sha256(pieces[0]).hexdigest()
    problem(
        client.post(f"/v1/uploads/{upload['id']}:complete", json={}),
        409,
        f"has {part} of the {len(content)} bytes",
    )
    # Another tenant sees nothing.
    other = http(api, "resume-other")
    problem(other.get(f"/v1/uploads/{upload['id']}"), 404, "not found")
    problem(other.put(f"/v1/uploads/{upload['id']}/parts/2", content=b"x"), 404)
    # Resumed: the missing parts, in any order.
    ok(client.put(f"/v1/uploads/{upload['id']}/parts/3", content=pieces[2]))
    ok(client.put(f"/v1/uploads/{upload['id']}/parts/2", content=pieces[1]))
    dataset = ok(client.post(f"/v1/uploads/{upload['id']}:complete", json={}), 201)
    assert dataset["sha256"] == hashlib.sha256(content).hexdigest()
    assert (dataset["name"], dataset["num_samples"], dataset["format"]) == (
        "resumed",
        2000,
        "safetensors",
    )
    problem(client.get(f"/v1/uploads/{upload['id']}"), 404)  # completed: gone


def test_upload_parts_within_limits(api: InProcessApi) -> None:
    client = http(api, "part-limits")
    problem(
        client.post("/v1/uploads", json={"size_bytes": MAX_DATASET_BYTES + 1}),
        413,
        "BNADAPT_MAX_DATASET_BYTES",
    )
    upload = ok(client.post("/v1/uploads", json={}), 201)
    path = f"/v1/uploads/{upload['id']}/parts"
    problem(
        client.put(f"{path}/1", content=b"\0" * (MAX_PART_BYTES + 1)),
        413,
        "BNADAPT_MAX_UPLOAD_PART_BYTES",
    )
    for number in (1, 2, 3):
        ok(client.put(f"{path}/{number}", content=b"\0" * MAX_PART_BYTES))
    # The parts together may not pass the dataset limit.
    problem(client.put(f"{path}/4", content=b"\0" * 10), 413, "BNADAPT_MAX_DATASET_BYTES")
    assert client.put(f"{path}/0", content=b"1").status_code == 422
    ok(client.put(f"{path}/3", content=b"\0" * 10))  # replaced: room again
    ok(client.put(f"{path}/5", content=b"1"))
    problem(client.post(f"/v1/uploads/{upload['id']}:complete", json={}), 409, "lacks parts [4]")
    ok(client.put(f"{path}/4", content=b"1"))
    # Joined, the parts are not a dataset: 422, and the upload stays to be fixed.
    problem(client.post(f"/v1/uploads/{upload['id']}:complete", json={}), 422, "unknown type")
    assert len(ok(client.get(f"/v1/uploads/{upload['id']}"))["parts"]) == 5
    assert client.delete(f"/v1/uploads/{upload['id']}").status_code == 204
    problem(client.get(f"/v1/uploads/{upload['id']}"), 404)


@pytest.mark.slow
def test_adapt_reads_batches_and_bounds_its_measurement(shared_stack: Stack) -> None:
    client = http(shared_stack, "adapt-mmap")
    x, y = images(600)
    dataset = ok(client.post("/v1/datasets", files={"file": ("d.npz", npz_bytes(x=x, y=y))}), 201)
    model = ok(client.post("/v1/models", data={"meta": '{"architecture": "digits_cnn"}'}), 201)
    job = ok(
        client.post(
            "/v1/jobs",
            json={
                "kind": "adapt",
                "model_id": model["id"],
                "dataset_id": dataset["id"],
                "params": {"batch_size": 32, "max_batches": 2, "device": "cpu"},
            },
        ),
        202,
    )
    for _ in range(600):
        state = ok(client.get(f"/v1/jobs/{job['id']}"))
        if state["status"] in ("succeeded", "failed", "canceled"):
            break
        import time

        time.sleep(0.2)
    assert state["status"] == "succeeded", state
    report = ok(client.get(f"/v1/jobs/{job['id']}/report"))
    assert report["batches"] == 2 and report["samples"] == 64
    # Measured on max_batches batches, not on all 600 samples twice.
    assert report["metrics_before"]["num_samples"] == 64
    assert report["metrics_after"]["num_samples"] == 64


def cli(api: InProcessApi, key: str) -> list[str]:
    return [sys.executable, "-m", "service.local.cli", "--url", api.url, "--key", key]


def test_cli_resumes_an_interrupted_upload(api: InProcessApi, tmp_path: Path) -> None:
    key = api.records().create_api_key("cli-resume").key
    x, y = images(3000)
    x = np.repeat(x, 8, axis=2)  # 1.5 MB: two parts of 1 MB
    path = tmp_path / "d.npz"
    path.write_bytes(npz_bytes(x=x, y=y))
    content = path.read_bytes()
    client = http(api, "cli-resume")
    client.headers["Authorization"] = f"Bearer {key}"
    body = {"name": "cli", "size_bytes": len(content)}
    upload = ok(client.post("/v1/uploads", json=body), 201)
    # Interrupted after its first part (and a part 2 with other bytes, to be replaced).
    ok(client.put(f"/v1/uploads/{upload['id']}/parts/1", content=content[:MAX_PART_BYTES]))
    ok(client.put(f"/v1/uploads/{upload['id']}/parts/2", content=b"stale"))
    done = subprocess.run(
        [*cli(api, key), "datasets", "add", str(path), "--resume", upload["id"]],
        env=api.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    dataset = json.loads(done.stdout)
    assert dataset["sha256"] == hashlib.sha256(content).hexdigest()
    assert (dataset["name"], dataset["num_samples"]) == ("cli", 3000)
    assert "100.0%" in done.stderr and upload["id"] in done.stderr
    # A fresh upload through the CLI, from the start.
    again = subprocess.run(
        [*cli(api, key), "datasets", "add", str(path)],
        env=api.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(again.stdout)["sha256"] == dataset["sha256"]


def test_an_announced_digest_is_checked(api: InProcessApi) -> None:
    """``X-Content-SHA256``: the file's digest, which lets an S3 store write straight to the
    content key; a file that hashes otherwise is refused and registers nothing."""
    client = http(api, "digest")
    x, y = images(24, seed=3)
    content = npz_bytes(x=x, y=y)
    digest = hashlib.sha256(content).hexdigest()
    raw = {"Content-Type": "application/octet-stream"}
    right = ok(
        client.post(
            "/v1/datasets?name=d", content=content, headers={**raw, "X-Content-SHA256": digest}
        ),
        201,
    )
    assert right["sha256"] == digest
    form = ok(
        client.post(
            "/v1/datasets",
            files={"file": ("a.npz", content)},
            headers={"X-Content-SHA256": digest},
        ),
        201,
    )
    assert form["sha256"] == digest
    wrong = hashlib.sha256(b"another file").hexdigest()
    problem(
        client.post(
            "/v1/datasets?name=w", content=content, headers={**raw, "X-Content-SHA256": wrong}
        ),
        422,
        "X-Content-SHA256",
        digest,
    )
    problem(
        client.post(
            "/v1/datasets?name=w", content=content, headers={**raw, "X-Content-SHA256": "abc"}
        ),
        422,
        "64 lowercase hexadecimal",
    )
    upload = ok(client.post("/v1/uploads", json={"name": "p"}), 201)
    problem(
        client.put(
            f"/v1/uploads/{upload['id']}/parts/1",
            content=b"part bytes",
            headers={**raw, "X-Content-SHA256": wrong},
        ),
        422,
        "X-Content-SHA256",
    )
    assert ok(client.get(f"/v1/uploads/{upload['id']}"))["parts"] == []
    ok(client.put(f"/v1/uploads/{upload['id']}/parts/1", content=content, headers=raw))
    complete = f"/v1/uploads/{upload['id']}:complete"
    problem(client.post(complete, json={"sha256": wrong}), 422, "field sha256", digest)
    joined = ok(client.post(complete, json={"sha256": digest}), 201)
    assert joined["sha256"] == digest
    listed = ok(client.get("/v1/datasets"))
    expected = sorted([right["id"], form["id"], joined["id"]])
    assert sorted(d["id"] for d in listed["items"]) == expected
