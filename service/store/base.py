"""What every artifact store offers: the :class:`Store` protocol and its helpers.

A store holds immutable objects named by the sha256 of their bytes. :func:`service.store.open_store`
picks the backend from the settings; the API and the workers only ever see this protocol.
"""

import contextlib
import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Final, NamedTuple, Protocol, runtime_checkable

from api_schemas.common import SHA256_PATTERN
from service.errors import StoreDigestMismatchError, StoreTooLargeError

__all__ = [
    "DEFAULT_TMP_MAX_AGE_S",
    "SHA256_RE",
    "DirectTransfers",
    "DirectUpload",
    "HashingWriter",
    "ObjectWriter",
    "SourceFolders",
    "SourcePage",
    "Store",
    "StoredObject",
    "check_sha256",
]

# A temp file untouched this long belongs to a writer that died (every write updates mtime).
DEFAULT_TMP_MAX_AGE_S: Final = 24 * 3600.0

SHA256_RE: Final = re.compile(SHA256_PATTERN)


def check_sha256(value: str) -> str:
    """Returns ``value`` if it is a sha256 hex digest (64 lowercase hex characters).

    Raises ``ValueError`` otherwise. The check also keeps path separators and ``..`` out of
    object paths.
    """
    # fullmatch: with `match`, `$` would also accept a trailing newline.
    if not isinstance(value, str) or SHA256_RE.fullmatch(value) is None:
        raise ValueError(
            f"not a sha256 digest: {str(value)[:80]!r}; expected 64 lowercase hexadecimal "
            "characters"
        )
    return value


class StoredObject(NamedTuple):
    sha256: str
    mtime: float  # seconds since the epoch: when the object was last written
    size: int  # bytes


class ObjectWriter(Protocol):
    """What :meth:`Store.writer` yields: takes chunks; knows its digest once committed."""

    def write(self, chunk: bytes) -> None: ...

    @property
    def size(self) -> int:
        """Bytes written so far (the object's size after commit)."""
        ...

    @property
    def sha256(self) -> str:
        """The object's digest; only after a clean exit from the ``with`` block."""
        ...


