"""Bytes between HTTP and the store, streamed: uploads hashed as they arrive, within a size
limit; downloads read chunk by chunk. The API never holds a whole object."""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO, Final

from service.api.problems import ApiError
from service.errors import StoreTooLargeError
from service.store.base import Store

__all__ = ["CHUNK_BYTES", "store_upload", "stream_object"]

CHUNK_BYTES: Final = 1024 * 1024


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


def stream_object(store: Store, sha256: str) -> Iterator[bytes]:
    """The object's bytes in chunks. Opened before the first chunk is asked for, so a missing
    object raises ``ObjectNotFoundError`` while an error response can still be sent."""
    file = store.open(sha256)

    def chunks() -> Iterator[bytes]:
        with file:
            while chunk := file.read(CHUNK_BYTES):
                yield chunk

    return chunks()
