"""``/metrics`` without a metrics token answers only an API that listens on loopback alone
(NOTE [ Cheap scrapes ] in service/api/metrics.py): a loopback peer proves nothing once the API
listens beyond it, where a reverse proxy on the same machine makes every client one. The API
under uvicorn in its own process (what ``bnadapt api`` and ``bnadapt up`` run) on 0.0.0.0 and
on 127.0.0.1, and in process with ``BNADAPT_API_HOST`` saying where it listens."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from harness.answers import problem
from harness.inprocess import running_api
from harness.servers import stop_process, wait_for
from harness.stack import REPO
from service.api.metrics import listening_addresses
from service.local.embedded import RedisServer, free_port
from service.local.up import api_command


@contextmanager
def uvicorn_api(host: str, redis: RedisServer, data_dir: Path, **env: str) -> Iterator[str]:
    """The API under uvicorn on ``host``, with no metrics token and no BNADAPT_API_HOST
    unless ``env`` sets it; its URL on loopback."""
    port = free_port()
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in ("BNADAPT_METRICS_TOKEN", "BNADAPT_API_HOST")
    }
    environment |= {
        "BNADAPT_REDIS_URL": redis.url,
        "BNADAPT_DATA_DIR": str(data_dir),
        "PYTHONPATH": str(REPO),
        **env,
    }
    process = subprocess.Popen(api_command(host, port), env=environment, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:

        def answers() -> bool:
            try:
                return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(answers, timeout_s=60, what="the API under uvicorn")
        yield url
    finally:
        stop_process(process)


def test_an_api_on_every_interface_wants_the_token(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with uvicorn_api("0.0.0.0", redis_server, tmp_path / "wide") as url:
        # A scrape from this machine (what a reverse proxy here sends): before, answered.
        problem(httpx.get(f"{url}/metrics", timeout=30), 403, "BNADAPT_METRICS_TOKEN", "0.0.0.0")
    # What `bnadapt api --host 0.0.0.0` sets says so too, whatever the sockets show.
    wide = {"BNADAPT_API_HOST": "0.0.0.0"}
    with uvicorn_api("127.0.0.1", redis_server, tmp_path / "said", **wide) as url:
        problem(httpx.get(f"{url}/metrics", timeout=30), 403, "BNADAPT_METRICS_TOKEN")


def test_an_api_on_loopback_answers_without_the_token(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with uvicorn_api("127.0.0.1", redis_server, tmp_path / "narrow") as url:
        scrape = httpx.get(f"{url}/metrics", timeout=30)
        assert scrape.status_code == 200, scrape.text
        assert "bnadapt_queue_depth " in scrape.text


def test_the_setting_counts_where_the_sockets_cannot_be_read(tmp_path: Path) -> None:
    # In this process the API's socket is on loopback; the setting alone says otherwise.
    with running_api(tmp_path, api_host="0.0.0.0") as api:
        assert listening_addresses(api.port) == ["127.0.0.1"]
        problem(api.anonymous().http.get("/metrics"), 403, "BNADAPT_METRICS_TOKEN", "0.0.0.0")


@pytest.mark.parametrize("family", ["127.0.0.1", "::1", "0.0.0.0", "::"])
def test_listening_addresses_reads_the_kernels_table(family: str) -> None:
    kind = socket.AF_INET6 if ":" in family else socket.AF_INET
    with socket.socket(kind) as listener:
        listener.bind((family, 0))
        listener.listen()
        assert listening_addresses(listener.getsockname()[1]) == [family]
