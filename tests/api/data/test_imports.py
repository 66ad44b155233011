"""Imports from S3 (``POST /v1/datasets:import``) on the real API in process over a real S3
store (SeaweedFS): only from the prefixes an operator allowed the tenant (``bnadapt tenants
allow-import``), never from the store, one answer for "not allowed" and "not found", no error
that repeats what was read; and a folder of images registered as a tar built server-side, in
torchvision ImageFolder's order."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from harness.inprocess import InProcessApi, running_api
from harness.servers import S3Server
from harness.stack import REPO, Client, npz_bytes
from service.datasets.imports import NOT_A_SOURCE
from service.formats.images import index_tar

pytestmark = pytest.mark.slow  # a real S3-compatible server (outside the quick tier)

STORE_PREFIX = "deploy/"
MAX_DATASET_BYTES = 2 * 1024 * 1024
RNG = np.random.default_rng(0)


@dataclass
class S3Api:
    api: InProcessApi
    server: S3Server
    store_bucket: str  # the store is s3://store_bucket/deploy/
    source_bucket: str  # a bucket the service can read, opened to tenants one prefix each

    def tenant(self, name: str) -> tuple[str, Client]:
        """A new tenant's id and client."""
        key = self.api.records().create_api_key(name)
        return key.tenant_id, Client(self.api.url, key.key)

    def put(self, key: str, body: bytes, bucket: str | None = None) -> None:
        self.server.client().put_object(Bucket=bucket or self.source_bucket, Key=key, Body=body)

    def allow(self, tenant_id: str, prefix: str) -> None:
        self.api.records().allow_import(tenant_id, prefix)

    def stored(self, sha256: str) -> bytes:
        key = f"{STORE_PREFIX}objects/{sha256}"
        body: bytes = (
            self.server.client().get_object(Bucket=self.store_bucket, Key=key)["Body"].read()
        )
        return body


@pytest.fixture(scope="module")
def s3_api(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Api]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in s3_server.env.items():
            patch.setenv(name, value)
        store_bucket, source_bucket = s3_server.new_bucket(), s3_server.new_bucket()
        with running_api(
            tmp_path_factory.mktemp("imports"),
            store_url=f"s3://{store_bucket}/{STORE_PREFIX}",
            max_dataset_bytes=MAX_DATASET_BYTES,
            max_classes=5,
        ) as api:
            yield S3Api(api, s3_server, store_bucket, source_bucket)


def arrays(n: int = 6) -> bytes:
    x = RNG.standard_normal((n, 3)).astype(np.float32)
    return npz_bytes(x=x, y=np.arange(n) % 2)


def import_(client: Client, source: str, **fields: Any) -> Any:
    return client.http.post("/v1/datasets:import", json={"source": source, **fields})


def refused(response: Any) -> None:
    """The one answer to a source the tenant may not read, whatever the reason."""
    assert response.status_code == 404, response.text
    assert response.json()["detail"] == NOT_A_SOURCE


def created(response: Any) -> dict[str, Any]:
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


# -- only what the tenant was given


def test_a_tenant_imports_only_from_its_allowed_prefixes(s3_api: S3Api) -> None:
    alice, client = s3_api.tenant("alice")
    _, bob = s3_api.tenant("bob")
    content = arrays()
    bucket = s3_api.source_bucket
    s3_api.put("alice/d.npz", content)
    s3_api.put("alice-archive/d.npz", content)
    source = f"s3://{bucket}/alice/d.npz"

    refused(import_(client, source))  # not allowed yet: as if it were not there
    s3_api.allow(alice, f"s3://{bucket}/alice")  # stored as the folder alice/
    dataset = created(import_(client, source))
    assert (dataset["sha256"], dataset["name"]) == (hashlib.sha256(content).hexdigest(), "d.npz")
    assert client.http.get(f"/v1/datasets/{dataset['id']}").status_code == 200

    # Another tenant, a sibling prefix, a missing object, the bucket itself: the same answer.
    refused(import_(bob, source))
    refused(import_(client, f"s3://{bucket}/alice-archive/d.npz"))
    refused(import_(client, f"s3://{bucket}/alice/none.npz"))
    refused(import_(client, f"s3://{bucket}-other/alice/d.npz"))

    s3_api.api.records().revoke_import(alice, f"s3://{bucket}/alice/")
    refused(import_(client, source))


