"""``bnadapt up`` and the CLI, as a user runs them: start, use, Ctrl-C, start again."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from harness.digits import digits
from harness.servers import wait_for
from harness.stack import REPO, npz_bytes
from service.client import Client
from service.local.embedded import free_port
from service.local.up import StackError, advertised_host

pytestmark = pytest.mark.slow


def up_args(port: int) -> list[str]:
    return ["--port", str(port), "--device", "cpu"]


def start_up(data_dir: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.local.cli",
            "--data-dir",
            str(data_dir),
            "up",
            *up_args(port),
            *extra,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    for line in process.stdout:  # the banner ends with the Ctrl-C hint once all is ready
        if b"Ctrl-C" in line:
            return process
    raise AssertionError(f"bnadapt up exited with {process.wait()} before it was ready")


def stop_up(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=90) == 0


def run_cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.local.cli", "--data-dir", str(data_dir), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def cli(data_dir: Path, *args: str) -> str:
    result = run_cli(data_dir, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_up_restart_keeps_everything_and_cli_works(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    port = free_port()
    process = start_up(data_dir, port)
    try:
        config = json.loads((data_dir / "client.json").read_text())
        assert config["url"] == f"http://127.0.0.1:{port}"
        x, y = digits(shifted=True, n=200)
        (tmp_path / "shifted.npz").write_bytes(npz_bytes(x=x, y=y))
        model = json.loads(cli(data_dir, "models", "add", "digits_cnn", "--kwargs", '{"width": 8}'))
        dataset = json.loads(cli(data_dir, "datasets", "add", str(tmp_path / "shifted.npz")))
        waited = cli(
            data_dir,
            "jobs",
            "submit",
            "adapt",
            "--model",
            model["id"],
            "--dataset",
            dataset["id"],
            "--params",
            '{"batch_size": 50}',
            "--wait",
        )
        progress, _, as_json = waited.partition("\n{")
        assert "succeeded" in progress  # the progress lines came first
        job = json.loads("{" + as_json)
        client = Client(config["url"], config["key"])
        done = client.wait(job["id"], timeout_s=120)
        assert done.status.value == "succeeded"
        out = cli(data_dir, "jobs", "download", job["id"], "--out", str(tmp_path / "out"))
        report = json.loads((tmp_path / "out" / f"{job['id']}.report.json").read_text())
        # `up` leaves a core to the API and Redis: the job ran on cores - 1 torch threads.
        assert report["torch_threads"] == max((os.cpu_count() or 1) - 1, 1)
        assert done.result is not None
        assert (tmp_path / "out" / f"{done.result.model_id}.safetensors").exists()
        assert str(tmp_path / "out") in out
        assert job["id"] in cli(data_dir, "jobs", "list")
    finally:
        stop_up(process)

    # Everything stopped: nothing answers on the API port any more.
    wait_for(lambda: not _answers(port), timeout_s=10, what="the API to be gone")
    process = start_up(data_dir, port)
    try:
        client = Client(config["url"], config["key"])  # the same key still works
        assert client.job(job["id"]).status.value == "succeeded"
        assert {m.id for m in client.models().items} == {model["id"], done.result.model_id}
        listed = cli(data_dir, "models", "list")
        assert model["id"] in listed
        again = client.submit("adapt", done.result.model_id, dataset["id"])
        assert client.wait(again.id, timeout_s=120).status.value == "succeeded"
    finally:
        stop_up(process)


def _answers(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_up_runs_an_api_of_its_own_for_upload_bytes_at_a_lower_priority(tmp_path: Path) -> None:
    """``bnadapt up --uploads-nice 19``: every upload names a second API process, at nice 19,
    and the CLI's resumable upload sends its parts and completion there and ends registered."""
    data_dir = tmp_path / "data"
    port = free_port()
    process = start_up(data_dir, port, "--uploads-nice", "19")
    try:
        config = json.loads((data_dir / "client.json").read_text())
        client = Client(config["url"], config["key"])
        opened = client.http.post("/v1/uploads", json={"name": "probe"})
        assert opened.status_code == 201, opened.text
        transfer_url = opened.json()["transfer_url"]
        match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)", transfer_url)
        assert match is not None and int(match.group(1)) != port
        uploads_port = int(match.group(1))
        assert _answers(uploads_port)
        # Every thread of the process listening there runs at nice 19 (its copy threads lower
        # still, capped at 19); the main API's request threads at the user's priority.
        assert _listener_nices(uploads_port) == {min(os.nice(0) + 19, 19)}
        assert os.nice(0) in _listener_nices(port)
        x, y = digits(shifted=True, n=200)
        (tmp_path / "shifted.npz").write_bytes(npz_bytes(x=x, y=y))
        dataset = json.loads(cli(data_dir, "datasets", "add", str(tmp_path / "shifted.npz")))
        assert dataset["size_bytes"] == (tmp_path / "shifted.npz").stat().st_size
        assert client.datasets().items[0].id == dataset["id"]
    finally:
        stop_up(process)
    wait_for(lambda: not _answers(uploads_port), timeout_s=10, what="the uploads' API to end")


