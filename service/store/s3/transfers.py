"""The S3 store's transfer engine: an object sent in parts, ``parts_in_flight`` at once, as a
multipart upload that is invisible until completed; an object fetched in ranged GETs into a
file, hashed on the way; server-side copies; an object's body read as a file.

# NOTE [ Downloading into the cache ]
A download is one pass over the bytes: the object is fetched in ranged GETs of ``part_bytes``,
``parts_in_flight`` at once (boto3's managed download does the same), and one thread takes
the parts in order, feeds each to the sha256 and appends it to the cache's temp file while
the next ones are on the wire; at most ``parts_in_flight + 1`` parts are in memory. One writer:
threads writing their parts at their offsets in the same file contend for its inode lock,
which cost more CPU than the whole hash here. The file is installed under its name only if
the digest matches (NOTE [ Object cache ] in service/store/cache.py); otherwise the temp file
is removed and the read fails. Hashing the file after a download would read it all a second
time (bench/history/2026-12-03-s3-store-reads-hashed-as-they.md; figure `s3-read` in
bench/RESULTS.md).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import io
import os
from pathlib import Path
from typing import Any, BinaryIO, Final, NamedTuple

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import (
    ClientError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from service.errors import StoreError
from service.store.s3.client import S3Bucket, over_tls

__all__ = ["MAX_PARTS", "BodyReader", "FileRange", "PartUpload", "Transfers"]

# S3's limit on the parts of one multipart upload.
MAX_PARTS: Final = 10_000
# A ranged GET whose body breaks off is sent again, up to this many times in all (what
# s3transfer's downloads do: its S3_RETRYABLE_DOWNLOAD_ERRORS).
_READ_ATTEMPTS: Final = 5
_BROKEN_READ: Final = (OSError, ReadTimeoutError, IncompleteReadError, ResponseStreamingError)
# A downloaded part goes to the cache file in writes of this size: one write() of a whole
# 16 MiB part cost several times the CPU of the same bytes in 256 KiB writes, more than the
# sha256 of the part (bench/history/2026-12-03-s3-store-reads-hashed-as-they.md).
_WRITE_SLICE: Final = 256 * 1024
# Copies up to this size are one CopyObject request (S3's limit is 5 GiB); larger ones are
# multipart copies.
_COPY_SINGLE_MAX: Final = 4 * 1024**3
_COPY_PART: Final = 512 * 1024**2
# A part read from a file goes straight into the bytearray that is sent (see FileRange).
_CAN_READ_INTO: Final = hasattr(os, "preadv")


class BodyReader(io.RawIOBase):
    """A botocore streaming body as a raw binary file, for ``io.BufferedReader``."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


class FileRange(NamedTuple):
    """Bytes ``[offset, offset + size)`` of an open file, read by the thread that sends them."""

    fd: int
    offset: int
    size: int

    def read(self, as_bytes: bool) -> bytes | bytearray:
        if as_bytes or not _CAN_READ_INTO:
            data: bytes | bytearray = os.pread(self.fd, self.size, self.offset)
        else:
            data = bytearray(self.size)
            got = os.preadv(self.fd, [data], self.offset)
            del data[got:]
        if len(data) != self.size:
            raise StoreError(
                f"read {len(data)} bytes at offset {self.offset} of a cache file, expected "
                f"{self.size}: the file was changed while it was uploaded; write it again"
            )
        return data


class PartUpload:
    """A multipart upload to one key, invisible in the bucket until :meth:`complete` and gone
    after :meth:`abort`. Its parts are sent by ``parts_in_flight`` threads; at most that many
    are in memory or on the wire at once (:meth:`send` waits for a free one)."""

    def __init__(self, transfers: Transfers, key: str) -> None:
        self._transfers = transfers
        self._s3 = transfers.s3
        self._key = key
        self._upload_id: str | None = self._s3.client().create_multipart_upload(
            Bucket=self._s3.name, Key=key
        )["UploadId"]
        self._pool = concurrent.futures.ThreadPoolExecutor(transfers.parts_in_flight)
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        # Over plain HTTP a bytearray body is sent as it is, over HTTPS bytes are (see
        # the S3 writer's _take_buffer in service/store/s3/store.py).
        self.tls = over_tls(self._s3.client())

    def send(self, part: bytes | bytearray | FileRange) -> None:
        transfers = self._transfers
        if len(self._parts) >= MAX_PARTS:
            raise StoreError(
                f"object needs more than {MAX_PARTS} parts of {transfers.part_bytes} bytes; "
                "raise BNADAPT_S3_PART_BYTES"
            )
        pending = [f for f in self._parts if not f.done()]
        if len(pending) >= transfers.parts_in_flight:
            concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in self._parts:
            if future.done():
                future.result()  # an upload that failed fails the write now
        number = len(self._parts) + 1
        self._parts.append(self._pool.submit(self._upload_part, number, part))

    def _upload_part(self, number: int, part: bytes | bytearray | FileRange) -> dict[str, Any]:
        body = part.read(self.tls) if isinstance(part, FileRange) else part
        reply = self._s3.client().upload_part(
            Bucket=self._s3.name,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
        )
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def close_pool(self) -> None:
        self._pool.shutdown(wait=True)

    def complete(self) -> None:
        parts = [future.result() for future in self._parts]
        self._s3.client().complete_multipart_upload(
            Bucket=self._s3.name,
            Key=self._key,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": parts},
        )
        self._upload_id = None

    def abort(self) -> None:
        for future in self._parts:
            future.cancel()
        self._pool.shutdown(wait=True)
        if self._upload_id is not None:
            with contextlib.suppress(ClientError):
                self._s3.client().abort_multipart_upload(
                    Bucket=self._s3.name, Key=self._key, UploadId=self._upload_id
                )