def test_keys_that_could_be_read_as_another_are_refused(s3_api: S3Api) -> None:
    alice, client = s3_api.tenant("alice-dots")
    bucket = s3_api.source_bucket
    s3_api.allow(alice, f"s3://{bucket}/dots/")
    s3_api.put("secret/d.npz", arrays())
    for source in (
        f"s3://{bucket}/dots/../secret/d.npz",
        f"s3://{bucket}/dots/./../secret/d.npz",
        f"s3://{bucket}/dots//d.npz",
        f"s3://{bucket}/dots\\..\\secret\\d.npz",
        f"s3://{bucket}/",
        "https://example.com/d.npz",
    ):
        response = import_(client, source)
        assert response.status_code == 422, (source, response.text)
        assert "write s3://BUCKET/" in response.text or "not the whole bucket" in response.text
    with pytest.raises(ValueError, match=r"'\.\.'"):
        s3_api.api.records().allow_import(alice, f"s3://{bucket}/dots/../secret/")


def test_the_store_is_never_a_source_even_when_allowed(s3_api: S3Api) -> None:
    _, victim_client = s3_api.tenant("victim")
    thief, client = s3_api.tenant("thief")
    secret = arrays(9)
    sha256 = created(victim_client.add_dataset(secret))["sha256"]
    assert s3_api.stored(sha256) == secret  # the object is there, under the store's prefix

    # Even an operator's mistake (the store's whole bucket allowed) opens nothing of the store.
    s3_api.allow(thief, f"s3://{s3_api.store_bucket}/")
    refused(import_(client, f"s3://{s3_api.store_bucket}/{STORE_PREFIX}objects/{sha256}"))
    refused(import_(client, f"s3://{s3_api.store_bucket}/{STORE_PREFIX}"))
    # ... while the rest of that bucket imports as allowed.
    s3_api.put("incoming/d.npz", arrays(), bucket=s3_api.store_bucket)
    created(import_(client, f"s3://{s3_api.store_bucket}/incoming/d.npz"))


def test_errors_repeat_nothing_read_from_the_source(s3_api: S3Api) -> None:
    tenant, client = s3_api.tenant("echo")
    bucket = s3_api.source_bucket
    s3_api.allow(tenant, f"s3://{bucket}/echo/")
    not_a_dataset = b"CONFIDENTIAL-BYTES " * 100
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        info = tarfile.TarInfo("CONFIDENTIAL-NAME.png")
        info.size = 32
        archive.addfile(info, io.BytesIO(b"CONFIDENTIAL-PIXELS".ljust(32, b"!")))
    bad_tar = out.getvalue()
    for name, body in (("bytes.bin", not_a_dataset), ("names.tar", bad_tar)):
        # Uploaded by hand, the error names what is wrong with the file...
        direct = client.add_dataset(body)
        assert direct.status_code == 422 and "CONFIDENT" in direct.text, direct.text
        # ... imported, the same status says nothing of what was read.
        s3_api.put(f"echo/{name}", body)
        response = import_(client, f"s3://{bucket}/echo/{name}")
        assert response.status_code == 422, response.text
        assert "CONFIDENT" not in response.text
        assert "POST /v1/datasets" in response.json()["detail"]
    assert client.http.get("/v1/datasets").json()["items"] == []


