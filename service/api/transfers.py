"""Bytes between HTTP and the store, streamed: uploads hashed and stored as they arrive, within
a size limit; downloads read chunk by chunk. The API never holds a whole object.

# NOTE [ Streamed uploads ]
An upload's body is read from the ASGI stream as it arrives (a multipart form is parsed on the
fly by python-multipart's push parser, never spooled by Starlette), gathered into pieces of at
most ``_PIECE_BYTES`` and written, in a thread for pieces, into a store writer that hashes it. A
piece holds its thread for milliseconds, and long work never holds those threads: queued behind
it, an upload would stall mid-stream. What takes long once the last byte arrived (an S3 store's
upload of a file whose digest was not announced) runs in the threads for long work (NOTE [ Heavy
work off the request path ] in service/api/offload.py); both at a lower priority than the
requests (NOTE [ Bytes at a lower priority ]). So
the API's memory during an upload is a few pieces whatever the file's size, the body limit is
the settings' (checked against Content-Length first, then byte by byte), and a refused or
dropped upload leaves nothing in the store (the writer discards its temp file). A client that
sends the file's sha256 in ``X-Content-SHA256`` lets an S3 store send it on to its content
key while it arrives, where an unknown digest waits for the last byte (NOTE [ Atomic commit
on S3 ] in service/store/s3/store.py); bytes that hash otherwise are refused with 422 and leave
nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Final

from python_multipart import MultipartParser
from python_multipart.multipart import parse_options_header
from starlette.requests import ClientDisconnect, Request

from service.api.offload import HeavyWork
from service.api.problems import ApiError
from service.errors import StoreDigestMismatchError, StoreTooLargeError
from service.store.base import SHA256_RE, ObjectWriter, Store

__all__ = [
    "CHUNK_BYTES",
    "SHA256_HEADER",
    "SHA256_HEADER_PARAMETER",
    "StreamedUpload",
    "store_body",
    "store_multipart",
    "store_upload",
    "stream_object",
    "too_large",
]

CHUNK_BYTES: Final = 1024 * 1024
# The file's sha256 (64 lowercase hex digits), sent by a client that knows it: an S3 store
# then writes the upload straight to its content key (NOTE [ Atomic commit on S3 ]).
SHA256_HEADER: Final = "X-Content-SHA256"
# Its OpenAPI description, for the routes that read it (their `openapi_extra`).
SHA256_HEADER_PARAMETER: Final[dict[str, object]] = {
    "name": SHA256_HEADER,
    "in": "header",
    "required": False,
    "description": (
        "The file's sha256, if the client knows it: an S3 store then writes the file straight "
        "to its content key; a file whose bytes hash otherwise is refused (422)."
    ),
    "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
}
_PIECE_BYTES: Final = 4 * 1024 * 1024  # written to the store in one call from a thread
_MAX_FIELD_BYTES: Final = 4096  # a form field other than the file (a name)
_MULTIPART_SLACK: Final = 64 * 1024  # boundaries and part headers around the file


def too_large(what: str, max_bytes: int, setting: str) -> ApiError:
    """The one 413 of an upload over its limit: which limit, and how to raise it."""
    return ApiError(
        413,
        f"the {what} is larger than the limit of {max_bytes} bytes ({setting}); upload a "
        f"smaller file, or raise {setting} on the API and the workers",
    )


def store_upload(store: Store, file: BinaryIO, max_bytes: int, what: str) -> tuple[str, int]:
    """Copies ``file`` into the store; returns (sha256, size). Over ``max_bytes``: 413 and
    nothing stored. An upload that is refused later, once stored, is left to the store's
    collector: deleting it here could delete the same bytes that a concurrent upload is about
    to register (NOTE [ Store garbage collection ] in service/store/gc.py)."""
    try:
        with store.writer(max_bytes=max_bytes) as writer:
            while chunk := file.read(CHUNK_BYTES):
                writer.write(chunk)
    except StoreTooLargeError as exc:
        raise ApiError(
            413,
            f"the {what} is larger than the limit of {max_bytes} bytes; upload a smaller file "
            "or raise the limit in the settings",
        ) from exc
    return writer.sha256, writer.size


class _StoreSink:
    """A store writer fed from the event loop: pieces are written from a worker thread, the
    commit from a thread of ``heavy`` (NOTE [ Streamed uploads ])."""

    def __init__(
        self,
        store: Store,
        max_bytes: int,
        what: str,
        setting: str,
        sha256: str | None,
        heavy: HeavyWork,
    ) -> None:
        self._heavy = heavy
        self._context = store.writer(max_bytes=max_bytes, sha256=sha256)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._limit = (what, max_bytes, setting)
        self.writer: ObjectWriter | None = None

    async def __aenter__(self) -> _StoreSink:
        self.writer = await self._heavy.piece(self._context.__enter__)
        return self

    async def __aexit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        try:
            if exc is None:
                await self.flush()
                await self._heavy.run(self._context.__exit__, None, None, None)
            else:
                await self._heavy.run(self._context.__exit__, type(exc), exc, exc.__traceback__)
        except StoreTooLargeError as error:
            raise too_large(*self._limit) from error
        except StoreDigestMismatchError as error:
            raise ApiError(422, f"{error} (header {SHA256_HEADER})") from error

    async def add(self, data: bytes) -> None:
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= _PIECE_BYTES:
            await self.flush()

    async def flush(self) -> None:
        if not self._pending:
            return
        pieces, self._pending, self._pending_bytes = self._pending, [], 0
        assert self.writer is not None
        try:
            await self._heavy.piece(_write_joined, self.writer, pieces)
        except StoreTooLargeError as error:
            raise too_large(*self._limit) from error

    @property
    def sha256(self) -> str:
        assert self.writer is not None
        return self.writer.sha256

    @property
    def size(self) -> int:
        assert self.writer is not None
        return self.writer.size


def _write_joined(writer: ObjectWriter, pieces: list[bytes]) -> None:
    # Joined in the thread: a join is a copy made holding the GIL, and on the event loop it was
    # the loop's largest cost during uploads (8 % of its samples with 20 uploads at once).
    writer.write(b"".join(pieces))


def announced_sha256(request: Request) -> str | None:
    """The file's digest from the ``X-Content-SHA256`` header, if sent; 422 if malformed."""
    value = request.headers.get(SHA256_HEADER)
    if value is None:
        return None
    if SHA256_RE.fullmatch(value) is None:
        raise ApiError(
            422,
            f"header {SHA256_HEADER} must be the file's sha256 as 64 lowercase hexadecimal "
            f"digits, got {value[:80]!r}; send it so or leave it out",
        )
    return value