class HashingWriter:
    """The part of every backend's writer that is the same: the size limit, the sha256 and
    the check against a digest announced before the write. A backend subclasses it and puts
    each accepted chunk where it belongs in :meth:`_put`; its ``writer`` calls :meth:`finish`
    on a clean exit of the ``with`` block, before it commits anything."""

    def __init__(self, max_bytes: int | None, expected_sha256: str | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.expected_sha256 = None if expected_sha256 is None else check_sha256(expected_sha256)
        self._max_bytes = max_bytes
        self._hash = hashlib.sha256()
        self._size = 0
        self._digest: str | None = None
        self._open = True
        # Kept so that a caller who catches the error inside the `with` block still cannot
        # commit the truncated object: finish() raises it again.
        self._too_large: StoreTooLargeError | None = None

    def _put(self, chunk: bytes) -> None:
        """Where the backend sends an accepted chunk (already counted and hashed)."""
        raise NotImplementedError

    def write(self, chunk: bytes) -> None:
        if not self._open:
            raise ValueError("write to a store writer after its `with` block ended")
        if self._too_large is not None:
            raise self._too_large
        new_size = self._size + len(chunk)
        if self._max_bytes is not None and new_size > self._max_bytes:
            self._too_large = StoreTooLargeError(
                f"object is larger than the limit of {self._max_bytes} bytes (reached at least "
                f"{new_size} bytes); nothing was stored: send a smaller file"
            )
            raise self._too_large
        self._hash.update(chunk)
        self._size = new_size
        self._put(chunk)

    @property
    def size(self) -> int:
        return self._size

    @property
    def sha256(self) -> str:
        if self._digest is None:
            raise RuntimeError("the sha256 is known only after the `with` block ends cleanly")
        return self._digest

    def finish(self) -> str:
        """Closes the writer and returns the digest; raises what makes the write fail (over
        the limit, or bytes that do not hash to the announced digest)."""
        self._open = False
        if self._too_large is not None:
            raise self._too_large
        digest = self._hash.hexdigest()
        if self.expected_sha256 is not None and digest != self.expected_sha256:
            raise StoreDigestMismatchError(
                f"the bytes written hash to sha256 {digest}, not the {self.expected_sha256} "
                "announced for them; nothing was stored: send the file again, with its own "
                "digest"
            )
        self._digest = digest
        return digest


class Store(Protocol):
    """A content-addressed store. See NOTE [ Atomic commit ] for the guarantees."""

    def writer(
        self, max_bytes: int | None = None, sha256: str | None = None
    ) -> contextlib.AbstractContextManager[ObjectWriter]:
        """A context manager that commits what was written on a clean exit and discards it
        on an exception. Over ``max_bytes`` the write raises ``StoreTooLargeError``. With
        ``sha256`` (the digest the bytes are announced to have) a backend may write straight
        to the object's final place; bytes that hash otherwise raise
        ``StoreDigestMismatchError`` and store nothing."""
        ...

    def put_bytes(self, data: bytes) -> str:
        """Stores ``data``; returns its sha256."""
        ...

    def open(self, sha256: str) -> BinaryIO:
        """Opens an object for reading; ``ObjectNotFoundError`` if absent."""
        ...

    def local_path(self, sha256: str) -> Path:
        """A readable local file with the object's bytes; ``ObjectNotFoundError`` if absent.
        Callers must not modify it."""
        ...

    def pinning(self) -> contextlib.AbstractContextManager[None]:
        """Within the block, every local file :meth:`local_path` and :meth:`open` hand this
        process stays on the machine until the block ends: a job's whole run (NOTE [ Pinned
        copies ] in service/store/cache.py). Where the files are the store's own, nothing."""
        ...

    def exists(self, sha256: str) -> bool: ...

    def objects(self) -> Iterator[StoredObject]:
        """Every committed object."""
        ...

    def remove_unused(self, sha256: str, cutoff: float, in_use: Callable[[str], bool]) -> bool:
        """Deletes the object if it was last written before ``cutoff`` and ``in_use`` says
        no, both checked again once no writer can reach it; True if it was deleted.
        NOTE [ Store garbage collection ] in service/store/gc.py."""
        ...

    def settle_trash(self, cutoff: float, in_use: Callable[[str], bool]) -> int:
        """Finishes what a collector that died left half done: each object it had moved
        aside is deleted or put back by the rule of :meth:`remove_unused`. Returns how many
        were deleted."""
        ...

    def cleanup_tmp(self, older_than_s: float = DEFAULT_TMP_MAX_AGE_S) -> int:
        """Removes temp files left by crashed writers; returns how many."""
        ...

    def download_url(self, sha256: str, filename: str) -> str | None:
        """A short-lived URL a client can GET the object from directly, as ``filename``;
        None where the store has none (then the API streams the object)."""
        ...

    def warm_up(self) -> None:
        """Makes ready, without a request, what each job forked from this process would
        otherwise make on its first use of the store (an RQ worker calls it before forking
        jobs); nothing where there is nothing to make. Opens no connection a child could
        inherit."""
        ...


class DirectUpload(NamedTuple):
    """A multipart upload a client sends straight to the bucket, one presigned URL a part."""

    upload_id: str
    temp_key: str
    part_bytes: int  # every part but the last is this long
    part_urls: list[str]


class SourcePage(NamedTuple):
    """One page of a folder's listing in a bucket: what lies directly in it, in key order."""

    files: list[tuple[str, int]]  # (key, size) of each object directly in the folder
    folders: list[str]  # the key prefix, ending in "/", of each folder directly in it


class SourceFolders(Protocol):
    """A bucket read with the service's credentials as a tree of folders, for importing a
    folder of images; never the store's own objects (NOTE [ Import sources ] in
    service/records/tenancy/import_sources.py)."""

    def pages(self, prefix: str) -> Iterator[SourcePage]:
        """The folder ``prefix`` (ending in ``/``, or ``""``), a page at a time; nothing
        of the store's own prefix."""
        ...

    def open(self, key: str) -> contextlib.AbstractContextManager[tuple[int, BinaryIO]]:
        """(size, a reader of the object's bytes); ``ObjectNotFoundError`` if it is absent,
        unreadable, or the store's own."""
        ...


@runtime_checkable
class DirectTransfers(Protocol):
    """What a store whose objects can reach it without passing through the API offers (the
    S3 store); checked with ``isinstance`` by the routes that need it."""

    def start_direct_upload(self, size: int) -> DirectUpload: ...

    def finish_direct_upload(
        self, upload: DirectUpload, etags: list[str], max_bytes: int | None, size: int
    ) -> tuple[str, int]:
        """Completes the upload of the ``size`` bytes announced, hashes it and installs it;
        (sha256, size). Parts of other lengths than ``size`` gives them are refused
        (``StoreError``) before anything is assembled or copied."""
        ...

    def import_object(self, url: str, max_bytes: int | None) -> tuple[str, int]:
        """Copies an ``s3://`` object into the store; (sha256, size). ``ObjectNotFoundError``
        if it is absent, unreadable, or one of the store's own."""
        ...

    def source_folders(self, bucket: str) -> SourceFolders:
        """``bucket`` as folders to import from (its reads happen on use)."""
        ...