class Transfers:
    """How the store moves an object's bytes to and from ``s3``: in parts of ``part_bytes``,
    ``parts_in_flight`` at once."""

    def __init__(self, s3: S3Bucket, part_bytes: int, parts_in_flight: int) -> None:
        self.s3 = s3
        self.part_bytes = part_bytes
        self.parts_in_flight = parts_in_flight
        self._copy_config = TransferConfig(
            multipart_threshold=_COPY_SINGLE_MAX,
            multipart_chunksize=_COPY_PART,
            max_concurrency=max(parts_in_flight, 4),
        )

    def upload_file(self, path: Path, key: str) -> None:
        """Uploads the file at ``path`` to ``key`` in parts, each read from the file by the
        thread that sends it; nothing appears under ``key`` unless every part arrived."""
        # From an open file: a part read by name could miss a temp file unlinked meanwhile.
        with path.open("rb", buffering=0) as file:
            fd = file.fileno()
            size = os.fstat(fd).st_size
            upload = PartUpload(self, key)
            try:
                for offset in range(0, size, self.part_bytes):
                    upload.send(FileRange(fd, offset, min(self.part_bytes, size - offset)))
                upload.close_pool()
                upload.complete()
            except BaseException:
                upload.abort()
                raise

    def copy(self, source_bucket: str, source_key: str, key: str) -> None:
        """Copies an object server-side to ``key``: one request up to 4 GiB, parts past it."""
        self.s3.client().copy(
            {"Bucket": source_bucket, "Key": source_key},
            self.s3.name,
            key,
            Config=self._copy_config,
        )

    def download(self, key: str, size: int, file: BinaryIO) -> str:
        """Fills ``file`` with the ``size`` bytes of the object under ``key`` in ranged GETs,
        ``parts_in_flight`` at once, and returns the sha256 of the bytes that came (NOTE
        [ Downloading into the cache ])."""
        part = self.part_bytes
        starts = range(0, size, part)
        digest = hashlib.sha256()
        pool = concurrent.futures.ThreadPoolExecutor(self.parts_in_flight)
        try:
            pending: collections.deque[concurrent.futures.Future[bytes]] = collections.deque()
            queued = iter(starts)
            for _ in starts:
                # Part i is hashed while parts up to i + parts_in_flight - 1 arrive: at most
                # parts_in_flight + 1 parts in memory.
                while len(pending) < self.parts_in_flight:
                    start = next(queued, None)
                    if start is None:
                        break
                    end = min(start + part, size)
                    pending.append(pool.submit(self._fetch_range, key, start, end))
                data = pending.popleft().result()
                digest.update(data)
                with memoryview(data) as view:
                    for offset in range(0, len(view), _WRITE_SLICE):
                        file.write(view[offset : offset + _WRITE_SLICE])
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return digest.hexdigest()

    def _fetch_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object; a connection that breaks mid-body is tried
        again (botocore retries only the request)."""
        for attempt in range(1, _READ_ATTEMPTS + 1):
            try:
                reply = self.s3.client().get_object(
                    Bucket=self.s3.name, Key=key, Range=f"bytes={start}-{end - 1}"
                )
                with contextlib.closing(reply["Body"]) as body:
                    data: bytes = body.read()
                break
            except _BROKEN_READ:
                if attempt == _READ_ATTEMPTS:
                    raise
        if len(data) != end - start:
            raise StoreError(
                f"s3://{self.s3.name}/{key}: asked for bytes {start}-{end - 1}, got {len(data)} "
                "bytes; the object changed during the download; try again"
            )
        return data
