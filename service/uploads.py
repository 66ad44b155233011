"""Streaming an upload into the store, hashing as it goes, within a size limit."""

from __future__ import annotations

from typing import BinaryIO, Final

from service.errors import StoreTooLargeError
from service.problems import ApiError
from service.store import Store

__all__ = ["CHUNK_BYTES", "store_upload"]

CHUNK_BYTES: Final = 1024 * 1024


def store_upload(store: Store, file: BinaryIO, max_bytes: int, what: str) -> tuple[str, int]:
    """Copies ``file`` into the store; returns (sha256, size). Over ``max_bytes``: 413 and
    nothing stored. An upload that is refused later, once stored, is left to the store's
    collector: deleting it here could delete the same bytes that a concurrent upload is about
    to register (NOTE [ Store garbage collection ] in service/store_gc.py)."""
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
