"""Scanning a tar of many tiny members holds bounded memory (NOTE [ Image datasets ] in
service/formats/images.py): neither registration's scan nor a worker's index keeps a header per
member. Measured with tracemalloc on a real tar of 50,000 members (tarfile parses about 20,000
headers a second here, three times slower traced: a larger tar only makes the test longer, the
bound does not grow with it)."""

from __future__ import annotations

import io
import tarfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from api_schemas.datasets import Preprocessing
from service.formats.images import describe_tar, index_tar

# 50,000 headers parsed under tracemalloc, twice: outside the quick tier.
pytestmark = pytest.mark.slow

TINY_MEMBERS = 50_000
# What a scan may allocate. Keeping every member's header took 22 MB for this tar (TarInfo
# objects and their names; 90 MB for 200,000 members); one at a time it is under 1 MiB.
PEAK_BOUND_BYTES = 4 * 1024 * 1024


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def many_members(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two labelled images, then 200,000 tiny side members (captions, which scans skip)."""
    path = tmp_path_factory.mktemp("tar") / "many.tar"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for i in range(2):
            for name, data in ((f"img{i}.png", png(i)), (f"img{i}.cls", str(i).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
        end = archive.offset  # where the end-of-archive blocks begin
    labelled = buffer.getvalue()[:end]
    with path.open("wb") as file:  # the side members, written faster than tarfile would
        file.write(labelled)
        file.writelines(caption(i) for i in range(TINY_MEMBERS))
        file.write(bytes(2 * tarfile.BLOCKSIZE))
    return path


def caption(i: int) -> bytes:
    """A one-byte member ``captions/cNNNNNN.txt``: its USTAR header and data block."""
    header = bytearray(tarfile.BLOCKSIZE)
    header[0:20] = f"captions/c{i:06d}.txt".encode()
    header[100:108] = b"0000644\0"  # mode
    header[108:124] = b"0000000\x000000000\0"  # uid, gid
    header[124:136] = b"00000000001\0"  # size
    header[136:148] = b"00000000000\0"  # mtime
    header[148:156] = b" " * 8  # the checksum counts its own field as spaces
    header[156:157] = tarfile.REGTYPE
    header[257:265] = tarfile.POSIX_MAGIC
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    return bytes(header) + b"x" + bytes(tarfile.BLOCKSIZE - 1)


def peak_bytes(scan: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        scan()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_registration_scan_keeps_no_header_per_member(many_members: Path) -> None:
    facts = None

    def scan() -> None:
        nonlocal facts
        facts = describe_tar(
            many_members, Preprocessing(), max_pixels=1 << 20, max_classes=10, max_elements=1 << 20
        )

    peak = peak_bytes(scan)
    assert facts is not None
    assert (facts.num_samples, facts.num_classes) == (2, 2)
    assert peak < PEAK_BOUND_BYTES, f"peak {peak} bytes scanning {TINY_MEMBERS} members"


def test_a_workers_index_keeps_no_header_per_member(many_members: Path) -> None:
    found = []
    peak = peak_bytes(lambda: found.append(index_tar(many_members)))
    assert found[0].keys == ["img0", "img1"]
    assert found[0].labels is not None and found[0].labels.tolist() == [0, 1]
    assert peak < PEAK_BOUND_BYTES, f"peak {peak} bytes indexing {TINY_MEMBERS} members"
