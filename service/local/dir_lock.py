"""The embedded server's data directory lock (service/local/embedded.py).

# NOTE [ Data directory lock ]
Two servers writing one append-only file corrupt it. :meth:`RedisServer.start` takes an
exclusive ``flock`` on ``<data_dir>/redis-server.pid`` and hands the locked descriptor to the
server process, so the lock is held as long as either this object or the server lives: a
server left running by a parent that died still holds it, and a server killed with SIGKILL
releases it once its parent reaps it. The file holds the server's pid for error messages only;
it is never deleted (unlinking a lock file lets two processes lock two different inodes).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from service.errors import DataDirInUseError

__all__ = ["lock_data_dir", "write_pid"]


def lock_data_dir(lock_path: Path) -> int:
    """An open descriptor holding an exclusive flock on ``lock_path``."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUseError(
            f"data dir {lock_path.parent} is in use by another Redis server (pid {holder}); "
            f"stop that server or use another data dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_pid(fd: int, pid: int) -> None:
    """Records the server's pid in the lock file, for error messages only."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{pid}\n".encode(), 0)
