"""The content-addressed store, on a real directory: atomicity, limits, dedupe, ids."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.errors import (
    BnadaptError,
    ObjectNotFoundError,
    StoreDigestMismatchError,
    StoreError,
    StoreTooLargeError,
)
from service.store.base import Store, check_sha256
from service.store.local import LocalStore


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_chunks(store: Store, chunks: list[bytes], max_bytes: int | None = None) -> str:
    with store.writer(max_bytes) as writer:
        for chunk in chunks:
            writer.write(chunk)
    return writer.sha256


def test_put_bytes_layout_and_reads(store: LocalStore) -> None:
    digest = store.put_bytes(b"hello")
    assert digest == sha(b"hello")
    expected = store.root / "objects" / digest[:2] / digest
    assert files_under(store.root) == [expected]
    assert store.exists(digest)
    assert store.local_path(digest) == expected
    with store.open(digest) as file:
        assert file.read() == b"hello"


def test_constructing_touches_nothing(tmp_path: Path) -> None:
    LocalStore(tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_is_a_store(store: LocalStore) -> None:
    as_protocol: Store = store  # mypy checks that LocalStore satisfies Store
    assert as_protocol.put_bytes(b"") == sha(b"")


def test_writer_hashes_chunks(store: LocalStore) -> None:
    chunks = [b"a" * 1000, b"", b"b" * 3, os.urandom(70_000)]
    with store.writer() as writer:
        for chunk in chunks:
            writer.write(chunk)
        assert writer.size == 71_003
        with pytest.raises(RuntimeError, match="only after"):
            _ = writer.sha256
    assert writer.sha256 == sha(b"".join(chunks))
    assert writer.size == 71_003
    assert store.local_path(writer.sha256).read_bytes() == b"".join(chunks)
    with pytest.raises(ValueError, match="after its `with` block ended"):
        writer.write(b"late")


def test_exception_in_writer_leaves_nothing(store: LocalStore) -> None:
    def fail_midway() -> None:
        with store.writer() as writer:
            writer.write(b"partial")
            raise KeyError("client went away")

    with pytest.raises(KeyError):
        fail_midway()
    assert not store.exists(sha(b"partial"))
    assert files_under(store.root) == []


def test_crashed_writer_leaves_only_a_temp_file(store: LocalStore) -> None:
    # A real crash: the process dies inside the `with` block, no cleanup runs.
    code = (
        "import os, sys; from pathlib import Path; from service.store.local import LocalStore\n"
        "with LocalStore(Path(sys.argv[1])).writer() as w:\n"
        "    w.write(b'partial'); os._exit(3)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(store.root)], cwd=Path(__file__).parents[3], check=False
    )
    assert result.returncode == 3
    leftovers = files_under(store.root)
    assert [p.parent.name for p in leftovers] == ["tmp"]
    assert not store.exists(sha(b"partial"))
    assert store.cleanup_tmp(older_than_s=3600) == 0  # too recent: may be a live upload
    assert store.cleanup_tmp(older_than_s=0) == 1
    assert files_under(store.root) == []


def test_cleanup_tmp_by_age(store: LocalStore) -> None:
    assert store.cleanup_tmp() == 0  # no tmp directory yet
    store.put_bytes(b"committed")
    tmp = store.root / "tmp"
    old, fresh, other = tmp / "old.part", tmp / "fresh.part", tmp / "notes.txt"
    for path in (old, fresh, other):
        path.write_bytes(b"x")
    day_ago = time.time() - 86_400
    os.utime(old, (day_ago, day_ago))
    os.utime(other, (day_ago, day_ago))
    assert store.cleanup_tmp(older_than_s=3600) == 1
    assert not old.exists()
    assert fresh.exists()
    assert other.exists()  # not ours
    assert store.exists(sha(b"committed"))


def test_size_limit(store: LocalStore) -> None:
    with store.writer(max_bytes=10) as writer:
        writer.write(b"12345")
        writer.write(b"67890")
    assert writer.size == 10
    with pytest.raises(StoreTooLargeError, match=r"limit of 10 bytes .* at least 11"):
        write_chunks(store, [b"12345", b"678901"], max_bytes=10)
    assert files_under(store.root / "tmp") == []
    assert not store.exists(sha(b"12345678901"))
    assert not store.exists(sha(b"12345"))


def test_size_limit_error_caught_in_block_still_fails(store: LocalStore) -> None:
    def swallow_error() -> None:
        with store.writer(max_bytes=4) as writer:
            writer.write(b"abc")
            with pytest.raises(StoreTooLargeError):
                writer.write(b"defg")
            # Swallowing the error must not commit the truncated "abc".

    with pytest.raises(StoreTooLargeError):
        swallow_error()
    assert not store.exists(sha(b"abc"))
    assert files_under(store.root) == []


def test_an_announced_digest_is_checked(store: LocalStore) -> None:
    with store.writer(sha256=sha(b"right")) as writer:
        writer.write(b"right")
    assert store.exists(sha(b"right"))
    with pytest.raises(StoreDigestMismatchError, match=sha(b"wrong")):
        write_chunks_announced(store, b"wrong", sha(b"other"))
    assert not store.exists(sha(b"wrong"))
    assert not store.exists(sha(b"other"))
    assert files_under(store.root / "tmp") == []
    with pytest.raises(ValueError, match="not a sha256"):
        write_chunks_announced(store, b"x", "ABC")


def write_chunks_announced(store: Store, data: bytes, sha256: str) -> None:
    with store.writer(sha256=sha256) as writer:
        writer.write(data)


def test_negative_limit(store: LocalStore) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        write_chunks(store, [], max_bytes=-1)


def test_dedupe(store: LocalStore) -> None:
    first = store.put_bytes(b"same")
    assert write_chunks(store, [b"sa", b"me"]) == first
    assert len(files_under(store.root)) == 1
    assert files_under(store.root / "tmp") == []


def test_objects_are_readable_by_others(store: LocalStore) -> None:
    previous = os.umask(0o022)
    try:
        digest = store.put_bytes(b"shared")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE(store.local_path(digest).stat().st_mode)
    assert mode == 0o644


def test_missing_object(store: LocalStore) -> None:
    missing = sha(b"never stored")
    assert not store.exists(missing)
    with pytest.raises(ObjectNotFoundError, match=missing):
        store.open(missing)
    with pytest.raises(ObjectNotFoundError):
        store.local_path(missing)


def test_a_removed_object_can_be_written_again(store: LocalStore) -> None:
    digest = store.put_bytes(b"bye")
    assert store.remove_unused(digest, time.time() + 60, lambda sha: False)
    assert not store.exists(digest)
    assert not store.remove_unused(digest, time.time() + 60, lambda sha: False)
    assert store.put_bytes(b"bye") == digest
    assert store.exists(digest)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "ab",
        "AB" * 32,
        "ab" * 32 + "\n",
        "ab" * 32 + "a",
        "g" * 64,
        "../" + "a" * 61,
        "a" * 62 + "/x",
    ],
)
def test_bad_sha256(store: LocalStore, bad: str) -> None:
    def remove(sha256: str) -> bool:
        return store.remove_unused(sha256, time.time(), lambda sha: False)

    for method in (store.open, store.local_path, store.exists, remove):
        with pytest.raises(ValueError, match="64 lowercase hexadecimal"):
            method(bad)
    with pytest.raises(ValueError, match="not a sha256"):
        check_sha256(bad)


def test_error_tree() -> None:
    assert issubclass(StoreTooLargeError, StoreError)
    assert issubclass(ObjectNotFoundError, StoreError)
    assert issubclass(StoreError, BnadaptError)