def test_up_on_every_interface_advertises_a_host_and_keeps_metrics_behind_a_token(
    tmp_path: Path,
) -> None:
    """``bnadapt up --host 0.0.0.0 --uploads-nice 19``: client.json and every upload's
    ``transfer_url`` name this machine, never the wildcard address no client can reach (the
    client sends its key only to the API's own host), and the CLI's upload goes through; an
    API that listens beyond loopback answers /metrics only with the metrics token."""
    data_dir = tmp_path / "data"
    port = free_port()
    process = start_up(data_dir, port, "--host", "0.0.0.0", "--uploads-nice", "19")
    try:
        config = json.loads((data_dir / "client.json").read_text())
        host = socket.gethostname()
        assert config["url"] == f"http://{host}:{port}"  # before: http://0.0.0.0:PORT
        client = Client(config["url"], config["key"])
        opened = client.http.post("/v1/uploads", json={"name": "probe"})
        assert opened.status_code == 201, opened.text
        transfer_url = opened.json()["transfer_url"]
        assert re.fullmatch(rf"http://{re.escape(host)}:\d+", transfer_url), transfer_url
        x, y = digits(shifted=True, n=200)
        (tmp_path / "shifted.npz").write_bytes(npz_bytes(x=x, y=y))
        dataset = json.loads(cli(data_dir, "datasets", "add", str(tmp_path / "shifted.npz")))
        assert dataset["size_bytes"] == (tmp_path / "shifted.npz").stat().st_size
        # A scrape from this machine, with no token set: refused, saying what to set.
        scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert scrape.status_code == 403, scrape.text
        for phrase in ("BNADAPT_METRICS_TOKEN", "0.0.0.0"):
            assert phrase in scrape.json()["detail"], scrape.text
    finally:
        stop_up(process)


def test_a_wildcard_address_is_never_advertised() -> None:
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0") == socket.gethostname()
    assert advertised_host("::", "api.example") == "api.example"
    with pytest.raises(StackError, match=re.escape("--advertise-host '0.0.0.0' is a wildcard")):
        advertised_host("0.0.0.0", "0.0.0.0")


def _listener_nices(port: int) -> set[int]:
    """The nice values of every thread of the process listening on ``port`` (Linux /proc)."""
    inode = _listening_inode(port)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if f"socket:[{inode}]" in links:
            return {
                int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
                for task in (entry / "task").iterdir()
            }
    raise AssertionError(f"no process listens on port {port}")


def _listening_inode(port: int) -> str:
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # LISTEN
            return fields[9]
    raise AssertionError(f"nothing listens on port {port}")


@pytest.mark.parametrize(
    "args",
    [["worker", "--threads", "0"], ["up", "--api-processes", "-1"], ["api", "--workers", "x"]],
)
def test_process_counts_are_checked(tmp_path: Path, args: list[str]) -> None:
    result = run_cli(tmp_path, *args)
    assert result.returncode == 2
    assert "expected 1 or more" in result.stderr or "expected a whole number" in result.stderr


SERVICE_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (supervisor|worker|inspector) ")


def test_up_keeps_the_terminal_for_the_user_and_logs_to_a_file(tmp_path: Path) -> None:
    """`bnadapt up` writes the API's and the worker's logs to logs/service.log under the data
    directory: while a job runs, its terminal shows only `up`'s own lines."""
    data_dir = tmp_path / "data"
    port = free_port()
    terminal = tmp_path / "terminal.txt"
    with terminal.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "service.local.cli", "--data-dir", str(data_dir), "up",
             *up_args(port)],
            cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for(
            lambda: b"Ctrl-C" in terminal.read_bytes() or process.poll() is not None,
            timeout_s=120,
            what="bnadapt up to be ready",
        )
        assert process.poll() is None, terminal.read_text()
        x, y = digits(shifted=True, n=100)
        (tmp_path / "shifted.npz").write_bytes(npz_bytes(x=x, y=y))
        model = json.loads(cli(data_dir, "models", "add", "digits_cnn", "--kwargs", '{"width": 4}'))
        dataset = json.loads(cli(data_dir, "datasets", "add", str(tmp_path / "shifted.npz")))
        waited = cli(
            data_dir, "jobs", "submit", "adapt", "--model", model["id"], "--dataset",
            dataset["id"], "--params", '{"batch_size": 50}', "--wait",
        )  # fmt: skip
        job = json.loads("{" + waited.partition("\n{")[2])
    finally:
        stop_up(process)
    shown = terminal.read_text()
    logged = (data_dir / "logs" / "service.log").read_text()
    # The service's processes wrote their lines to the file, the job's among them ...
    assert {m.group(1) for line in logged.splitlines() if (m := SERVICE_LINE.match(line))} >= {
        "supervisor",
        "worker",
    }, logged
    assert job["id"] in logged
    # ... and none of them to the terminal, which kept `up`'s banner.
    assert "Ctrl-C" in shown
    assert not [line for line in shown.splitlines() if SERVICE_LINE.match(line)], shown
    assert job["id"] not in shown, shown
    assert "Traceback" not in shown, shown
