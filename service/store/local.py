"""The content-addressed artifact store: weights, datasets and reports, named by sha256.

Layout under the root::

    objects/<first two hex digits>/<sha256>   committed objects, never modified
    tmp/<random>.part                         objects being written
    trash/<sha256>.<random>                   objects the collector is about to delete

# NOTE [ Atomic commit ]
An object appears under its name complete or not at all. It is written to a temp file on the
same filesystem, flushed and fsynced, then renamed over its final name (``os.replace`` is atomic
on POSIX), and the directory is fsynced so the rename itself survives a power cut. Readers
therefore never see a partial object, and a crash leaves at most a stray temp file, which
:meth:`LocalStore.cleanup_tmp` removes. Two writers of the same content race harmlessly: both
renames install identical bytes. A write that finds its object already there sets the
object's mtime instead, which tells the garbage collector that someone is about to use it
(NOTE [ Store garbage collection ] in service/store/gc.py).
"""

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Final

from service.errors import ObjectNotFoundError
from service.store.base import (
    DEFAULT_TMP_MAX_AGE_S,
    SHA256_RE,
    HashingWriter,
    ObjectWriter,
    StoredObject,
    check_sha256,
)

__all__ = ["LocalStore"]

_TMP_SUFFIX: Final = ".part"


class _LocalWriter(HashingWriter):
    """Hashes and counts chunks on their way into one temp file."""

    def __init__(self, file: BinaryIO, max_bytes: int | None, sha256: str | None) -> None:
        super().__init__(max_bytes, sha256)
        self._file = file

    def _put(self, chunk: bytes) -> None:
        self._file.write(chunk)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """A :class:`Store` in a local directory (or a shared mount every worker sees).

    Directories are created on the first write, so building one touches nothing.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self._trash = self.root / "trash"

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, sha256: str) -> Path:
        check_sha256(sha256)
        return self._objects / sha256[:2] / sha256

    @contextlib.contextmanager
    def writer(
        self, max_bytes: int | None = None, sha256: str | None = None
    ) -> Iterator[ObjectWriter]:
        self._tmp.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp / f"{secrets.token_hex(16)}{_TMP_SUFFIX}"
        # O_EXCL: never share a temp file; mode 0o644 (less the umask) so workers running as
        # another user can read committed objects, which mkstemp's 0o600 would prevent.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        committed = False
        try:
            with os.fdopen(fd, "wb") as file:
                writer = _LocalWriter(file, max_bytes, sha256)
                yield writer
                writer.finish()
                file.flush()
                os.fsync(file.fileno())
            self._commit(tmp, writer.sha256)
            committed = True
        finally:
            # Also on GeneratorExit and KeyboardInterrupt: no temp file outlives a failed write.
            if not committed:
                tmp.unlink(missing_ok=True)

    def _commit(self, tmp: Path, sha256: str) -> None:
        """Moves a complete, fsynced temp file to its final name (NOTE [ Atomic commit ])."""
        final = self._path(sha256)
        try:
            # Same name, same bytes: keep the existing object and mark it as just written.
            # One call, so that the collector either sees the new mtime or finds the object
            # gone from its name and lets this write install it again.
            os.utime(final)
        except (FileNotFoundError, PermissionError):
            # PermissionError: the object belongs to another user (an API and workers running
            # as different users); the rename below installs our copy, as fresh as a touch.
            pass
        else:
            tmp.unlink()
            return
        shard = final.parent
        missing = [d for d in (self._objects, shard) if not d.exists()]
        shard.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
        _fsync_dir(shard)
        for created in missing:
            _fsync_dir(created.parent)  # a new directory's own entry lives in its parent

    def put_bytes(self, data: bytes) -> str:
        with self.writer() as writer:
            writer.write(data)
        return writer.sha256

    def open(self, sha256: str) -> BinaryIO:
        try:
            return self._path(sha256).open("rb")
        except FileNotFoundError:
            raise ObjectNotFoundError(f"no object {sha256} in {self.root}") from None

    def local_path(self, sha256: str) -> Path:
        path = self._path(sha256)
        if not path.is_file():
            raise ObjectNotFoundError(f"no object {sha256} in {self.root}")
        return path

    def pinning(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to pin: the objects are this directory's, removed only by the collector,
        which never removes one that a job uses."""
        return contextlib.nullcontext()

    def exists(self, sha256: str) -> bool:
        return self._path(sha256).is_file()

    def objects(self) -> Iterator[StoredObject]:
        if not self._objects.is_dir():
            return
        for shard in sorted(self._objects.iterdir()):
            for entry in sorted(shard.iterdir()) if shard.is_dir() else ():
                if SHA256_RE.fullmatch(entry.name) is None:
                    continue
                try:
                    info = entry.stat()
                except FileNotFoundError:
                    continue  # collected meanwhile
                yield StoredObject(entry.name, info.st_mtime, info.st_size)

    def remove_unused(self, sha256: str, cutoff: float, in_use: Callable[[str], bool]) -> bool:
        final = self._path(sha256)
        try:
            if final.stat().st_mtime >= cutoff or in_use(sha256):
                return False
        except FileNotFoundError:
            return False
        self._trash.mkdir(parents=True, exist_ok=True)
        moved = self._trash / f"{sha256}.{secrets.token_hex(8)}"
        try:
            os.replace(final, moved)  # from here on a writer finds no object and writes anew
        except FileNotFoundError:
            return False
        try:
            return self._settle(moved, sha256, cutoff, in_use)
        except FileNotFoundError:
            return False  # settled by another collector whose lock had expired

    def _settle(
        self, moved: Path, sha256: str, cutoff: float, in_use: Callable[[str], bool]
    ) -> bool:
        """Deletes an object moved to the trash, or puts it back if a writer touched it
        before it moved or someone now refers to it."""
        if moved.stat().st_mtime < cutoff and not in_use(sha256):
            moved.unlink()
            return True
        final = self._path(sha256)
        if final.exists():
            moved.unlink()  # a writer installed the same bytes again meanwhile
        else:
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(moved, final)
        return False

    def settle_trash(self, cutoff: float, in_use: Callable[[str], bool]) -> int:
        if not self._trash.is_dir():
            return 0
        deleted = 0
        for entry in sorted(self._trash.iterdir()):
            sha256 = entry.name.partition(".")[0]
            if SHA256_RE.fullmatch(sha256) is None:
                continue
            try:
                deleted += self._settle(entry, sha256, cutoff, in_use)
            except FileNotFoundError:
                continue  # settled by another collector whose lock had expired
        return deleted

    def download_url(self, sha256: str, filename: str) -> str | None:
        return None  # a directory has no URL of its own: the API streams the object

    def warm_up(self) -> None:
        """Nothing to make: a directory needs no client."""

    def cleanup_tmp(self, older_than_s: float = DEFAULT_TMP_MAX_AGE_S) -> int:
        if older_than_s < 0:
            raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
        if not self._tmp.is_dir():
            return 0
        cutoff = time.time() - older_than_s
        removed = 0
        for entry in self._tmp.iterdir():
            if entry.suffix != _TMP_SUFFIX:
                continue
            try:
                if entry.stat().st_mtime < cutoff:
                    entry.unlink()
                    removed += 1
            except FileNotFoundError:
                continue  # finished or cleaned up by someone else meanwhile
        return removed
