"""The job API a user and an operator lean on, end to end over HTTP (a real Redis-compatible
server, the API under uvicorn, a real worker): tags and filters, unknown filters refused,
delete and retention, job logs, live events (SSE), progress that is true in every phase, a
canceled job never reported as succeeded, reports that mean something on a fresh model, and
the CLI (its new commands, its help, a closed pipe)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from harness.answers import created, problem
from harness.digits import digits_npz
from harness.servers import wait_for
from harness.stack import REPO, Client, Stack, npz_bytes
from service.client import Client as ApiClient
from service.local.cli import _parser
from service.records import keys
from service.upkeep.retention import delete_expired_jobs
from tests.e2e.test_e2e import long_train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


def _key(client: Client) -> str:
    return str(client.http.headers["authorization"]).split(" ", 1)[1]


def _small_adapt(client: Client, **extra: Any) -> dict[str, Any]:
    model = created(client.add_model("digits_cnn", {"width": 4}, seed=1))
    dataset = created(client.add_dataset(digits_npz(n=300)))
    return {
        "kind": "adapt",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"batch_size": 10, "estimator": "cumulative"},
        **extra,
    }


def cli(stack: Stack, client: Client, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**stack.env, "BNADAPT_URL": stack.url, "BNADAPT_API_KEY": _key(client)}
    return subprocess.run(
        [sys.executable, "-m", "service.local.cli", *argv],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_tags_filters_and_unknown_filters(stack: Stack) -> None:
    client = stack.client("filters")
    body = _small_adapt(client)
    tagged = created(client.submit({**body, "tags": {"experiment": "shift-3"}}), 202)
    assert tagged["tags"] == {"experiment": "shift-3"}
    other_model = created(client.add_model("digits_cnn", {"width": 4}, seed=2))
    other = created(client.submit({**body, "model_id": other_model["id"]}), 202)
    evaluate = created(client.submit({**body, "kind": "evaluate", "params": {}}), 202)

    def ids(**params: Any) -> set[str]:
        response = client.http.get("/v1/jobs", params=params)
        assert response.status_code == 200, response.text
        return {job["id"] for job in response.json()["items"]}

    everything = {tagged["id"], other["id"], evaluate["id"]}
    assert ids() == everything
    # Each filter used to be ignored silently (model_id, kind) or did not exist (tag).
    assert ids(model_id=other_model["id"]) == {other["id"]}
    assert ids(kind="evaluate") == {evaluate["id"]}
    assert ids(kind="adapt", model_id=body["model_id"]) == {tagged["id"]}
    assert ids(dataset_id=body["dataset_id"]) == everything
    assert ids(tag="experiment:shift-3") == {tagged["id"]}
    assert ids(tag="experiment:other") == set()
    problem(client.http.get("/v1/jobs", params={"model": "x"}), 422, "unknown query parameter")
    problem(client.http.get("/v1/jobs", params={"kind": "nope"}), 422)
    problem(client.submit({**body, "tags": {"bad key!": "x"}}), 422)
    for job in everything:
        client.wait(job)
    # The CLI's filters reach the API.
    listed = cli(stack, client, "jobs", "list", "--tag", "experiment=shift-3")
    assert listed.returncode == 0, listed.stderr
    assert tagged["id"] in listed.stdout and other["id"] not in listed.stdout
    listed = cli(stack, client, "jobs", "list", "--kind", "evaluate")
    assert listed.stdout.split() and listed.stdout.split()[0] == evaluate["id"]


def test_delete_and_retention_drop_records_and_store_references(stack: Stack) -> None:
    client = stack.client("retention")
    body = _small_adapt(client)
    job = created(client.submit(body), 202)
    running = client.http.get(f"/v1/jobs/{job['id']}").json()
    if running["status"] in ("queued", "running"):
        problem(client.http.delete(f"/v1/jobs/{job['id']}"), 409, "cancel it")
    done = client.wait(job["id"])
    assert done["status"] == "succeeded"
    records = stack.records()
    report_sha = records.report_sha256(job["id"])
    assert report_sha is not None
    assert job["id"] in {m.decode() for m in records.client.smembers(keys.sha_refs(report_sha))}
    assert client.http.delete(f"/v1/jobs/{job['id']}").status_code == 204
    problem(client.http.get(f"/v1/jobs/{job['id']}"), 404)
    assert not records.client.smembers(keys.sha_refs(report_sha)), "the report is left unused"
    assert not records.client.exists(keys.job_logs(job["id"]))
    # The model it registered is a resource of its own.
    assert client.http.get(f"/v1/models/{done['result']['model_id']}").status_code == 200

    # Retention: a job that ended long enough ago goes the same way.
    old = created(client.submit(body), 202)
    assert client.wait(old["id"])["status"] == "succeeded"
    assert delete_expired_jobs(records, retention_s=3600) == 0
    assert delete_expired_jobs(records, retention_s=3600, now=time.time() + 7200) >= 1
    problem(client.http.get(f"/v1/jobs/{old['id']}"), 404)


def test_events_stream_progress_and_end(stack: Stack) -> None:
    client = stack.client("events")
    # Long enough to be seen running, several times the 0.5 s between the worker's progress
    # writes: 900 batches of 2 through a residual network, measured before and after (a
    # tiny CNN's ran in under 0.5 s on a fast machine, and the stream saw only "saving").
    model = created(client.add_model("resnet", {"in_channels": 1, "depth": 2, "width": 16}))
    full = created(client.add_dataset(digits_npz()))
    body = {
        "kind": "adapt",
        "model_id": model["id"],
        "dataset_id": full["id"],
        "params": {"batch_size": 2, "estimator": "cumulative"},
    }
    job = created(client.submit(body), 202)
    events: list[tuple[str, dict[str, Any]]] = []
    api = ApiClient(stack.url, _key(client))
    for event in api.events(job["id"], logs=True):
        events.append(event)
    names = [name for name, _ in events]
    assert names[0] == "status" and names[-1] == "end", names
    assert "progress" in names and "log" in names, names
    assert events[-1][1]["status"] == "succeeded"
    phases = [data["phase"] for name, data in events if name == "progress"]
    assert {"evaluate before", "adapt", "evaluate after"} & set(phases), phases
    # The final progress keeps the work's figures: never "saving 1/1 batches at 0 samples/s".
    final = events[-1][1]["progress"]
    assert final["total"] > 1 and final["done"] == final["total"], final
    assert final["samples_per_second"] > 0, final
    # Raw stream: the SSE wire format, as a browser's EventSource reads it.
    with httpx.stream(
        "GET",
        f"{stack.url}/v1/jobs/{job['id']}/events",
        headers={"Authorization": f"Bearer {_key(client)}"},
        timeout=30,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    assert text.startswith("event: status\ndata: {") and "event: end\n" in text
    # Another tenant cannot watch it.
    stranger = stack.client("stranger")
    assert stranger.http.get(f"/v1/jobs/{job['id']}/events").status_code == 404


def test_a_train_job_streams_each_epoch_as_an_event_of_its_own(stack: Stack) -> None:
    client = stack.client("epoch-events")
    model = created(client.add_model("digits_cnn", {"width": 4}, seed=1))
    dataset = created(client.add_dataset(digits_npz(n=300)))
    body = {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        # A schedule that moves and a best epoch: the events carry both, as the report does.
        "params": {"epochs": 3, "batch_size": 32, "lr_schedule": "cosine", "keep_best": True},
    }
    job = created(client.submit(body), 202)
    api = ApiClient(stack.url, _key(client))
    events = list(api.events(job["id"]))
    names = [name for name, _ in events]
    assert names[-1] == "end" and events[-1][1]["status"] == "succeeded", names
    epochs = [data for name, data in events if name == "epoch"]
    # One event an epoch, in order, before the end, with the report's numbers.
    assert [e["epoch"] for e in epochs] == [1, 2, 3], names
    assert names.index("epoch") < names.index("end")
    report = client.http.get(events[-1][1]["result"]["report_url"]).json()
    assert len(report["epochs"]) == 3
    for event, logged in zip(epochs, report["epochs"], strict=True):
        assert event == logged | {"epochs": 3}
        assert event["val_loss"] is not None and event["lr"] is not None
    assert epochs[0]["best"] is True
    assert report["best_epoch"] == max(e["epoch"] for e in epochs if e["best"])
    assert epochs[2]["lr"] < epochs[0]["lr"]  # cosine: down over the job's steps
    # A stream opened after the job ended sends the epochs again, then the end.
    again = [name for name, _ in api.events(job["id"])]
    assert again == ["status", "progress", "epoch", "epoch", "epoch", "end"], again
    # An adapt job has no epochs.
    adapt = created(client.submit(_small_adapt(client)), 202)
    assert "epoch" not in [name for name, _ in api.events(adapt["id"])]


def test_logs_are_kept_and_tenant_scoped(stack: Stack) -> None:
    client = stack.client("logs")
    body = _small_adapt(client)
    # Its log says it started and ended; the API's /logs and the CLI's `jobs logs -f` agree.
    job = created(client.submit(body), 202)
    assert client.wait(job["id"])["status"] == "succeeded"
    logs = client.http.get(f"/v1/jobs/{job['id']}/logs").json()
    messages = [entry["message"] for entry in logs["items"]]
    assert any("started" in m for m in messages), messages
    assert any("ended succeeded" in m for m in messages), messages
    assert logs["last_seq"] == logs["items"][-1]["seq"]
    later = client.http.get(f"/v1/jobs/{job['id']}/logs", params={"after": logs["last_seq"]})
    assert later.json()["items"] == []
    assert stack.client("other").http.get(f"/v1/jobs/{job['id']}/logs").status_code == 404
    shown = cli(stack, client, "jobs", "logs", "-f", job["id"])
    assert shown.returncode == 0, shown.stderr
    assert "ended succeeded" in shown.stdout


def test_failed_job_logs_why_without_its_traceback(stack: Stack) -> None:
    client = stack.client("failing")
    model = created(client.add_model("digits_cnn", {"width": 4}, seed=1))
    # Finite inputs whose convolutions overflow: the worker fails the job (non-finite
    # statistics). Its log says why; the traceback stays in the worker's log (NOTE [ What a
    # job's log shows its tenant ], tests/e2e/test_job_logs_public.py).
    huge = np.full((16, 1, 8, 8), 3e38, np.float32)
    dataset = created(client.add_dataset(npz_bytes(x=huge)))
    body = {
        "kind": "adapt",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"batch_size": 8, "estimator": "cumulative"},
    }
    job = created(client.submit(body), 202)
    done = client.wait(job["id"])
    assert done["status"] == "failed", done
    messages = "\n".join(
        e["message"] for e in client.http.get(f"/v1/jobs/{job['id']}/logs").json()["items"]
    )
    assert "Traceback" not in messages, messages
    assert "non-finite" in messages


def test_metrics_name_the_series_an_operator_watches(stack: Stack) -> None:
    client = stack.client("metrics")
    job = created(client.submit(_small_adapt(client)), 202)
    client.wait(job["id"])
    client.http.get("/v1/jobs")
    text = httpx.get(f"{stack.url}/metrics", timeout=30).text
    for series in (
        'bnadapt_http_request_duration_seconds_bucket{le="0.005",method="GET",'
        'route="/v1/jobs",status="200"}',
        'bnadapt_jobs{kind="adapt",status="succeeded"}',
        'bnadapt_job_duration_seconds_count{kind="adapt",status="succeeded"}',
        'bnadapt_job_queue_wait_seconds_sum{kind="adapt"}',
        "bnadapt_queue_depth ",
        "bnadapt_queue_oldest_wait_seconds ",
        "bnadapt_workers 1.0",
        "bnadapt_workers_busy ",
        "bnadapt_worker_busy_seconds ",
        "bnadapt_store_bytes ",
        "bnadapt_store_objects ",
    ):
        assert series in text, f"{series} not in /metrics:\n{text[:3000]}"


def test_canceled_job_is_never_reported_ok(stack: Stack) -> None:
    client = stack.client("cancel-log")
    running = created(client.submit(long_train(client)), 202)
    wait_for(
        lambda: client.http.get(f"/v1/jobs/{running['id']}").json()["status"] == "running",
        timeout_s=60,
        what="the long job to start",
    )
    created(client.http.post(f"/v1/jobs/{running['id']}:cancel"), 202)
    assert client.wait(running["id"], timeout_s=60)["status"] == "canceled"
    lines = wait_for(
        lambda: [
            line
            for line in stack.worker_log.read_text(errors="replace").splitlines()
            if f"({running['id']})" in line and "Worker" in line
        ],
        timeout_s=20,
        what="RQ's line about the canceled job",
    )
    assert not any("Job OK" in line for line in lines), lines
    assert any("job ended canceled" in line for line in lines), lines


def test_fresh_model_report_and_cli_report(stack: Stack) -> None:
    client = stack.client("report")
    job = created(client.submit(_small_adapt(client)), 202)
    assert client.wait(job["id"])["status"] == "succeeded"
    report = client.http.get(f"/v1/jobs/{job['id']}/report").json()
    tensors = {t["name"]: t for t in report["tensors"]}
    # A fresh model: running_mean starts at zero, num_batches_tracked at 0. These once read
    # relative_l2 7.9e37 and 2.5e39.
    mean = next(t for name, t in tensors.items() if name.endswith("running_mean"))
    assert mean["relative_l2"] is None and mean["l2"] > 0
    count = next(t for name, t in tensors.items() if name.endswith("num_batches_tracked"))
    assert count["relative_l2"] is None
    assert (count["before"], count["after"]) == (0, 30)
    assert all(t["relative_l2"] is None or t["relative_l2"] < 1e6 for t in tensors.values())
    shown = cli(stack, client, "jobs", "report", job["id"])
    assert shown.returncode == 0, shown.stderr
    assert "statistics consistent with the batches run: yes" in shown.stdout
    assert "var ratio" in shown.stdout


def test_cli_commands_and_closed_pipe(stack: Stack, tmp_path: Path) -> None:
    client = stack.client("cli")
    body = _small_adapt(client)
    job = created(client.submit(body), 202)
    client.wait(job["id"])
    listed = cli(stack, client, "datasets", "list")
    assert body["dataset_id"] in listed.stdout, listed.stderr
    out = tmp_path / "w.safetensors"
    downloaded = cli(stack, client, "models", "download", body["model_id"], "--out", str(out))
    assert downloaded.returncode == 0 and out.stat().st_size > 0, downloaded.stderr
    # `bnadapt jobs show ... | head -1` once ended in a BrokenPipeError traceback.
    env = {**stack.env, "BNADAPT_URL": stack.url, "BNADAPT_API_KEY": _key(client)}
    piped = subprocess.run(
        f"{sys.executable} -m service.local.cli jobs show {job['id']} | head -1",
        shell=True,
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert piped.stdout.strip() == "{"
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr, piped.stderr
    assert cli(stack, client, "jobs", "delete", job["id"]).returncode == 0
    assert cli(stack, client, "datasets", "delete", body["dataset_id"]).returncode == 0
    assert cli(stack, client, "models", "delete", body["model_id"]).returncode == 0
    assert client.http.get(f"/v1/datasets/{body['dataset_id']}").status_code == 404
    # keys list/revoke talk to Redis, as an operator does.
    key = _key(client)
    key_id = key.split("_")[1]
    admin = {**stack.env, "BNADAPT_REDIS_URL": stack.redis.url}
    run = [sys.executable, "-m", "service.local.cli", "keys"]
    listed_keys = subprocess.run(
        [*run, "list"], env=admin, cwd=REPO, capture_output=True, text=True, check=True
    )
    assert key_id in listed_keys.stdout and key.split("_", 2)[2] not in listed_keys.stdout
    subprocess.run([*run, "revoke", key_id], env=admin, cwd=REPO, check=True, capture_output=True)
    assert client.http.get("/v1/jobs").status_code == 401


def _options(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _options(child, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_cli_option_has_help() -> None:
    # --host, --port, --model, --dataset and --status once had none.
    missing = [
        f"{path} {action.option_strings or action.dest}"
        for path, action in _options(_parser(), "bnadapt")
        if not action.help
    ]
    assert missing == []


def test_submit_wait_follows_the_event_stream(stack: Stack) -> None:
    client = stack.client("wait")
    body = _small_adapt(client)
    submitted = cli(
        stack,
        client,
        "jobs",
        "submit",
        "adapt",
        "--model",
        body["model_id"],
        "--dataset",
        body["dataset_id"],
        "--params",
        json.dumps(body["params"]),
        "--tag",
        "run=cli",
        "--wait",
    )
    assert submitted.returncode == 0, submitted.stderr
    lines = submitted.stdout.splitlines()
    # Not a terminal: a line per status or phase, from the events; the last one keeps the
    # work's figures (once "saving 1/1 batches" at 0 samples/s).
    assert lines[0].endswith(" queued"), lines
    final = next(line for line in lines if " succeeded " in line)
    assert "samples/s" in final and "1/1 batches" not in final, final
    job = json.loads(submitted.stdout[submitted.stdout.index("{") :])
    assert job["status"] == "succeeded" and job["tags"] == {"run": "cli"}