def test_over_the_limit_is_413_without_echo(s3_api: S3Api) -> None:
    tenant, client = s3_api.tenant("big")
    s3_api.allow(tenant, f"s3://{s3_api.source_bucket}/big/")
    s3_api.put("big/d.npz", npz_bytes(x=np.zeros((MAX_DATASET_BYTES // 4 + 1,), np.float32)))
    response = import_(client, f"s3://{s3_api.source_bucket}/big/d.npz")
    assert response.status_code == 413, response.text
    assert "BNADAPT_MAX_DATASET_BYTES" in response.text


# -- the operator's commands


def cli(
    s3_api: S3Api, *argv: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.local.cli", *argv, "--redis-url", s3_api.api.redis.url],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        timeout=60,
        check=False,
    )


def test_tenants_allow_list_and_revoke_imports(s3_api: S3Api) -> None:
    tenant, client = s3_api.tenant("cli-tenant")
    bucket = s3_api.source_bucket
    s3_api.put("cli/d.npz", arrays())
    source = f"s3://{bucket}/cli/d.npz"

    allowed = cli(s3_api, "tenants", "allow-import", "cli-tenant", f"s3://{bucket}/cli")
    assert allowed.returncode == 0, allowed.stderr
    by_id = cli(s3_api, "tenants", "allow-import", tenant, f"s3://{bucket}/other/")
    assert by_id.returncode == 0, by_id.stderr
    listed = cli(s3_api, "tenants", "list-imports", "cli-tenant")
    assert listed.stdout.split() == [f"s3://{bucket}/cli/", f"s3://{bucket}/other/"]
    created(import_(client, source))

    revoked = cli(s3_api, "tenants", "revoke-import", "cli-tenant", f"s3://{bucket}/cli/")
    assert revoked.returncode == 0, revoked.stderr
    refused(import_(client, source))
    again = cli(s3_api, "tenants", "revoke-import", "cli-tenant", f"s3://{bucket}/cli/")
    assert again.returncode == 1 and "list-imports" in again.stderr

    nobody = cli(s3_api, "tenants", "allow-import", "nobody", f"s3://{bucket}/x/")
    assert nobody.returncode == 1 and "keys create --tenant nobody" in nobody.stderr
    dots = cli(s3_api, "tenants", "allow-import", "cli-tenant", f"s3://{bucket}/a/../b/")
    assert dots.returncode == 2 and "'..'" in dots.stderr
    store = f"s3://{s3_api.store_bucket}/{STORE_PREFIX}"
    inside = cli(
        s3_api,
        "tenants",
        "allow-import",
        "cli-tenant",
        f"{store}objects/",
        env={"BNADAPT_STORE_URL": store},
    )
    assert inside.returncode == 1 and "never a source" in inside.stderr
    assert cli(s3_api, "tenants", "list-imports", "cli-tenant").stdout.split() == [
        f"s3://{bucket}/other/"
    ]


# -- a folder of images


def image(size: tuple[int, int], fmt: str, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


# A labelled folder where S3's key order and ImageFolder's differ twice: the class "cat-2"
# lists before "cat/" ('-' < '/'), and "cat/sub-x/" before "cat/sub/".
PETS = {
    "cat/b.jpg": image((8, 8), "JPEG", 1),
    "cat/a.PNG": image((8, 8), "PNG", 2),
    "cat/c.jpg": image((6, 6), "JPEG", 3),
    "cat/sub/z.jpg": image((8, 8), "JPEG", 4),
    "cat/sub-x/y.png": image((8, 8), "PNG", 5),
    "cat/notes.txt": b"not an image",
    "cat-2/e.png": image((8, 8), "PNG", 6),
    "dog/d.jpeg": image((8, 8), "JPEG", 7),
    "README.md": b"a file beside the class folders is ignored",
}


def imagefolder_order(root: Path) -> list[tuple[str, int]]:
    """(path relative to ``root``, class) of torchvision's ImageFolder (``find_classes`` and
    ``make_dataset``), for JPEG and PNG files."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    samples = []
    for label, name in enumerate(classes):
        for folder, _, files in sorted(os.walk(root / name)):
            for file in sorted(files):
                if file.lower().endswith((".jpg", ".jpeg", ".png")):
                    samples.append((str(Path(folder, file).relative_to(root)), label))
    return samples


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(body)
    return root


@pytest.mark.zoo
def test_the_order_is_imagefolders(tmp_path: Path) -> None:
    """The rule this file's tests expect is torchvision's own, where torchvision is installed."""
    datasets = pytest.importorskip("torchvision.datasets")
    root = write_tree(tmp_path, PETS)
    expected = [(str(root / name), label) for name, label in imagefolder_order(root)]
    assert datasets.ImageFolder(str(root)).samples == expected


def test_a_folder_of_images_registers_as_a_tar_in_imagefolder_order(
    s3_api: S3Api, tmp_path: Path
) -> None:
    tenant, client = s3_api.tenant("folders")
    bucket = s3_api.source_bucket
    for name, body in PETS.items():
        s3_api.put(f"pets/{name}", body)
    s3_api.allow(tenant, f"s3://{bucket}/pets/")
    spec = {"resize": [8, 8]}  # one image is 6 x 6

    dataset = created(import_(client, f"s3://{bucket}/pets/", preprocessing=spec))
    expected = imagefolder_order(write_tree(tmp_path, PETS))
    assert [label for _, label in expected] == [0, 0, 0, 0, 0, 1, 2]
    assert (dataset["name"], dataset["format"], dataset["num_samples"]) == ("pets", "tar", 7)
    assert (dataset["has_labels"], dataset["num_classes"]) == (True, 3)
    assert dataset["preprocessing"]["resize"] == [8, 8]

    # The stored tar holds each image's bytes, in ImageFolder's order, with its class.
    tar = tmp_path / "stored.tar"
    tar.write_bytes(s3_api.stored(dataset["sha256"]))
    index = index_tar(tar)
    assert index.labels is not None
    assert index.labels.tolist() == [label for _, label in expected]
    data = tar.read_bytes()
    stored = [data[o : o + s] for o, s in zip(index.offsets, index.sizes, strict=True)]
    assert stored == [PETS[name] for name, _ in expected]

    # A flat folder is unlabelled.
    s3_api.put("flat/x.jpg", image((8, 8), "JPEG", 8))
    s3_api.put("flat/y.png", image((8, 8), "PNG", 9))
    s3_api.allow(tenant, f"s3://{bucket}/flat/")
    flat = created(import_(client, f"s3://{bucket}/flat/", name="night"))
    assert (flat["name"], flat["num_samples"], flat["has_labels"]) == ("night", 2, False)


def test_folders_that_break_a_rule_are_refused(s3_api: S3Api) -> None:
    tenant, client = s3_api.tenant("bad-folders")
    bucket = s3_api.source_bucket
    png = image((8, 8), "PNG", 0)
    cases = {
        "mixed/": ({"top.png": png, "cls/a.png": png}, 422, "both directly and in folders"),
        "hollow/": ({"a/x.png": png, "CONFIDENT/readme.txt": b"x"}, 422, "class folder 0"),
        "webp/": ({"a.webp": b"RIFF", "b.png": png}, 422, ".webp"),
        "classes/": ({f"c{i}/x.png": png for i in range(6)}, 413, "BNADAPT_MAX_CLASSES"),
        "huge/": ({f"{i}.png": os.urandom(800_000) for i in range(3)}, 413, "_DATASET_BYTES"),
    }
    for prefix, (files, status, phrase) in cases.items():
        for name, body in files.items():
            s3_api.put(f"bad/{prefix}{name}", body)
        s3_api.allow(tenant, f"s3://{bucket}/bad/{prefix}")
        response = import_(client, f"s3://{bucket}/bad/{prefix}")
        assert response.status_code == status, (prefix, response.text)
        assert phrase in response.json()["detail"], (prefix, response.text)
        assert "CONFIDENT" not in response.text
    # An empty or absent folder, or one not allowed, is as absent as a missing object.
    s3_api.allow(tenant, f"s3://{bucket}/bad/")
    refused(import_(client, f"s3://{bucket}/bad/nothing/"))
    refused(import_(client, f"s3://{bucket}/pets/"))
    # The store's own prefix, even inside an allowed bucket, is never walked.
    s3_api.allow(tenant, f"s3://{s3_api.store_bucket}/")
    refused(import_(client, f"s3://{s3_api.store_bucket}/{STORE_PREFIX}"))
    refused(import_(client, f"s3://{s3_api.store_bucket}/{STORE_PREFIX}objects/"))
    assert client.http.get("/v1/datasets").json()["items"] == []
