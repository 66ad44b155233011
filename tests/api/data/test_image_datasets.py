"""Image datasets over HTTP, with the real API and a real worker: WebDataset-style tars (one or
several joined), the preprocessing spec kept with the dataset and reported by its jobs, the
same spec on uint8 arrays, and every bad input of docs/datasets.md refused with a clear 4xx at
registration (nothing registered, nothing written) or failing the job with the sample named."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from harness.stack import Stack, job_payload, npz_bytes, running_stack

pytestmark = pytest.mark.slow

MAX_IMAGE_PIXELS = 64 * 64
SPEC = {"mean": [0.5, 0.4, 0.3], "std": [0.25, 0.2, 0.3]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    limits = {
        "BNADAPT_MAX_IMAGE_PIXELS": str(MAX_IMAGE_PIXELS),
        "BNADAPT_WORKER_THREADS": "1",
        "BNADAPT_LOADER_PROCESSES": "1",
    }
    with running_stack(tmp_path_factory.mktemp("stack"), limits) as stack:
        yield stack


def http(stack: Stack, tenant: str) -> httpx.Client:
    """A new tenant's connection (the project's client's, with its key and base URL)."""
    return stack.client(tenant).http


def ok(response: httpx.Response, status: int = 200) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    return body


def encoded(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.type = len(data), kind
    return info


def tar_bytes(members: list[tuple[str, bytes]], links: list[str] = ()) -> bytes:  # type: ignore[assignment]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in members:
            archive.addfile(member(name, data), io.BytesIO(data))
        for name in links:
            info = member(name, kind=tarfile.SYMTYPE)
            info.linkname = "/etc/passwd"
            archive.addfile(info)
    return out.getvalue()


def pixels(n: int, size: tuple[int, int] = (8, 8), seed: int = 0) -> np.ndarray:
    """(n, H, W, 3) uint8 images."""
    return np.random.default_rng(seed).integers(0, 256, size=(n, *size, 3), dtype=np.uint8)


def samples(images: np.ndarray, labels: np.ndarray, prefix: str = "s") -> list[tuple[str, bytes]]:
    out = []
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        out += [(f"{prefix}{i:04d}.png", encoded(image)), (f"{prefix}{i:04d}.cls", b"%d" % label)]
    return out


def register(client: httpx.Client, content: bytes, spec: dict[str, Any] | None = None) -> Any:
    data = {} if spec is None else {"preprocessing": json.dumps(spec)}
    return client.post("/v1/datasets", files={"file": ("d.tar", content)}, data=data)


def refused(client: httpx.Client, response: httpx.Response, status: int, *phrases: str) -> None:
    """A problem body with ``status`` naming ``phrases``, and no dataset registered."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    detail = response.json()["detail"]
    for phrase in phrases:
        assert phrase.lower() in detail.lower(), detail
    assert ok(client.get("/v1/datasets"))["items"] == []


def run(client: httpx.Client, model: str, dataset: str, kind: str, **params: Any) -> Any:
    body = {
        "kind": kind,
        "model_id": model,
        "dataset_id": dataset,
        "params": {"batch_size": 8, "device": "cpu", **params},
    }
    job = ok(client.post("/v1/jobs", json=body), 202)
    for _ in range(900):
        state = ok(client.get(f"/v1/jobs/{job['id']}"))
        if state["status"] in ("succeeded", "failed", "canceled"):
            return state
        import time

        time.sleep(0.2)
    raise AssertionError(f"job {job['id']} did not end")


def resnet(client: httpx.Client, channels: int = 3) -> str:
    meta = {"architecture": "resnet", "kwargs": {"in_channels": channels, "depth": 1, "width": 4}}
    return str(ok(client.post("/v1/models", data={"meta": json.dumps(meta)}), 201)["id"])


def test_tar_and_uint8_array_give_the_same_inputs(stack: Stack) -> None:
    """A tar of lossless PNGs and the npz of their pixels, both with one spec: an evaluate job
    measures exactly the same, and each report carries the spec."""
    client = http(stack, "same")
    images, labels = pixels(40), np.arange(40) % 10
    from_tar = ok(register(client, tar_bytes(samples(images, labels)), SPEC), 201)
    assert from_tar["format"] == "tar" and from_tar["num_samples"] == 40
    assert from_tar["sample_shape"] == [3, 8, 8] and from_tar["num_classes"] == 10
    assert from_tar["preprocessing"]["mean"] == SPEC["mean"]
    content = npz_bytes(x=np.ascontiguousarray(images.transpose(0, 3, 1, 2)), y=labels)
    from_npz = ok(
        client.post(
            f"/v1/datasets?preprocessing={json.dumps(SPEC)}",
            content=content,
            headers={"Content-Type": "application/octet-stream"},
        ),
        201,
    )
    assert from_npz["preprocessing"] == from_tar["preprocessing"]
    model = resnet(client)
    reports = []
    for dataset in (from_tar, from_npz):
        job = run(client, model, dataset["id"], "evaluate")
        assert job["status"] == "succeeded", job
        reports.append(ok(client.get(f"/v1/jobs/{job['id']}/report")))
    assert reports[0]["metrics_before"] == reports[1]["metrics_before"]
    assert reports[0]["preprocessing"] == reports[1]["preprocessing"] == from_tar["preprocessing"]
    assert from_tar["image_size"] == from_npz["image_size"] == [8, 8]

    # A job's own spec replaces the dataset's, for that job: the same on both, and reported.
    own = {"resize": [6, 6], "scale": False}
    reports = []
    for dataset in (from_tar, from_npz):
        job = run(client, model, dataset["id"], "evaluate", preprocessing=own)
        assert job["status"] == "succeeded", job
        assert job_payload(stack, job["id"]).dataset.sample_shape == [3, 6, 6]
        reports.append(ok(client.get(f"/v1/jobs/{job['id']}/report")))
        assert reports[-1]["preprocessing"]["resize"] == [6, 6]
        assert reports[-1]["preprocessing"]["scale"] is False
    # Pillow's and torch's bilinear resize differ a little: close, not equal.
    before = [r["metrics_before"]["loss"] for r in reports]
    assert before[0] == pytest.approx(before[1], rel=0.05)
    # A job spec that cannot apply: gray for RGB arrays, any spec on float arrays.
    body = {"kind": "evaluate", "model_id": model, "dataset_id": from_npz["id"]}
    gray = {**body, "params": {"preprocessing": {"channels": "gray"}}}
    response = client.post("/v1/jobs", json=gray)
    assert response.status_code == 422 and "uint8 images" in response.json()["detail"]
    floats = ok(
        client.post(
            "/v1/datasets",
            files={
                "file": (
                    "f.npz",
                    npz_bytes(x=np.zeros((4, 3, 8, 8), np.float32), y=np.zeros(4, np.int64)),
                )
            },
        ),
        201,
    )
    body = {**body, "dataset_id": floats["id"], "params": {"preprocessing": own}}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422 and "holds no images" in response.json()["detail"]


def test_shards_joined_by_a_resumable_upload_adapt_with_resize_and_crop(stack: Stack) -> None:
    """Two tar shards (one upload part each) of mixed image sizes and formats, one dataset;
    resized and cropped by its spec; adapted by one worker and in two shards."""
    client = http(stack, "shards")
    first = samples(pixels(20, (12, 10)), np.arange(20) % 3, prefix="a")
    jpegs = pixels(20, (9, 16), seed=1)
    second = []
    for i, image in enumerate(jpegs):
        second += [(f"b/{i:04d}.jpg", encoded(image, "JPEG")), (f"b/{i:04d}.json", b'{"label": 2}')]
    spec = {"resize": [10, 10], "center_crop": [8, 8], **SPEC}
    upload = ok(client.post("/v1/uploads", json={"name": "two shards"}), 201)
    for number, shard in ((1, tar_bytes(first)), (2, tar_bytes(second))):
        ok(client.put(f"/v1/uploads/{upload['id']}/parts/{number}", content=shard))
    dataset = ok(
        client.post(f"/v1/uploads/{upload['id']}:complete", json={"preprocessing": spec}), 201
    )
    assert dataset["num_samples"] == 40 and dataset["sample_shape"] == [3, 8, 8]
    assert dataset["num_classes"] == 3 and dataset["image_size"] is None
    model = resnet(client)
    # Mixed sizes: a job's own spec must resize.
    body = {"kind": "adapt", "model_id": model, "dataset_id": dataset["id"]}
    response = client.post("/v1/jobs", json={**body, "params": {"preprocessing": {}}})
    assert response.status_code == 422 and "resize" in response.json()["detail"]
    for shards in (1, 2):
        job = run(client, model, dataset["id"], "adapt", shards=shards)
        assert job["status"] == "succeeded", job
        report = ok(client.get(f"/v1/jobs/{job['id']}/report"))
        assert report["samples"] == 40
        assert report["preprocessing"]["resize"] == [10, 10]
        assert report["preprocessing"]["center_crop"] == [8, 8]
    # Training reads shuffled batches, decoded in the job's process.
    job = run(client, model, dataset["id"], "train", epochs=1)
    assert job["status"] == "succeeded", job
    assert ok(client.get(f"/v1/jobs/{job['id']}/report"))["preprocessing"]["resize"] == [10, 10]


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` pixels and holds none: a decompression bomb's
    header, which is all registration reads."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_bad_inputs_are_refused_at_registration(stack: Stack) -> None:
    client = http(stack, "bad")
    good = samples(pixels(3), np.arange(3))
    cases: list[tuple[bytes, dict[str, Any] | None, int, tuple[str, ...]]] = [
        # A corrupt image: its bytes are no JPEG or PNG.
        (
            tar_bytes([*good, ("bad.png", b"\x89PNG not really"), ("bad.cls", b"1")]),
            None,
            422,
            ("'bad'", "not a readable jpeg or png"),
        ),
        # A truncated tar: cut inside its last member.
        (tar_bytes(good)[: 512 * 5 + 100], None, 422, ("truncated",)),
        # A sample without its label.
        (
            tar_bytes([*good, ("nolabel.png", encoded(pixels(1)[0]))]),
            None,
            422,
            ("'nolabel'", "no label"),
        ),
        # Mixed image sizes without a resize.
        (
            tar_bytes([*good, ("big.png", encoded(pixels(1, (9, 8))[0])), ("big.cls", b"0")]),
            None,
            422,
            ("'big'", "resize"),
        ),
        # A decompression bomb: 100000 x 100000 pixels declared in a few bytes.
        (
            tar_bytes([*good, ("bomb.png", png_header_only(100_000, 100_000)), ("bomb.cls", b"0")]),
            None,
            413,
            ("'bomb'", "BNADAPT_MAX_IMAGE_PIXELS"),
        ),
        # Over the pixel limit of this stack (64 x 64), a real image.
        (
            tar_bytes([("wide.png", encoded(pixels(1, (65, 64))[0])), ("wide.cls", b"0")]),
            {"resize": [8, 8]},
            413,
            ("'wide'", "BNADAPT_MAX_IMAGE_PIXELS"),
        ),
        # Member paths that leave the archive, and a link.
        (
            tar_bytes([*good, ("../escape.png", encoded(pixels(1)[0]))]),
            None,
            422,
            ("'../escape.png'", "leaves the archive"),
        ),
        (
            tar_bytes([*good, ("/abs/escape.png", encoded(pixels(1)[0]))]),
            None,
            422,
            ("leaves the archive",),
        ),
        (tar_bytes(good, links=["link.png"]), None, 422, ("'link.png'", "link")),
        # A label that is not a class.
        (
            tar_bytes([*good, ("x.png", encoded(pixels(1)[0])), ("x.cls", b"cat")]),
            None,
            422,
            ("'x'", "integer"),
        ),
        # A spec that does not fit: three means for gray images, a crop past the images.
        (tar_bytes(good), {"channels": "gray", **SPEC}, 422, ("mean has 3 values",)),
        (tar_bytes(good), {"center_crop": [9, 9]}, 422, ("center_crop", "larger")),
        # No images at all.
        (tar_bytes([("a.cls", b"1")]), None, 422, ("no .jpg or .png",)),
    ]
    for content, spec, status, phrases in cases:
        refused(client, register(client, content, spec), status, *phrases)
    # A spec on float arrays, which are not images.
    x = np.zeros((4, 3, 8, 8), np.float32)
    refused(
        client,
        client.post(
            "/v1/datasets",
            files={"file": ("d.npz", npz_bytes(x=x))},
            data={"preprocessing": json.dumps(SPEC)},
        ),
        422,
        "uint8",
    )
    # Nothing was written outside the store: no escaping member landed anywhere.
    data_dir = stack.data_dir
    assert not list(data_dir.parent.rglob("escape.png"))


def test_a_damaged_image_body_fails_the_job_naming_the_sample(stack: Stack) -> None:
    """A PNG whose header is sound but whose pixel data is cut off registers (only headers are
    read then); the job that decodes it fails, naming the sample."""
    client = http(stack, "damaged")
    good = samples(pixels(15), np.arange(15) % 10)
    cut = encoded(pixels(1, seed=3)[0])
    damaged = tar_bytes([*good, ("damaged.png", cut[: len(cut) // 2]), ("damaged.cls", b"1")])
    dataset = ok(register(client, damaged), 201)
    job = run(client, resnet(client), dataset["id"], "adapt")
    assert job["status"] == "failed", job
    assert "'damaged'" in job["error"] and "decoded" in job["error"], job["error"]
