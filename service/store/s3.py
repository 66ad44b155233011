"""The content-addressed store in an S3-compatible bucket (AWS S3, MinIO, SeaweedFS, Ceph, R2).

Keys under the prefix (``s3://BUCKET/PREFIX``)::

    objects/<sha256>   committed objects, never modified
    tmp/<random>       objects that reached the bucket directly, being checked

Bookkeeping (references, release and write times, deletion markers, the collector's lock)
lives in Redis, never in the bucket. boto3 is imported only when this module is, and
:func:`service.store.open_store` imports it only for an ``s3://`` store: an API on a local
store starts without it.

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
  network and the server once, not twice as with a temp key and a server-side copy (what
  this path did before, bench/RESULTS.md, "S3 store").
Objects that reach the bucket without this process (direct uploads, imports) land on a temp
key, are hashed, and are copied server-side to their content key (:meth:`S3Store._adopt_temp`).
A reader never sees a partial object under a content key, and a writer that dies leaves only
a temp key or an unfinished multipart upload, which :meth:`S3Store.cleanup_tmp` removes. Each
write is also kept in this machine's cache (NOTE [ Object cache ] in service/store/cache.py),
so whoever wrote an object reads it back without downloading it: the API reads an uploaded
dataset back to check it, and joins an upload's parts from their copies.

# NOTE [ Downloading into the cache ]
A download is one pass over the bytes: the object is fetched in ranged GETs of ``part_bytes``,
``parts_in_flight`` at once (boto3's managed download does the same), and one thread takes
the parts in order, feeds each to the sha256 and appends it to the cache's temp file while
the next ones are on the wire; at most ``parts_in_flight + 1`` parts are in memory. One writer:
threads writing their parts at their offsets in the same file contend for its inode lock,
which cost more CPU than the whole hash here. The file is installed under its name only if
the digest matches (NOTE [ Object cache ] in cache.py); otherwise the temp file is removed
and the read fails. Hashing the file after a download would read it all a second time
(bench/RESULTS.md, "S3 store").

# NOTE [ What checks the bytes of a part ]
An object's bytes are checked three times: the writer hashes them as they are written (the
content key is that sha256, and a mismatch with an announced digest stores nothing); the
server checks each request's body against a checksum sent with it before it keeps it; and a
download into a cache is hashed again (NOTE [ Downloading into the cache ]). botocore offers
two per-request checks of a body: a CRC32 header (``x-amz-checksum-crc32``, its default for
PutObject and UploadPart) and, over plain HTTP only, a SHA-256 of the body in the SigV4
signature. Over HTTPS it already sends object bytes with the CRC32 alone, TLS guarding them.
Over plain HTTP it computes both, and the SHA-256 cost 0.7-0.95 s of CPU per GiB written, a
sixth of the writer's CPU (bench/RESULTS.md, "S3 write: where the client's CPU goes").
SeaweedFS checks the CRC32 and not the SHA-256: a part changed after it was signed is refused
(BadDigest) when it has the CRC32 and stored when it has only the SHA-256. AWS S3 checks both.
So an UploadPart or PutObject that carries a checksum header is signed over that header, not
over its body (:func:`_sign_body_by_its_checksum`), as botocore does over HTTPS: every part
is still checked by the server, on AWS and on SeaweedFS. What this gives up, on plain HTTP
only, is protection against a body changed on purpose on the way (a CRC32 can be forged; a
signed SHA-256 cannot); such a link leaves downloads unsigned anyway, and a download into a
cache refuses bytes that do not hash to their key. Requests without a checksum header keep the
signed SHA-256: CompleteMultipartUpload (its list of parts has no checksum), and every request
where ``AWS_REQUEST_CHECKSUM_CALCULATION=when_required`` turns the CRC32 off.

# NOTE [ Collecting an S3 store ]
The local store protects a write racing a collection with mtimes and a rename out of reach
(NOTE [ Store garbage collection ] in service/store/gc.py). S3 has no rename, so the same two
facts live in Redis:
- every writer, before it writes (or finds) the object under its content key, records the
  time in the sorted set ``keys.STORE_WRITTEN`` and checks, in the same MULTI, that no
  collection is deleting the object (``keys.store_deleting``); if one is, it waits until the
  marker is gone and then writes the object anew;
- the collector, after the rules of gc.py found the object unused, sets that marker only if
  the recorded write is older than the grace period (one Lua script: check and set are one
  step), checks the references again, deletes the object and removes the marker.
A write recorded before the marker keeps the object for the grace period; a write recorded
after it waits until the delete is done and installs the object again. The marker expires
after ``DELETE_MARKER_TTL_S`` should its collector die; a collection whose delete could take
that long does not exist (one DELETE request, bounded by the client's timeouts and retries).
An object without a recorded write is as old as its ``LastModified``, also checked.

One backend in one module; its NOTE blocks (atomic commit, downloads, what checks the bytes,
collection on S3) map it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import io
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO, Final, NamedTuple
from urllib.parse import urlsplit

import boto3
import redis
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from service.errors import ObjectNotFoundError, StoreError, StoreTooLargeError
from service.records import keys
from service.settings import DEFAULT_S3_PART_BYTES, DEFAULT_S3_PARTS_IN_FLIGHT
from service.store.base import (
    DEFAULT_TMP_MAX_AGE_S,
    SHA256_RE,
    DirectUpload,
    HashingWriter,
    ObjectWriter,
    StoredObject,
    check_sha256,
)
from service.store.cache import ObjectCache

__all__ = ["DELETE_MARKER_TTL_S", "S3Store", "parse_s3_url", "warm_up"]

# How long a collection's deletion marker lives if its collector dies before removing it.
DELETE_MARKER_TTL_S: Final = 300.0
_MARKER_POLL_S: Final = 0.1
_READ_CHUNK: Final = 8 * 1024 * 1024
# A ranged GET whose body breaks off is sent again, up to this many times in all (what
# s3transfer's downloads do: its S3_RETRYABLE_DOWNLOAD_ERRORS).
_READ_ATTEMPTS: Final = 5
_BROKEN_READ: Final = (OSError, ReadTimeoutError, IncompleteReadError, ResponseStreamingError)
# A downloaded part goes to the cache file in writes of this size: one write() of a whole
# 16 MiB part cost 6x the CPU of the same bytes in 256 KiB writes (0.66 s against 0.1 s per
# 256 MiB, measured in bench/store_bench.py), more than the sha256 of the part.
_WRITE_SLICE: Final = 256 * 1024
# Copies up to this size are one CopyObject request (S3's limit is 5 GiB); larger ones are
# multipart copies.
_COPY_SINGLE_MAX: Final = 4 * 1024**3
_COPY_PART: Final = 512 * 1024**2
_MAX_PARTS: Final = 10_000
# A part read from a file goes straight into the bytearray that is sent (see _FileRange).
_CAN_READ_INTO: Final = hasattr(os, "preadv")

# The marker is set only if no write was recorded at or after the cutoff (NOTE [ Collecting an
# S3 store ]). KEYS: written zset, marker; ARGV: sha256, cutoff, token, ttl ms.
_MARK_LUA: Final = """
local written = redis.call('ZSCORE', KEYS[1], ARGV[1])
if written and tonumber(written) >= tonumber(ARGV[2]) then return 0 end
if redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[4]) then return 1 end
return 0
"""
_UNMARK_LUA: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


_session_lock = threading.Lock()
_sessions: dict[int, Any] = {}
# Clients warm_up made for forked children: (endpoint URL, parts in flight) -> (maker's pid,
# client). Never used in the process that made them.
_forkable: dict[tuple[str, int], tuple[int, Any]] = {}


def _session() -> Any:
    """This process's boto3 session. Making a client loads botocore's service model (some
    hundreds of milliseconds); a session keeps it, and holds no connection, so a session made
    before a fork (see :func:`warm_up`) serves the forked job too."""
    with _session_lock:
        session = _sessions.get(0)
        if session is None:
            session = _sessions[0] = boto3.session.Session()
        return session


def _client_config(parts_in_flight: int) -> Config:
    return Config(
        # SigV4 everywhere: botocore would presign with the legacy SigV2, which AWS regions
        # opened since 2014 refuse and SeaweedFS refuses with response parameters.
        signature_version="s3v4",
        retries={"max_attempts": 5, "mode": "standard"},
        max_pool_connections=max(10, 2 * parts_in_flight),
        connect_timeout=10,
        read_timeout=60,
    )


def _sign_body_by_its_checksum(unsigned: Config, request: Any, **_: Any) -> None:
    """Before an UploadPart or PutObject is signed: if botocore put a checksum header on it,
    the signature covers that header instead of a SHA-256 of the body (NOTE [ What checks
    the bytes of a part ]). Without such a header, nothing changes."""
    algorithm = request.context.get("checksum", {}).get("request_algorithm")
    if (
        isinstance(algorithm, dict)
        and algorithm.get("in") == "header"
        and algorithm.get("name") in request.headers
    ):
        # The signer reads `payload_signing_enabled` from the request's client config.
        request.context["client_config"] = unsigned


def _make_client(session: Any, endpoint_url: str | None, parts_in_flight: int) -> Any:
    """A new client, signing object bytes as NOTE [ What checks the bytes of a part ] says.
    Called with ``_session_lock`` held (a session is not thread-safe)."""
    client = session.client("s3", endpoint_url=endpoint_url, config=_client_config(parts_in_flight))
    config = client.meta.config
    unsigned = config.merge(Config(s3={**(config.s3 or {}), "payload_signing_enabled": False}))
    sign = functools.partial(_sign_body_by_its_checksum, unsigned)
    for operation in ("UploadPart", "PutObject"):
        client.meta.events.register(f"before-sign.s3.{operation}", sign)
    return client


def _new_client(endpoint_url: str | None, parts_in_flight: int) -> Any:
    """A client for this process: one warm_up made before the fork if there is one (tens of
    milliseconds saved per job), else a new one."""
    name = endpoint_url or ""
    with _session_lock:
        made = _forkable.pop((name, parts_in_flight), None)
        if made is not None and made[0] != os.getpid():
            return made[1]
        if made is not None:
            _forkable[(name, parts_in_flight)] = made  # the maker's: kept for its children
    session = _session()
    with _session_lock:
        return _make_client(session, endpoint_url, parts_in_flight)


def warm_up(parts_in_flight: int = DEFAULT_S3_PARTS_IN_FLIGHT) -> None:
    """Loads the S3 service model into this process's session and makes the client a job
    will use, without a request: an RQ worker calls it before forking jobs, so each job has
    its client at once. The client is never used in this process, so it holds no connection
    a child could inherit; each forked child takes its own copy of it."""
    session = _session()
    with _session_lock:
        # No endpoint_url: like S3Store's own client, it reads AWS_ENDPOINT_URL itself.
        client = _make_client(session, None, parts_in_flight)
        _forkable[("", parts_in_flight)] = (os.getpid(), client)


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> (bucket, prefix ending in ``/``, or empty)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(
            f"not an S3 URL: {url!r}; write s3://BUCKET or s3://BUCKET/PREFIX (endpoint and "
            "credentials come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"
        )
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def _not_found(exc: ClientError) -> bool:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code in {"404", "NoSuchKey", "NotFound", "NoSuchUpload"}


class _BodyReader(io.RawIOBase):
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


def _over_tls(client: Any) -> bool:
    return str(client.meta.endpoint_url).startswith("https:")


class _FileRange(NamedTuple):
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


class _PartUpload:
    """A multipart upload to one content key, invisible in the bucket until :meth:`complete`
    and gone after :meth:`abort`. Its parts are sent by ``parts_in_flight`` threads; at most
    that many are in memory or on the wire at once (:meth:`send` waits for a free one)."""

    def __init__(self, store: S3Store, key: str) -> None:
        self._store = store
        self._key = key
        self._upload_id: str | None = store.client.create_multipart_upload(
            Bucket=store.bucket, Key=key
        )["UploadId"]
        self._pool = concurrent.futures.ThreadPoolExecutor(store.parts_in_flight)
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        # Over plain HTTP a bytearray body is sent as it is, over HTTPS bytes are (see
        # _S3Writer._take_buffer).
        self.tls = _over_tls(store.client)

    def send(self, part: bytes | bytearray | _FileRange) -> None:
        store = self._store
        if len(self._parts) >= _MAX_PARTS:
            raise StoreError(
                f"object needs more than {_MAX_PARTS} parts of {store.part_bytes} bytes; raise "
                "BNADAPT_S3_PART_BYTES"
            )
        pending = [f for f in self._parts if not f.done()]
        if len(pending) >= store.parts_in_flight:
            concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in self._parts:
            if future.done():
                future.result()  # an upload that failed fails the write now
        number = len(self._parts) + 1
        self._parts.append(self._pool.submit(self._upload_part, number, part))

    def _upload_part(self, number: int, part: bytes | bytearray | _FileRange) -> dict[str, Any]:
        store = self._store
        body = part.read(self.tls) if isinstance(part, _FileRange) else part
        reply = store.client.upload_part(
            Bucket=store.bucket,
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
        store = self._store
        store.client.complete_multipart_upload(
            Bucket=store.bucket,
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
                self._store.client.abort_multipart_upload(
                    Bucket=self._store.bucket, Key=self._key, UploadId=self._upload_id
                )


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
        self._upload: _PartUpload | None = None  # once the first part is sent
        self.already_there = False  # the announced object exists: nothing is uploaded
        # Digest unknown and more than one part: the whole object is in the cache file only.
        self.spooled = False
        self._tls = _over_tls(store.client)

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
        checksums and sends a bytearray as it is, in one ``sendall`` (0.35-0.55 s of CPU less
        per GiB, bench/RESULTS.md, "S3 write: where the client's CPU goes"). Over HTTPS
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
            store._record_write(self.expected_sha256)
            if store._exists_remote(self.expected_sha256):
                self.already_there = True
                self._drop_buffer()
                return
            self._upload = _PartUpload(store, store.key(self.expected_sha256))
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
    copies in ``cache`` and its write times in Redis (NOTE [ Collecting an S3 store ]).

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
        self.part_bytes = part_bytes
        self.parts_in_flight = parts_in_flight
        self.presign_ttl_s = presign_ttl_s
        self._redis = redis_client
        self._public_endpoint_url = public_endpoint_url
        self._clients: dict[str, Any] = {}
        self._pid = os.getpid()
        self._mark = redis_client.register_script(_MARK_LUA)
        self._unmark = redis_client.register_script(_UNMARK_LUA)
        self._transfer = TransferConfig(
            multipart_threshold=_COPY_SINGLE_MAX,
            multipart_chunksize=_COPY_PART,
            max_concurrency=max(parts_in_flight, 4),
        )

    def __repr__(self) -> str:
        return f"S3Store('s3://{self.bucket}/{self.prefix}', {self.cache!r})"

    # -- clients and keys

    def _client(self, endpoint_url: str | None = None) -> Any:
        if os.getpid() != self._pid:  # forked: boto3 clients do not survive a fork
            self._clients.clear()
            self._pid = os.getpid()
        name = endpoint_url or ""
        client = self._clients.get(name)
        if client is None:
            client = self._clients[name] = _new_client(endpoint_url, self.parts_in_flight)
        return client

    @property
    def client(self) -> Any:
        """The boto3 S3 client of this process."""
        return self._client()

    def key(self, sha256: str) -> str:
        return f"{self.prefix}objects/{check_sha256(sha256)}"

    def new_temp_key(self) -> str:
        return f"{self.prefix}tmp/{secrets.token_hex(16)}"

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
                    self._record_write(writer.sha256)
                    writer.complete()
            except BaseException:
                writer.abort()
                raise
            self.cache.install(cache_tmp, writer.sha256)

    def _record_write(self, sha256: str) -> None:
        """Records that ``sha256`` is being written, once no collection is deleting it
        (NOTE [ Collecting an S3 store ])."""
        deadline = time.monotonic() + DELETE_MARKER_TTL_S + 10.0
        while True:
            pipe = self._redis.pipeline(transaction=True)
            pipe.zadd(keys.STORE_WRITTEN, {sha256: time.time()})
            pipe.exists(keys.store_deleting(sha256))
            _, deleting = pipe.execute()
            if not deleting:
                return
            if time.monotonic() > deadline:
                raise StoreError(
                    f"object {sha256} has been marked for deletion by a store collection for "
                    f"over {DELETE_MARKER_TTL_S:g} s; check Redis key "
                    f"{keys.store_deleting(sha256)} and retry"
                )
            time.sleep(_MARKER_POLL_S)

    def _install_bytes(self, data: bytes | bytearray, sha256: str) -> None:
        self._record_write(sha256)
        self.client.put_object(Bucket=self.bucket, Key=self.key(sha256), Body=data)

    def _install_file(self, cache_tmp: Path, sha256: str) -> None:
        """Records the write, and uploads the cache's temp file, whose bytes hashed to
        ``sha256`` as they were written, under its content key unless the object is there:
        a write of unknown digest past one part, or one whose announced object was there
        already (the recorded write keeps it for the grace period; should a collection have
        taken it meanwhile, a write longer than that, it is uploaded again). The parts are
        read from the file by the threads that send them (NOTE [ Atomic commit on S3 ])."""
        self._record_write(sha256)
        if self._exists_remote(sha256):
            return
        # From an open file: a part read by name could miss a temp file unlinked meanwhile.
        with cache_tmp.open("rb", buffering=0) as file:
            fd = file.fileno()
            size = os.fstat(fd).st_size
            upload = _PartUpload(self, self.key(sha256))
            try:
                for offset in range(0, size, self.part_bytes):
                    upload.send(_FileRange(fd, offset, min(self.part_bytes, size - offset)))
                upload.close_pool()
                upload.complete()
            except BaseException:
                upload.abort()
                raise

    def _install_temp(self, temp_key: str, sha256: str) -> None:
        """Copies a complete temp object to its content key (unless it is there) and deletes
        the temp key."""
        try:
            self._record_write(sha256)
            if not self._exists_remote(sha256):
                self.client.copy(
                    {"Bucket": self.bucket, "Key": temp_key},
                    self.bucket,
                    self.key(sha256),
                    Config=self._transfer,
                )
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
            if _not_found(exc):
                raise ObjectNotFoundError(self._missing(sha256)) from None
            raise
        return io.BufferedReader(_BodyReader(reply["Body"]), _READ_CHUNK)

    def local_path(self, sha256: str) -> Path:
        """The cached copy, downloaded first if this machine has none (checked against its
        sha256 before it is used: NOTE [ Downloading into the cache ])."""
        cached = self.cache.get(sha256)
        if cached is not None:
            return cached
        key = self.key(sha256)
        try:
            size: int = self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        except ClientError as exc:
            if _not_found(exc):
                raise ObjectNotFoundError(self._missing(sha256)) from None
            raise
        with self.cache.new_file() as (tmp, file):
            got = self._download(key, size, file)
            file.close()
            if got != sha256:
                raise StoreError(
                    f"the object s3://{self.bucket}/{self.key(sha256)} holds bytes whose sha256 "
                    f"is {got}: it was changed outside bnadapt; delete it and upload the file "
                    "again"
                )
            return self.cache.install(tmp, sha256)

    def _download(self, key: str, size: int, file: BinaryIO) -> str:
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
                reply = self.client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}"
                )
                with contextlib.closing(reply["Body"]) as body:
                    data: bytes = body.read()
                break
            except _BROKEN_READ:
                if attempt == _READ_ATTEMPTS:
                    raise
        if len(data) != end - start:
            raise StoreError(
                f"s3://{self.bucket}/{key}: asked for bytes {start}-{end - 1}, got {len(data)} "
                "bytes; the object changed during the download; try again"
            )
        return data

    def _exists_remote(self, sha256: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key(sha256))
        except ClientError as exc:
            if _not_found(exc):
                return False
            raise
        return True

    def exists(self, sha256: str) -> bool:
        return self._exists_remote(sha256)

    def _missing(self, sha256: str) -> str:
        return f"no object {sha256} in s3://{self.bucket}/{self.prefix}"

    def download_url(self, sha256: str, filename: str) -> str | None:
        """A presigned GET of the object, valid ``presign_ttl_s``."""
        client = self._client(self._public_endpoint_url)
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
        (each ``part_bytes`` long, the last one the rest)."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        count = -(-size // self.part_bytes)
        if count > _MAX_PARTS:
            raise StoreError(
                f"{size} bytes need {count} parts of {self.part_bytes} bytes, over S3's "
                f"{_MAX_PARTS}; raise BNADAPT_S3_PART_BYTES"
            )
        temp_key = self.new_temp_key()
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=temp_key)[
            "UploadId"
        ]
        presigner = self._client(self._public_endpoint_url)
        urls = [
            presigner.generate_presigned_url(
                "upload_part",
                Params={
                    "Bucket": self.bucket,
                    "Key": temp_key,
                    "UploadId": upload_id,
                    "PartNumber": number,
                },
                ExpiresIn=self.presign_ttl_s,
            )
            for number in range(1, count + 1)
        ]
        return DirectUpload(upload_id, temp_key, self.part_bytes, urls)

    def finish_direct_upload(
        self, upload: DirectUpload, etags: list[str], max_bytes: int | None
    ) -> tuple[str, int]:
        """Completes the upload with the parts' ETags (in order), then checks and installs it
        like any write; returns (sha256, size)."""
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
        return self._adopt_temp(upload.temp_key, max_bytes)

    def import_object(self, url: str, max_bytes: int | None) -> tuple[str, int]:
        """Copies ``s3://bucket/key`` (readable with this store's credentials) server-side to
        a temp key, then checks and installs it like any write; returns (sha256, size)."""
        bucket, key = parse_s3_url(url)
        key = key.rstrip("/")
        if not key:
            raise ValueError(f"{url!r} names a bucket, not an object: write s3://BUCKET/KEY")
        try:
            head = self.client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            raise ObjectNotFoundError(f"cannot read {url}: {exc}") from exc
        _check_size(head["ContentLength"], max_bytes)
        temp_key = self.new_temp_key()
        try:
            self.client.copy(
                {"Bucket": bucket, "Key": key}, self.bucket, temp_key, Config=self._transfer
            )
        except ClientError as exc:
            raise StoreError(f"cannot copy {url} into the store: {exc}") from exc
        return self._adopt_temp(temp_key, max_bytes)

    def _adopt_temp(self, temp_key: str, max_bytes: int | None) -> tuple[str, int]:
        """Hashes a complete temp object into this machine's cache, installs it under its
        content key (NOTE [ Atomic commit on S3 ]) and deletes the temp key."""
        try:
            size: int = self.client.head_object(Bucket=self.bucket, Key=temp_key)["ContentLength"]
            _check_size(size, max_bytes)
            with self.cache.new_file() as (cache_tmp, file):
                sha256 = self._download(temp_key, size, file)
                file.close()
                self._install_temp(temp_key, sha256)
                self.cache.install(cache_tmp, sha256)
            return sha256, size
        finally:
            with contextlib.suppress(ClientError):
                self.client.delete_object(Bucket=self.bucket, Key=temp_key)

    # -- collection (NOTE [ Collecting an S3 store ])

    def objects(self) -> Iterator[StoredObject]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}objects/"
        )
        for page in pages:
            for entry in page.get("Contents", ()):
                name = entry["Key"].rpartition("/")[2]
                if SHA256_RE.fullmatch(name) is None:
                    continue
                yield StoredObject(name, entry["LastModified"].timestamp(), entry["Size"])

    def remove_unused(self, sha256: str, cutoff: float, in_use: Callable[[str], bool]) -> bool:
        if in_use(sha256):
            return False
        marker = keys.store_deleting(sha256)
        token = secrets.token_hex(8)
        marked = self._mark(
            keys=[keys.STORE_WRITTEN, marker],
            args=[sha256, repr(cutoff), token, int(DELETE_MARKER_TTL_S * 1000)],
        )
        if not marked:
            return False  # written within the grace period, or another collector is on it
        try:
            if in_use(sha256):
                return False
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=self.key(sha256))
            except ClientError as exc:
                if _not_found(exc):
                    return False
                raise
            if head["LastModified"].timestamp() >= cutoff:
                return False
            self.client.delete_object(Bucket=self.bucket, Key=self.key(sha256))
            self.cache.discard(sha256)
            return True
        finally:
            self._unmark(keys=[marker], args=[token])

    def settle_trash(self, cutoff: float, in_use: Callable[[str], bool]) -> int:
        """Nothing is moved aside on S3 (a dead collector's marker expires); drops the
        recorded writes older than ``cutoff``, which no longer protect anything."""
        self._redis.zremrangebyscore(keys.STORE_WRITTEN, "-inf", f"({cutoff}")
        return 0

    def cleanup_tmp(self, older_than_s: float = DEFAULT_TMP_MAX_AGE_S) -> int:
        """Deletes temp keys and aborts unfinished multipart uploads older than
        ``older_than_s``."""
        if older_than_s < 0:
            raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
        cutoff = datetime.now(UTC) - timedelta(seconds=older_than_s)
        tmp_prefix = f"{self.prefix}tmp/"
        removed = 0
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=tmp_prefix
        )
        for page in pages:
            for entry in page.get("Contents", ()):
                if entry["LastModified"] < cutoff:
                    self.client.delete_object(Bucket=self.bucket, Key=entry["Key"])
                    removed += 1
        # Unfinished uploads under tmp/ and under objects/ (a write whose digest was
        # announced uploads to its content key; unfinished, it is invisible there).
        uploads = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self.prefix
        )
        ours = (tmp_prefix, f"{self.prefix}objects/")
        for page in uploads:
            for upload in page.get("Uploads", ()):
                if upload["Key"].startswith(ours) and upload["Initiated"] < cutoff:
                    with contextlib.suppress(ClientError):
                        self.client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        removed += 1
        return removed


def _check_size(size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise StoreTooLargeError(
            f"object is larger than the limit of {max_bytes} bytes ({size} bytes); nothing was "
            "stored: send a smaller file"
        )
