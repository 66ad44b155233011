"""BNADAPT_LOG_FORMAT=json (NOTE [ JSON logs ]): the real processes' log output, read back.
The worker's supervisor, RQ worker, inspector and a job's process (on a real stack, an adapt
job run), and the API under uvicorn (made to warn: its Redis is unreachable), each write one
JSON object per line, with the job's id where the record is about one."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.answers import created
from harness.digits import digits_npz
from harness.servers import stop_process, wait_for
from harness.stack import REPO, running_stack
from service.local.embedded import free_port
from service.local.up import api_command
from service.public_text import scrub_internals

pytestmark = pytest.mark.slow

FIELDS = {"timestamp", "level", "logger", "message", "process"}


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as a JSON object with the fields every record has."""
    entries = []
    for line in text.splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)  # a line that is not one JSON object fails here
        assert isinstance(entry, dict), line
        assert entry.keys() >= FIELDS, line
        entries.append(entry)
    return entries


def test_worker_processes_and_jobs_log_json_lines(tmp_path: Path) -> None:
    env = {"BNADAPT_LOG_FORMAT": "json", "BNADAPT_WORKER_THREADS": "1"}
    with running_stack(tmp_path, env) as stack:
        client = stack.client("json-logs")
        model = created(client.add_model("digits_cnn", {"width": 8}))
        dataset = created(client.add_dataset(digits_npz(n=256)))
        job = created(
            client.submit(
                {
                    "kind": "adapt",
                    "model_id": model["id"],
                    "dataset_id": dataset["id"],
                    "params": {"estimator": "precise", "batch_size": 64},
                }
            ),
            202,
        )
        assert client.wait(job["id"])["status"] == "succeeded"
        served = client.http.get(f"/v1/jobs/{job['id']}/logs").json()["items"]
        # The job's process wrote the lines of its own log to its output too, named by job.
        wait_for(
            lambda: any(
                e.get("job_id") == job["id"] for e in json_lines(stack.worker_log.read_text())
            ),
            what="a log line of the job in the worker's output",
        )
    entries = json_lines(stack.worker_log.read_text())
    processes = {entry["process"] for entry in entries}
    assert {"supervisor", "worker"} <= processes, processes
    of_job = [entry for entry in entries if entry.get("job_id") == job["id"]]
    assert served, "the job kept a log"
    # What the tenant reads is the operator's line without host or paths (NOTE [ What a
    # job's log shows its tenant ] in workers/running/logs.py).
    for line in served:
        assert any(
            scrub_internals(entry["message"]) == line["message"]
            and entry["logger"] == line["logger"]
            for entry in of_job
        ), (line, of_job)
    for entry in entries:
        assert entry["timestamp"].endswith("+00:00"), entry
        assert entry["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), entry


def test_api_logs_json_lines(tmp_path: Path) -> None:
    # Nothing listens on this port: each request that reads Redis warns, and answers 503.
    port = free_port()
    env = {
        **os.environ,
        "BNADAPT_LOG_FORMAT": "json",
        "BNADAPT_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "BNADAPT_DATA_DIR": str(tmp_path),
        "PYTHONPATH": str(REPO),
    }
    output = tmp_path / "api.log"
    with output.open("wb") as sink:
        api = subprocess.Popen(
            api_command("127.0.0.1", port), env=env, cwd=REPO, stdout=sink, stderr=sink
        )
    try:
        url = f"http://127.0.0.1:{port}"

        def answered() -> bool:
            try:
                return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(answered, what="the API to answer /healthz")
        response = httpx.get(
            f"{url}/v1/models", headers={"Authorization": "Bearer bna_x_y"}, timeout=30
        )
        assert response.status_code == 503, response.text
        wait_for(
            lambda: "redis unreachable" in output.read_text(),
            what="the API's warning in its output",
        )
    finally:
        stop_process(api)
    entries = json_lines(output.read_text())
    warned = [e for e in entries if "redis unreachable" in e["message"]]
    assert warned, entries
    assert all(e["process"] == "api" and e["level"] == "WARNING" for e in warned), warned
