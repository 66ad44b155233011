""":class:`S3Store`, the :class:`~service.store.base.Store` in an S3-compatible bucket, and its
writer: how an object is committed under its content key, read, presigned, and adopted when
it reached the bucket without passing through this process.

# NOTE [ Atomic commit on S3 ]
A content key is only ever written whole, and only with bytes that hash to it:
- an object that fits in one part is PUT under its key once its sha256 is known (the part is
  in memory anyway);
- a larger one whose sha256 was announced before the write (``writer(sha256=...)``: a
  worker's ``put_bytes``, an upload whose client sent ``X-Content-SHA256``, a resumable
  upload completed with its ``sha256``) is uploaded in
  parts straight to its content key while it is hashed. A multipart upload is invisible
  until it is completed, and it is completed only if the bytes hashed to the announced
  digest; otherwise it is aborted and nothing appears. If the object is there already, the
  parts are not sent at all;
- a larger one whose sha256 is not known beforehand goes, while it is hashed, only to the
  writer's cache file (which every write fills anyway); once the write ends and the digest is
  known, that file is uploaded in parts to the content key, a multipart upload that is again
  invisible until completed whole (each part read from the file by the thread that sends it,
  into the buffer that is sent: no transfer manager's copies, the same signing as the
  announced path). The upload starts only after the last byte was written
  (no overlap with a slow sender), but nothing is copied on the server: the bytes cross the
  network and the server once, not twice as a temp key and a server-side copy would send
  them (bench/history/2026-12-03-s3-store-reads-hashed-as-they.md; figure
  `s3-write-no-digest` in bench/RESULTS.md).
Objects that reach the bucket without this process (direct uploads, imports) land on a temp
key, are hashed, and are copied server-side to their content key (:meth:`S3Store._adopt_temp`).
A reader never sees a partial object under a content key, and a writer that dies leaves only
a temp key or an unfinished multipart upload, which :meth:`S3Store.cleanup_tmp` removes. Each
write is also kept in this machine's cache (NOTE [ Object cache ] in service/store/cache.py),
so whoever wrote an object reads it back without downloading it: the API reads an uploaded
dataset back to check it, and joins an upload's parts from their copies.

# NOTE [ Direct upload parts ]
A direct upload's presigned part URLs sign the bucket, key, upload and part number, and the
part's length: ``Content-Length`` is among the SigV4 signed headers of each URL (the length
``part_bytes``, the last part the rest), so the bucket refuses a PUT of any other length
(403, SignatureDoesNotMatch) before it keeps a byte; SeaweedFS does, as AWS S3 does. A store
that checks signatures less strictly could still take a part of another size, so before
completing, the parts the bucket lists (``ListParts``) are checked against the size announced
when the upload started too: one ETag per part, every part ``part_bytes`` long but the last,
which holds the rest, and none beyond. Anything else aborts the upload and is refused: nothing
is assembled, hashed or copied. The assembled object's size is checked again before it is
read, in case a part was sent again between the listing and the completion.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Final

import redis
from botocore.exceptions import ClientError

from service.errors import ObjectNotFoundError, StoreError, StoreTooLargeError
from service.settings import DEFAULT_S3_PART_BYTES, DEFAULT_S3_PARTS_IN_FLIGHT
from service.store.base import (
    DEFAULT_TMP_MAX_AGE_S,
    DirectUpload,
    HashingWriter,
    ObjectWriter,
    StoredObject,
)
from service.store.cache import ObjectCache
from service.store.s3.client import S3Bucket, not_found, over_tls, parse_s3_url
from service.store.s3.client import warm_up as warm_up_clients
from service.store.s3.collection import S3Collection
from service.store.s3.sources import S3SourceFolders
from service.store.s3.transfers import MAX_PARTS, BodyReader, PartUpload, Transfers

__all__ = ["S3Store"]

# The buffer of a reader that streams an object from the bucket.
_READ_CHUNK: Final = 8 * 1024 * 1024


class _S3Writer(HashingWriter):
    """Copies chunks to the cache file while it uploads them in parts to the object's content
    key when its digest was announced (a multipart upload is invisible until completed, and is
    completed only once the bytes hashed to that key). Without a digest, past one part, it only
    fills the cache file, which is uploaded once the digest is known (NOTE [ Atomic commit on
    S3 ])."""

    def __init__(
        self, store: S3Store, max_bytes: int | None, sha256: str | None, cache_file: BinaryIO
    ) -> None:
        super().__init__(max_bytes, sha256)
        self._store = store
        self._cache_file = cache_file
        # Pieces of the written chunks not yet sent, `_buffered` bytes: at most one part.
        self._pieces: list[memoryview] = []
        self._buffered = 0
        self._upload: PartUpload | None = None  # once the first part is sent
        self.already_there = False  # the announced object exists: nothing is uploaded
        # Digest unknown and more than one part: the whole object is in the cache file only.
        self.spooled = False
        self._tls = over_tls(store.client)

    def _put(self, chunk: bytes) -> None:
        self._cache_file.write(chunk)
        if self.already_there or self.spooled:
            return
        if self.expected_sha256 is None and self._buffered + len(chunk) > self._store.part_bytes:
            self.spooled = True
            self._drop_buffer()
            return
        if not isinstance(chunk, bytes):
            # Pieces of the chunk are held until their part is sent: a caller's buffer that
            # changed meanwhile would send other bytes than those hashed.
            chunk = bytes(chunk)
        part_bytes = self._store.part_bytes
        with memoryview(chunk) as view:
            taken = 0
            while taken < len(view) and not self.already_there:
                piece = view[taken : taken + part_bytes - self._buffered]
                self._pieces.append(piece)
                self._buffered += len(piece)
                taken += len(piece)
                # Without a digest, the object is one PUT: the check above spools it first.
                if self._buffered == part_bytes and self.expected_sha256 is not None:
                    self._send(self._take_buffer())

    def _take_buffer(self) -> bytes | bytearray:
        """The bytes buffered for the next part, joined (their one copy on this path).

        Over plain HTTP a bytearray: botocore wraps a bytes body in a ``BytesIO`` and reads
        it back in copies (1 MiB ones for its checksum, 128 KiB ones to send it), where it
        checksums and sends a bytearray as it is, in one ``sendall`` (those copies' CPU:
        bench/history/2026-12-03-s3-write-client-cpu-goes.md). Over HTTPS
        bytes: there botocore streams every body through a ``BytesIO`` to append its
        checksum as a trailer, and a ``BytesIO`` copies a bytearray where it shares bytes."""
        part = (b"" if self._tls else bytearray()).join(self._pieces)
        self._drop_buffer()
        return part

    def _drop_buffer(self) -> None:
        for piece in self._pieces:
            piece.release()
        self._pieces.clear()
        self._buffered = 0

    def _send(self, part: bytes | bytearray) -> None:
        """Sends a full part of an announced digest; the first one opens the multipart upload
        (an object of one part is one PUT, and asks nothing before)."""
        if self._upload is None:
            store = self._store
            assert self.expected_sha256 is not None  # else the write is spooled
            # Recorded before looking, so that a collection cannot take the object between
            # the look and the end of this write (NOTE [ Collecting an S3 store ]).
            store._collection.record_write(self.expected_sha256)
            if store.exists(self.expected_sha256):
                self.already_there = True
                self._drop_buffer()
                return
            self._upload = PartUpload(store._transfers, store.key(self.expected_sha256))
        self._upload.send(part)

    def finish(self) -> str:
        """Ends the write: the sha256 is known and checked; past one part of an announced
        digest, every part is uploaded (the upload is completed by :meth:`complete`, once the
        write is recorded)."""
        digest = super().finish()
        if self._upload is None:
            return digest  # one part (still in self._pieces), spooled, or already there
        if self._buffered:
            self._send(self._take_buffer())
        return digest

    def complete(self) -> None:
        assert self._upload is not None
        self._upload.complete()

    def take_single_part(self) -> bytes | bytearray | None:
        """The whole object, if it fits in one part (once)."""
        if self._upload is None and not self.already_there and not self.spooled:
            return self._take_buffer()
        return None

    def abort(self) -> None:
        if self._upload is not None:
            self._upload.abort()

    def close_pool(self) -> None:
        if self._upload is not None:
            self._upload.close_pool()


class S3Store:
    """A :class:`~service.store.base.Store` in ``s3://bucket/prefix``, with this machine's
    copies in ``cache`` and its write times in Redis (NOTE [ Collecting an S3 store ] in
    service/store/s3/collection.py).

    The boto3 clients are made on first use, and again in a forked child."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        cache: ObjectCache,
        redis_client: redis.Redis,
        part_bytes: int = DEFAULT_S3_PART_BYTES,
        parts_in_flight: int = DEFAULT_S3_PARTS_IN_FLIGHT,
        presign_ttl_s: int = 900,
        public_endpoint_url: str | None = None,
    ) -> None:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"prefix must be empty or end with '/', got {prefix!r}")
        self.bucket = bucket
        self.prefix = prefix
        self.cache = cache
        self.presign_ttl_s = presign_ttl_s
        self._public_endpoint_url = public_endpoint_url
        self._s3 = S3Bucket(bucket, prefix, parts_in_flight)
        self._transfers = Transfers(self._s3, part_bytes, parts_in_flight)
        self._collection = S3Collection(self._s3, cache, redis_client)

    def __repr__(self) -> str:
        return f"S3Store('s3://{self.bucket}/{self.prefix}', {self.cache!r})"

    def warm_up(self) -> None:
        """Loads boto3's S3 model and makes the client a forked job will use, without a
        request (:func:`service.store.s3.client.warm_up`)."""
        warm_up_clients(self.parts_in_flight)

    @property
    def part_bytes(self) -> int:
        """The size of every part of a transfer but the last."""
        return self._transfers.part_bytes

    @property
    def parts_in_flight(self) -> int:
        """Parts on the wire at once, per transfer."""
        return self._transfers.parts_in_flight

    # -- clients and keys

    @property
    def client(self) -> Any:
        """The boto3 S3 client of this process."""
        return self._s3.client()

    def key(self, sha256: str) -> str:
        return self._s3.object_key(sha256)

    def new_temp_key(self) -> str:
        return self._s3.new_temp_key()

    # -- writing

    @contextlib.contextmanager
    def writer(
        self, max_bytes: int | None = None, sha256: str | None = None
    ) -> Iterator[ObjectWriter]:
        with self.cache.new_file() as (cache_tmp, cache_file):
            writer = _S3Writer(self, max_bytes, sha256, cache_file)
            try:
                yield writer
                writer.finish()
                writer.close_pool()
                cache_file.close()
                data = writer.take_single_part()
                if data is not None:
                    self._install_bytes(data, writer.sha256)
                elif writer.already_there or writer.spooled:
                    self._install_file(cache_tmp, writer.sha256)
                else:
                    self._collection.record_write(writer.sha256)
                    writer.complete()
            except BaseException:
                writer.abort()
                raise
            self.cache.install(cache_tmp, writer.sha256)

    def _install_bytes(self, data: bytes | bytearray, sha256: str) -> None:
        self._collection.record_write(sha256)
        self.client.put_object(Bucket=self.bucket, Key=self.key(sha256), Body=data)

    def _install_file(self, cache_tmp: Path, sha256: str) -> None:
        """Records the write, and uploads the cache's temp file, whose bytes hashed to
        ``sha256`` as they were written, under its content key unless the object is there:
        a write of unknown digest past one part, or one whose announced object was there
        already (the recorded write keeps it for the grace period; should a collection have
        taken it meanwhile, a write longer than that, it is uploaded again). The parts are
        read from the file by the threads that send them (NOTE [ Atomic commit on S3 ])."""
        self._collection.record_write(sha256)
        if self.exists(sha256):
            return
        self._transfers.upload_file(cache_tmp, self.key(sha256))

    def _install_temp(self, temp_key: str, sha256: str) -> None:
        """Copies a complete temp object to its content key (unless it is there) and deletes
        the temp key."""
        try:
            self._collection.record_write(sha256)
            if not self.exists(sha256):
                self._transfers.copy(self.bucket, temp_key, self.key(sha256))
        finally:
            with contextlib.suppress(ClientError):
                self.client.delete_object(Bucket=self.bucket, Key=temp_key)

    def put_bytes(self, data: bytes) -> str:
        # The digest first: an object of several parts then goes straight to its content key.
        digest = hashlib.sha256(data).hexdigest() if len(data) > self.part_bytes else None
        with self.writer(sha256=digest) as writer:
            writer.write(data)
        return writer.sha256

    # -- reading

    def open(self, sha256: str) -> BinaryIO:
        cached = self.cache.get(sha256)
        if cached is not None:
            return cached.open("rb")
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key(sha256))
        except ClientError as exc:
            if not_found(exc):
                raise ObjectNotFoundError(self._missing(sha256)) from None
            raise
        return io.BufferedReader(BodyReader(reply["Body"]), _READ_CHUNK)

    def local_path(self, sha256: str) -> Path:
        """The cached copy, downloaded first if this machine has none (checked against its
        sha256 before it is used: NOTE [ Downloading into the cache ] in
        service/store/s3/transfers.py)."""
        cached = self.cache.get(sha256)
        if cached is not None:
            return cached
        key = self.key(sha256)
        try:
            size: int = self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        except ClientError as exc:
            if not_found(exc):
                raise ObjectNotFoundError(self._missing(sha256)) from None
            raise
        with self.cache.new_file() as (tmp, file):
            got = self._transfers.download(key, size, file)
            file.close()
            if got != sha256:
                raise StoreError(
                    f"the object s3://{self.bucket}/{self.key(sha256)} holds bytes whose sha256 "
                    f"is {got}: it was changed outside bnadapt; delete it and upload the file "
                    "again"
                )
            return self.cache.install(tmp, sha256)

    def pinning(self) -> contextlib.AbstractContextManager[None]:
        return self.cache.pinning()

    def exists(self, sha256: str) -> bool:
        return self._s3.has_object(sha256)

    def _missing(self, sha256: str) -> str:
        return f"no object {sha256} in s3://{self.bucket}/{self.prefix}"

    def download_url(self, sha256: str, filename: str) -> str | None:
        """A presigned GET of the object, valid ``presign_ttl_s``."""
        client = self._s3.client(self._public_endpoint_url)
        url: str = client.generate_presigned_url(
            "get_object",
            Params={
                "Bucket": self.bucket,
                "Key": self.key(sha256),
                "ResponseContentDisposition": f'attachment; filename="{filename}"',
                "ResponseContentType": "application/octet-stream",
            },
            ExpiresIn=self.presign_ttl_s,
        )
        return url

    # -- objects that reach the bucket without passing through this process

    def start_direct_upload(self, size: int) -> DirectUpload:
        """A multipart upload of ``size`` bytes to a temp key, with a presigned URL per part
        that takes only its length (``part_bytes``, the last one the rest)."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        count = -(-size // self.part_bytes)
        if count > MAX_PARTS:
            raise StoreError(
                f"{size} bytes need {count} parts of {self.part_bytes} bytes, over S3's "
                f"{MAX_PARTS}; raise BNADAPT_S3_PART_BYTES"
            )
        temp_key = self.new_temp_key()
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=temp_key)[
            "UploadId"
        ]
        presigner = self._s3.client(self._public_endpoint_url)
        urls = [
            presigner.generate_presigned_url(
                "upload_part",
                Params={
                    "Bucket": self.bucket,
                    "Key": temp_key,
                    "UploadId": upload_id,
                    "PartNumber": number,
                    # Signed: a PUT of another length is refused (NOTE [ Direct upload parts ]).
                    "ContentLength": min(self.part_bytes, size - self.part_bytes * (number - 1)),
                },
                ExpiresIn=self.presign_ttl_s,
            )
            for number in range(1, count + 1)
        ]
        return DirectUpload(upload_id, temp_key, self.part_bytes, urls)

    def finish_direct_upload(
        self, upload: DirectUpload, etags: list[str], max_bytes: int | None, size: int
    ) -> tuple[str, int]:
        """Completes the upload of the ``size`` bytes announced with the parts' ETags (in
        order), then checks and installs it like any write; returns (sha256, size). The parts
        the bucket holds are checked against ``size`` first (NOTE [ Direct upload parts ]):
        a part of another length, or a missing one, is a ``StoreError`` and nothing is
        assembled or copied."""
        try:
            self._check_parts(upload, len(etags), size)
        except StoreError:
            with contextlib.suppress(ClientError):
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=upload.temp_key, UploadId=upload.upload_id
                )
            raise
        parts = [{"PartNumber": i, "ETag": etag} for i, etag in enumerate(etags, start=1)]
        try:
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=upload.temp_key,
                UploadId=upload.upload_id,
                MultipartUpload={"Parts": parts},
            )
        except ClientError as exc:
            raise StoreError(
                f"the bucket refused to complete the upload ({exc}); send every part to its "
                "URL and list the ETags the bucket answered, in part order"
            ) from exc
        return self._adopt_temp(upload.temp_key, max_bytes, size)

    def _check_parts(self, upload: DirectUpload, etag_count: int, size: int) -> None:
        """NOTE [ Direct upload parts ]: every part the bucket holds has the length that
        ``size`` gives it (``part_bytes``, the last one the rest), and one ETag came for each."""
        count = -(-size // upload.part_bytes)
        if etag_count != count:
            raise StoreError(
                f"the upload announced {size} bytes, {count} parts of {upload.part_bytes} "
                f"bytes, but {etag_count} ETags were sent; send every part to its URL and list "
                "the ETags the bucket answered, in part order"
            )
        listed = self._listed_parts(upload)
        for number in range(1, count + 1):
            expected = (
                upload.part_bytes if number < count else size - upload.part_bytes * (count - 1)
            )
            got = listed.get(number)
            if got is None:
                raise StoreError(
                    f"part {number} of the upload never reached the bucket; send it to its URL, "
                    "then complete the upload"
                )
            if got != expected:
                raise StoreError(
                    f"part {number} holds {got} bytes where the {size} bytes announced give it "
                    f"{expected}; nothing was registered: start a new upload, sending each "
                    f"part as {upload.part_bytes} bytes of the file (the last one the rest)"
                )
        extra = sorted(set(listed) - set(range(1, count + 1)))
        if extra:
            raise StoreError(
                f"the bucket holds parts {extra[:5]} beyond the {count} the upload announced; "
                "start a new upload"
            )

    def _listed_parts(self, upload: DirectUpload) -> dict[int, int]:
        """Part number -> bytes, of the parts the bucket holds for ``upload``."""
        found: dict[int, int] = {}
        marker = 0
        while True:
            try:
                reply = self.client.list_parts(
                    Bucket=self.bucket,
                    Key=upload.temp_key,
                    UploadId=upload.upload_id,
                    PartNumberMarker=marker,
                )
            except ClientError as exc:
                raise StoreError(
                    f"the bucket has no such upload in progress ({exc}); start a new upload"
                ) from exc
            for part in reply.get("Parts", ()):
                found[int(part["PartNumber"])] = int(part["Size"])
            if not reply.get("IsTruncated"):
                return found
            marker = int(reply["NextPartNumberMarker"])

    def owns(self, bucket: str, key: str) -> bool:
        """Whether ``s3://bucket/key`` is under this store's prefix: never a source to import
        from (NOTE [ Import sources ] in service/records/tenancy/import_sources.py)."""
        return bucket == self.bucket and key.startswith(self.prefix)

    def import_object(self, url: str, max_bytes: int | None) -> tuple[str, int]:
        """Copies ``s3://bucket/key`` (readable with this store's credentials) server-side to
        a temp key, then checks and installs it like any write; returns (sha256, size).
        ``ObjectNotFoundError`` if it is absent, unreadable, or under this store's prefix."""
        bucket, key = parse_s3_url(url)
        key = key.rstrip("/")
        if not key:
            raise ValueError(f"{url!r} names a bucket, not an object: write s3://BUCKET/KEY")
        if self.owns(bucket, key):
            raise ObjectNotFoundError(f"{url} is in the store itself, never a source")
        try:
            head = self.client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            raise ObjectNotFoundError(f"cannot read {url}: {exc}") from exc
        _check_size(head["ContentLength"], max_bytes)
        temp_key = self.new_temp_key()
        try:
            self._transfers.copy(bucket, key, temp_key)
        except ClientError as exc:
            raise StoreError(f"cannot copy {url} into the store: {exc}") from exc
        return self._adopt_temp(temp_key, max_bytes)

    def source_folders(self, bucket: str) -> S3SourceFolders:
        """``bucket`` as folders of objects to import, without this store's own."""
        return S3SourceFolders(self.client, bucket, self.owns)

    def _adopt_temp(
        self, temp_key: str, max_bytes: int | None, announced: int | None = None
    ) -> tuple[str, int]:
        """Hashes a complete temp object into this machine's cache, installs it under its
        content key (NOTE [ Atomic commit on S3 ]) and deletes the temp key; an object of
        other than the ``announced`` size is refused before any of it is read."""
        try:
            size: int = self.client.head_object(Bucket=self.bucket, Key=temp_key)["ContentLength"]
            _check_size(size, max_bytes)
            if announced is not None and size != announced:
                raise StoreError(
                    f"the upload holds {size} bytes but {announced} were announced; nothing "
                    "was registered: start a new upload"
                )
            with self.cache.new_file() as (cache_tmp, file):
                sha256 = self._transfers.download(temp_key, size, file)
                file.close()
                self._install_temp(temp_key, sha256)
                self.cache.install(cache_tmp, sha256)
            return sha256, size
        finally:
            with contextlib.suppress(ClientError):
                self.client.delete_object(Bucket=self.bucket, Key=temp_key)

    # -- collection (service/store/s3/collection.py)

    def objects(self) -> Iterator[StoredObject]:
        return self._collection.objects()

    def remove_unused(self, sha256: str, cutoff: float, in_use: Callable[[str], bool]) -> bool:
        return self._collection.remove_unused(sha256, cutoff, in_use)

    def settle_trash(self, cutoff: float, in_use: Callable[[str], bool]) -> int:
        return self._collection.settle_trash(cutoff)

    def cleanup_tmp(self, older_than_s: float = DEFAULT_TMP_MAX_AGE_S) -> int:
        return self._collection.cleanup_tmp(older_than_s)


def _check_size(size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise StoreTooLargeError(
            f"object is larger than the limit of {max_bytes} bytes ({size} bytes); nothing was "
            "stored: send a smaller file"
        )
