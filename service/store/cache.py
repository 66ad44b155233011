"""A machine's bounded copies of remote store objects, least recently used out first.

Layout under the root::

    objects/<sha256>     complete copies, each checked against its name when it was made
    tmp/<random>.part    copies being made

# NOTE [ Object cache ]
A copy is installed under its name only after its bytes hashed to that name (a download) or
were hashed on their way to the store (a write): a file under ``objects/`` is always the
object, so a hit is used without hashing it again. Using a copy sets its mtime, the LRU order
(atime is unreliable under ``noatime``). When the copies pass ``max_bytes`` the oldest go, but
never one used within ``IN_USE_S``: a job opens the path it was given right away, and an open
file stays readable after it is unlinked. An object larger than the limit is still kept
while it is in use, so a job never fails for want of cache. Several processes of one machine
share the cache: of two downloads of the same object, the first installed stays (the second
is dropped), so a copy's inode never changes under a pin.

# NOTE [ Pinned copies ]
A job uses its copies for as long as it runs, and reopens them by path (an image dataset's
loader processes open the tar again), so "used within ``IN_USE_S``" does not keep a running
job's dataset: another job's download on the machine would evict it after 10 minutes. Inside
:meth:`ObjectCache.pinning` (a job's whole run: workers/running/job.py, a sharded job's
children), every copy handed out (:meth:`get`, :meth:`install`) is pinned: the process opens
it and holds a shared ``flock`` on it until the block ends. Eviction takes an exclusive
``flock`` without waiting before it unlinks a copy, so a pinned copy is skipped, whatever its
age; the pin is the open descriptor, which the kernel closes when the process ends however it
ends, so a crashed job leaves no pin behind and nothing needs cleaning. A pin taken while an
eviction removes the copy finds, once it holds its lock, that the path names another inode or
none: the copy counts as missing and is downloaded again.

# NOTE [ Copies past the page cache ]
A copy is written once and read later, if at all, so its pages need not stay in memory while
it is written: every ``_DROP_EVERY`` bytes the kernel is told to write out and drop what was
written so far (``posix_fadvise(DONTNEED)``, where the platform has it). Left to pile up, the
dirty pages of a large copy, beside the S3 server's own writes on the same machine, get the
writer throttled in the kernel, and each write then costs many times the system CPU it costs
with the advice (bench/history/2026-12-03-s3-write-cache-copy-dirty-pages.md; figures
`s3-write` and `s3-read` in bench/RESULTS.md). The first read of a large copy then comes from
the disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Final, cast

from service.store.base import SHA256_RE, check_sha256

__all__ = ["IN_USE_S", "ObjectCache"]

# A copy used this recently is not evicted.
IN_USE_S: Final = 600.0
_TMP_SUFFIX: Final = ".part"
# A temp file untouched this long belongs to a process that died.
_TMP_MAX_AGE_S: Final = 3600.0
# NOTE [ Copies past the page cache ]
_DROP_EVERY: Final = 16 * 1024 * 1024
_CAN_DROP: Final = hasattr(os, "posix_fadvise")


class _CopyFile(io.FileIO):
    """A copy being written (unbuffered: its writers write whole chunks) that keeps few of its
    pages in memory (NOTE [ Copies past the page cache ])."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "xb")
        self._since_drop = 0

    def write(self, data: Any, /) -> int:
        with memoryview(data) as view, view.cast("B") as octets:
            done = 0
            while done < len(octets):
                done += super().write(octets[done:]) or 0
        self._since_drop += done
        if _CAN_DROP and self._since_drop >= _DROP_EVERY:
            self._since_drop = 0
            # Starts the write-out of the dirty pages and drops the clean ones (those written
            # out since the last call): a few pages per call, never a wait for the disk.
            os.posix_fadvise(self.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return done


class ObjectCache:
    """Copies of objects in a local directory, at most ``max_bytes`` of them beyond those in
    use. Directories are made on the first write."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        # NOTE [ Pinned copies ]: sha256 -> the descriptor holding its shared lock, while a
        # `pinning` block runs; None outside one.
        self._pins: dict[str, int] | None = None
        self._pins_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ObjectCache({str(self.root)!r}, max_bytes={self.max_bytes})"

    def _path(self, sha256: str) -> Path:
        return self._objects / check_sha256(sha256)

    def get(self, sha256: str) -> Path | None:
        """The copy of the object, marked as just used (and pinned inside :meth:`pinning`);
        None if there is none."""
        path = self._path(sha256)
        try:
            os.utime(path)
        except FileNotFoundError:
            return None
        if not self._pin(sha256, path):
            return None  # evicted meanwhile
        return path

    @contextlib.contextmanager
    def pinning(self) -> Iterator[None]:
        """Within the block, every copy this cache hands out stays on the machine until the
        block ends (NOTE [ Pinned copies ])."""
        with self._pins_lock:
            if self._pins is not None:
                raise RuntimeError(f"{self!r} is already pinning: blocks do not nest")
            self._pins = {}
        try:
            yield
        finally:
            with self._pins_lock:
                pins, self._pins = self._pins or {}, None
            for fd in pins.values():
                os.close(fd)

    def _pin(self, sha256: str, path: Path) -> bool:
        """Pins the copy at ``path`` if a :meth:`pinning` block runs; False if it was evicted
        before the pin held (NOTE [ Pinned copies ])."""
        with self._pins_lock:
            if self._pins is None or sha256 in self._pins:
                return True
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if not _same_file(fd, path):
                    os.close(fd)
                    return False
            except BaseException:
                os.close(fd)
                raise
            self._pins[sha256] = fd
            return True

    @contextlib.contextmanager
    def new_file(self) -> Iterator[tuple[Path, BinaryIO]]:
        """A temp file to fill; the caller :meth:`install`s it, else it is removed on exit."""
        self._tmp.mkdir(parents=True, exist_ok=True)
        path = self._tmp / f"{secrets.token_hex(16)}{_TMP_SUFFIX}"
        try:
            with _CopyFile(path) as file:
                yield path, cast(BinaryIO, file)
        finally:
            path.unlink(missing_ok=True)  # gone already once installed

    def install(self, tmp: Path, sha256: str) -> Path:
        """Moves a complete temp file whose bytes hash to ``sha256`` under its name, then
        evicts what is over the limit; returns the copy's path."""
        final = self._path(sha256)
        self._objects.mkdir(parents=True, exist_ok=True)
        try:
            os.link(tmp, final)  # never over a copy already there: it may be pinned
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                os.utime(final)  # another process's identical copy, kept
        if not self._pin(sha256, final):
            os.replace(tmp, final)  # that copy was evicted meanwhile: this one takes its place
            self._pin(sha256, final)  # just written: no eviction takes it now
        tmp.unlink(missing_ok=True)
        self.evict()
        return final

    def discard(self, sha256: str) -> None:
        self._path(sha256).unlink(missing_ok=True)

    def evict(self) -> int:
        """Removes the least recently used copies until the rest fit in ``max_bytes`` (copies
        used within ``IN_USE_S`` stay); also temp files of dead processes. Returns how many
        copies went."""
        now = time.time()
        self._remove_stale_tmp(now)
        entries: list[tuple[float, int, Path]] = []
        with contextlib.suppress(FileNotFoundError):
            for entry in self._objects.iterdir():
                if SHA256_RE.fullmatch(entry.name) is None:
                    continue
                try:
                    info = entry.stat()
                except FileNotFoundError:
                    continue
                entries.append((info.st_mtime, info.st_size, entry))
        total = sum(size for _, size, _ in entries)
        removed = 0
        for mtime, size, entry in sorted(entries):
            if total <= self.max_bytes:
                break
            if now - mtime < IN_USE_S or not _remove_unpinned(entry):
                continue
            total -= size
            removed += 1
        return removed

    def pinned(self) -> list[str]:
        """The objects this process pins now (NOTE [ Pinned copies ])."""
        with self._pins_lock:
            return sorted(self._pins or ())

    def _remove_stale_tmp(self, now: float) -> None:
        with contextlib.suppress(FileNotFoundError):
            for entry in self._tmp.iterdir():
                try:
                    if now - entry.stat().st_mtime > _TMP_MAX_AGE_S:
                        entry.unlink()
                except FileNotFoundError:
                    continue

    def size_bytes(self) -> int:
        """Bytes the copies take now."""
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in self._objects.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat().st_size
        return total


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _remove_unpinned(path: Path) -> bool:
    """Unlinks the copy unless a process pins it (NOTE [ Pinned copies ]); True if it went."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # pinned
        if not _same_file(fd, path):
            return False  # replaced meanwhile: the new copy is another's to judge
        path.unlink()
        return True
    finally:
        os.close(fd)  # drops the lock; a pin waiting on it then finds the path gone
