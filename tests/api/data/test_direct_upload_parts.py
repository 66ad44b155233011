"""Direct uploads bounded by the size they announced (NOTE [ Direct upload parts ] in
service/store/s3/store.py): each presigned part URL signs its part's length, so the bucket
refuses a PUT of another; and completing checks the parts the bucket holds before anything is
assembled or copied, for a part that reached it another way. The API in process over a real
S3-compatible server (SeaweedFS)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest

from harness.inprocess import InProcessApi, running_api
from harness.servers import S3Server
from harness.stack import npz_bytes

pytestmark = pytest.mark.slow  # a real S3-compatible server (outside the quick tier)

MIB = 1024 * 1024
PART_BYTES = 5 * MIB  # S3's smallest part


@pytest.fixture
def api(s3_bucket: str, tmp_path: Path) -> Iterator[InProcessApi]:
    with running_api(tmp_path, store_url=f"s3://{s3_bucket}/pre", s3_part_bytes=PART_BYTES) as api:
        yield api


def bucket_keys(server: S3Server, bucket: str) -> list[str]:
    reply = server.client().list_objects_v2(Bucket=bucket)
    return sorted(entry["Key"] for entry in reply.get("Contents", ()))


def pending_uploads(server: S3Server, bucket: str) -> list[str]:
    reply = server.client().list_multipart_uploads(Bucket=bucket)
    return [upload["Key"] for upload in reply.get("Uploads", ())]


def start(client: httpx.Client, size: int) -> dict[str, object]:
    started = client.post("/v1/direct-uploads", json={"direct": True, "size": size})
    assert started.status_code == 201, started.text
    body: dict[str, object] = started.json()
    return body


def send(urls: list[str], parts: list[bytes]) -> list[str]:
    etags = []
    for url, part in zip(urls, parts, strict=True):
        put = httpx.put(url, content=part, timeout=60)
        assert put.status_code == 200, put.text
        etags.append(put.headers["etag"])
    return etags


def cached_copies(api: InProcessApi) -> list[Path]:
    return [p for p in (api.settings.cache_path / "objects").glob("*") if p.is_file()]


def test_a_part_url_takes_only_its_length(
    api: InProcessApi, s3_server: S3Server, s3_bucket: str
) -> None:
    client = api.client("direct-signed").http
    content = npz_of_two_parts()
    started = start(client, len(content))
    urls = started["part_urls"]
    assert isinstance(urls, list) and len(urls) == 2
    for url in urls:
        signed = parse_qs(urlsplit(url).query)["X-Amz-SignedHeaders"][0].split(";")
        assert "content-length" in signed, url
    # Longer or shorter than the part's share of the size announced: the bucket refuses it
    # before it keeps a byte. Before, a URL took any length.
    last = len(content) - PART_BYTES
    for url, wrong in ((urls[0], PART_BYTES + 1), (urls[1], last + MIB), (urls[1], last - 1)):
        put = httpx.put(url, content=bytes(wrong), timeout=60)
        assert put.status_code == 403, (wrong, put.status_code, put.text)
        assert "SignatureDoesNotMatch" in put.text
    upload_id = parse_qs(urlsplit(urls[0]).query)["uploadId"][0]
    assert pending_parts(s3_server, s3_bucket, upload_id) == {}
    # The lengths announced go through, and the upload registers.
    etags = send(urls, [content[:PART_BYTES], content[PART_BYTES:]])
    dataset = client.post(str(started["complete_url"]), json={"etags": etags})
    assert dataset.status_code == 201, dataset.text
    assert dataset.json()["size_bytes"] == len(content)


def npz_of_two_parts() -> bytes:
    """A dataset file longer than one part and shorter than two."""
    x = np.random.default_rng(0).integers(0, 256, size=(100, 1, 256, 256), dtype=np.uint8)
    content = npz_bytes(x=x)
    assert PART_BYTES < len(content) < 2 * PART_BYTES
    return content


def pending_parts(server: S3Server, bucket: str, upload_id: str) -> dict[int, int]:
    """Part number -> bytes of the parts the bucket holds for the upload ``upload_id``."""
    (key,) = [u["Key"] for u in server.client().list_multipart_uploads(Bucket=bucket)["Uploads"]]
    reply = server.client().list_parts(Bucket=bucket, Key=key, UploadId=upload_id)
    return {int(p["PartNumber"]): int(p["Size"]) for p in reply.get("Parts", ())}


def send_unsigned(server: S3Server, bucket: str, url: str, part: bytes) -> str:
    """``part`` sent to the upload and part number of ``url`` with the bucket's credentials,
    not through the URL: as a store that checks no signed length would take it."""
    query = parse_qs(urlsplit(url).query)
    key = urlsplit(url).path.split("/", 2)[2]
    reply = server.client().upload_part(
        Bucket=bucket,
        Key=key,
        UploadId=query["uploadId"][0],
        PartNumber=int(query["partNumber"][0]),
        Body=part,
    )
    return str(reply["ETag"])


def test_a_part_longer_than_announced_is_refused_before_any_copy(
    api: InProcessApi, s3_server: S3Server, s3_bucket: str
) -> None:
    client = api.client("direct-parts").http
    announced = PART_BYTES + MIB  # two parts: 5 MiB, then 1 MiB
    started = start(client, announced)
    assert started["part_bytes"] == PART_BYTES
    urls = started["part_urls"]
    assert isinstance(urls, list) and len(urls) == 2
    # The second part holds 4 MiB instead of 1, sent past its URL's signed length.
    etags = send(urls[:1], [bytes(PART_BYTES)])
    etags.append(send_unsigned(s3_server, s3_bucket, urls[1], bytes(4 * MIB)))
    refused = client.post(str(started["complete_url"]), json={"etags": etags})
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    assert "part 2 holds 4194304 bytes" in detail and f"{MIB}" in detail, detail
    # Nothing assembled, copied or kept: no object, no upload left open, no cached copy.
    assert bucket_keys(s3_server, s3_bucket) == []
    assert pending_uploads(s3_server, s3_bucket) == []
    assert cached_copies(api) == []


def test_too_few_etags_and_a_missing_part_are_refused(
    api: InProcessApi, s3_server: S3Server, s3_bucket: str
) -> None:
    client = api.client("direct-missing").http
    started = start(client, PART_BYTES + MIB)
    urls = started["part_urls"]
    assert isinstance(urls, list)
    (etag,) = send(urls[:1], [bytes(PART_BYTES)])
    one = client.post(str(started["complete_url"]), json={"etags": [etag]})
    assert one.status_code == 422, one.text
    assert "2 parts" in one.json()["detail"] and "1 ETags" in one.json()["detail"]
    again = start(client, PART_BYTES + MIB)
    urls = again["part_urls"]
    assert isinstance(urls, list)
    (etag,) = send(urls[:1], [bytes(PART_BYTES)])
    missing = client.post(str(again["complete_url"]), json={"etags": [etag, etag]})
    assert missing.status_code == 422, missing.text
    assert "part 2 of the upload never reached the bucket" in missing.json()["detail"]
    assert bucket_keys(s3_server, s3_bucket) == []
    assert pending_uploads(s3_server, s3_bucket) == []


def test_parts_of_the_announced_lengths_register(api: InProcessApi) -> None:
    client = api.client("direct-ok").http
    content = npz_of_two_parts()
    started = start(client, len(content))
    urls = started["part_urls"]
    assert isinstance(urls, list)
    etags = send(urls, [content[:PART_BYTES], content[PART_BYTES:]])
    dataset = client.post(str(started["complete_url"]), json={"etags": etags})
    assert dataset.status_code == 201, dataset.text
    assert dataset.json()["size_bytes"] == len(content)