def _check_length(request: Request, max_bytes: int, what: str, setting: str) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(what, max_bytes, setting)


async def _chunks(request: Request) -> AsyncIterator[bytes]:
    try:
        async for chunk in request.stream():
            if chunk:
                yield chunk
    except ClientDisconnect as exc:
        raise ApiError(400, "the client closed the connection before the body ended") from exc


@dataclass
class StreamedUpload:
    """An upload stored as it arrived."""

    sha256: str
    size: int
    filename: str | None = None
    fields: dict[str, str] = field(default_factory=dict)  # a form's other fields


async def store_body(
    request: Request, store: Store, max_bytes: int, what: str, setting: str, heavy: HeavyWork
) -> StreamedUpload:
    """Stores the raw request body (NOTE [ Streamed uploads ]); over ``max_bytes``: 413."""
    _check_length(request, max_bytes, what, setting)
    sha256 = announced_sha256(request)
    async with _StoreSink(store, max_bytes, what, setting, sha256, heavy) as sink:
        async for chunk in _chunks(request):
            await sink.add(chunk)
    return StreamedUpload(sink.sha256, sink.size)


class _FormParts:
    """python-multipart callbacks: the part named ``file_field`` goes to the store, other
    fields (small) are kept."""

    def __init__(self, file_field: str) -> None:
        self.file_field = file_field
        self.header_field = b""
        self.header_value = b""
        self.headers: dict[bytes, bytes] = {}
        self.current: str | None = None
        self.filename: str | None = None
        self.file_parts = 0
        self.fields: dict[str, bytearray] = {}
        self.file_data: list[bytes] = []
        self.error: str | None = None

    def on_part_begin(self) -> None:
        self.headers = {}

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.headers[self.header_field.lower()] = self.header_value
        self.header_field = self.header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        self.current = name
        if name == self.file_field:
            self.file_parts += 1
            raw = options.get(b"filename")
            self.filename = None if raw is None else raw.decode("utf-8", "replace")
        else:
            self.fields.setdefault(name, bytearray())

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.current == self.file_field:
            self.file_data.append(data[start:end])
        elif self.current is not None:
            value = self.fields[self.current]
            value += data[start:end]
            if len(value) > _MAX_FIELD_BYTES:
                self.error = f"the form field {self.current!r} is longer than {_MAX_FIELD_BYTES}"

    def on_part_end(self) -> None:
        self.current = None


async def store_multipart(
    request: Request,
    store: Store,
    max_bytes: int,
    what: str,
    setting: str,
    file_field: str,
    heavy: HeavyWork,
) -> StreamedUpload:
    """Stores the form part ``file_field`` of a multipart body as it arrives, keeping its
    other (small) fields (NOTE [ Streamed uploads ]); over ``max_bytes``: 413."""
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise ApiError(415, "send the file as multipart/form-data with a boundary")
    _check_length(request, max_bytes + _MULTIPART_SLACK, what, setting)
    parts = _FormParts(file_field)
    callbacks = {
        name: getattr(parts, name)
        for name in (
            "on_part_begin",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_headers_finished",
            "on_part_data",
            "on_part_end",
        )
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    sha256 = announced_sha256(request)
    async with _StoreSink(store, max_bytes, what, setting, sha256, heavy) as sink:
        async for chunk in _chunks(request):
            try:
                parser.write(chunk)
            except Exception as exc:  # python-multipart's MultipartParseError and its kin
                raise ApiError(400, f"the multipart body could not be parsed: {exc}") from exc
            if parts.error is not None:
                raise ApiError(422, parts.error)
            for data in parts.file_data:
                await sink.add(data)
            parts.file_data.clear()
        parser.finalize()
        if parts.file_parts != 1:
            raise ApiError(
                422, f"the form needs exactly one file field {file_field!r}, got {parts.file_parts}"
            )
    fields = {k: v.decode("utf-8", "replace") for k, v in parts.fields.items()}
    return StreamedUpload(sink.sha256, sink.size, parts.filename, fields)


def stream_object(store: Store, sha256: str) -> Iterator[bytes]:
    """The object's bytes in chunks. Opened before the first chunk is asked for, so a missing
    object raises ``ObjectNotFoundError`` while an error response can still be sent."""
    file = store.open(sha256)

    def chunks() -> Iterator[bytes]:
        with file:
            while chunk := file.read(CHUNK_BYTES):
                yield chunk

    return chunks()
