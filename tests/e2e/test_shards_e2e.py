"""Sharded adaptation end to end: a real Redis-compatible server, the API under uvicorn and two
real workers taking the shards of one job."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

from api_schemas.reports import Report
from harness.answers import created
from harness.digits import digits, digits_npz
from harness.servers import stop_process, wait_for
from harness.stack import Client, Stack, npz_bytes, running_stack
from service.local.summary import diagnostic_lines
from service.records import keys
from service.records.job_life.shards import FINISH, MERGE, ChildState, ShardRecords
from tests.workers.estimators.test_auto import assert_rule_holds, assert_same_choice, trained_digits
from tests.workers.test_shards import assert_same_adaptation

pytestmark = pytest.mark.slow

SHARDS = ("shard-0", "shard-1", "shard-2", "shard-3")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("stack"), workers=2) as stack:
        yield stack


def adapt(model: dict[str, Any], dataset: dict[str, Any], **params: Any) -> dict[str, Any]:
    return {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"], "params": params}


def weights(client: Client, job: dict[str, Any]) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(client.http.get(job["result"]["weights_url"]).content)


def once_ended(shard_records: ShardRecords, job_id: str, child: str) -> dict[str, ChildState]:
    """The states of the job's children once ``child`` is not (or no longer) running."""

    def ended() -> dict[str, ChildState] | None:
        children = shard_records.children(job_id) or {}
        return children if children.get(child) not in (None, ChildState.RUNNING) else None

    children = wait_for(ended, timeout_s=30, what=f"{child} to end")
    assert children is not None
    return children


def registered_by_jobs(client: Client) -> list[str]:
    return [m["id"] for m in client.http.get("/v1/models").json()["items"] if m["source"] == "job"]


def test_sharded_jobs_equal_one_worker(stack: Stack) -> None:
    client = stack.client("equal")
    model = created(client.add_model("digits_cnn", {"width": 8}, seed=3))
    dataset = created(client.add_dataset(digits_npz(shifted=True)))  # 1797 samples
    cases: list[dict[str, Any]] = [
        {"estimator": "precise"},
        {"estimator": "cumulative"},
        {"estimator": "prior", "prior_strength": 300.0},
    ]
    jobs = [
        created(client.submit(adapt(model, dataset, batch_size=100, shards=k, **p)), 202)["id"]
        for p in cases
        for k in (1, 3)
    ]
    done = [client.wait(job_id, timeout_s=300) for job_id in jobs]
    assert [job["status"] for job in done] == ["succeeded"] * 6, done
    shard_records = ShardRecords(stack.records().client)
    for single, sharded in zip(done[::2], done[1::2], strict=True):
        # 18 batches, the last of 97 samples, in 3 shards of 6.
        assert_same_adaptation(weights(client, sharded), weights(client, single), 18)
        report = client.http.get(sharded["result"]["report_url"]).json()
        assert [(s["index"], s["first_batch"], s["batches"]) for s in report["shards"]] == [
            (0, 0, 6),
            (1, 6, 6),
            (2, 12, 6),
        ]
        assert [s["samples"] for s in report["shards"]] == [600, 600, 597]
        # RQ's worker names, hashed: no hostname reaches a tenant.
        assert all(re.fullmatch(r"w-[0-9a-f]{10}", s["worker"]) for s in report["shards"])
        assert (report["batches"], report["samples"]) == (18, 1797)
        single_report = client.http.get(single["result"]["report_url"]).json()
        assert single_report["shards"] == []
        # Measured before and after on all 1797 digits, in three parts each of the batches
        # one worker measures: the same accuracy.
        for which in ("metrics_before", "metrics_after"):
            got, want = report[which], single_report[which]
            assert (got["num_samples"], got["accuracy"]) == (1797, want["accuracy"]), which
            # Before: the same model in the same batches; after: merged statistics within
            # 1e-6 of one worker's (module docstring), so the loss is too.
            rel = 1e-12 if which == "metrics_before" else 1e-6
            assert got["loss"] == pytest.approx(want["loss"], rel=rel), which
        assert report["metrics_after"] != report["metrics_before"]  # the adapted model's
        # Three shards, the merge, three evaluations and the finish ran, each once.
        evaluations = ("eval-0", "eval-1", "eval-2")
        assert shard_records.children(sharded["id"]) == dict.fromkeys(
            ("shard-0", "shard-1", "shard-2", MERGE, *evaluations, FINISH), "done"
        )
        assert shard_records.children(single["id"]) is None
        # The merge's hold on the weights ended with the job: the model's own is left (and
        # the single worker's model's, if its bytes came out the same).
        output = client.http.get(f"/v1/models/{sharded['result']['model_id']}").json()
        owners = shard_records.client.smembers(keys.sha_refs(output["sha256"]))
        assert output["id"].encode() in owners
        assert not [owner for owner in owners if owner.endswith(b"-merge")]
    # Shard jobs are no jobs of the user's.
    listed = [job["id"] for job in client.http.get("/v1/jobs").json()["items"]]
    assert sorted(listed) == sorted(jobs)


def test_a_failed_shard_fails_its_job_with_the_shards_message(stack: Stack) -> None:
    # 33 samples in batches of 8: the 5th batch holds 1 sample, which BatchNorm1d refuses in
    # train mode. Shard 2 of 2 runs it; shard 1 alone would succeed.
    client = stack.client("failing")
    model = created(client.add_model("mlp", {"in_features": 64}))
    x, _ = digits(n=33)
    dataset = created(client.add_dataset(npz_bytes(x=x.reshape(33, 64))))
    body = adapt(model, dataset, estimator="precise", batch_size=8)
    single = client.wait(created(client.submit(body), 202)["id"])
    body["params"]["shards"] = 2
    sharded = client.wait(created(client.submit(body), 202)["id"])
    assert single["status"] == sharded["status"] == "failed"
    assert "the last batch holds one sample (33 samples in batches of 8)" in single["error"]
    assert sharded["error"].startswith("shard 2 of 2 (batches 3 to 4) failed: ")
    assert sharded["error"].endswith(single["error"])
    # Shard 1 ends as it may: done, stopped at its next batch, or never started.
    children = once_ended(ShardRecords(stack.records().client), sharded["id"], "shard-0")
    assert children["shard-0"] in ("done", "stopped", "canceled")
    assert children["shard-1"] == "failed"
    assert children[MERGE] == "canceled"
    assert registered_by_jobs(client) == []
    # The failure is in the job's log, labelled by the part that failed; its traceback only in
    # the worker's (NOTE [ What a job's log shows its tenant ] in workers/running/logs.py).
    logged = client.http.get(f"/v1/jobs/{sharded['id']}/logs").json()["items"]
    failed = [e for e in logged if e["part"] == "shard-1" and e["level"] == "ERROR"]
    assert failed, logged
    assert "shard 2 of 2 (batches 3 to 4) failed" in failed[0]["message"]
    assert "Traceback" not in failed[0]["message"]


def test_a_sharded_jobs_parts_keep_their_logs_with_it(stack: Stack) -> None:
    client = stack.client("part-logs")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=400)))
    body = adapt(model, dataset, estimator="precise", batch_size=100, shards=2)
    job = client.wait(created(client.submit(body), 202)["id"])
    assert job["status"] == "succeeded", job
    # Each part logs how it ended after its work: the finish part marks the job succeeded
    # first, so its last line may arrive just after the status does.
    parts = (None, "shard-0", "shard-1", MERGE, "eval-0", "eval-1", FINISH)

    def every_part_ended() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = client.http.get(f"/v1/jobs/{job['id']}/logs").json()["items"]
        ended = {e["part"] for e in items if e["message"].endswith("ended done")}
        return items if ended >= set(parts[1:]) else []

    entries = wait_for(every_part_ended, what="every part's 'ended done' line")
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))
    by_part: dict[str | None, list[str]] = {}
    for entry in entries:
        by_part.setdefault(entry["part"], []).append(entry["message"])
    # The job's own process (it planned and queued the parts), then each part, from its own
    # process (perhaps on the other worker), each saying where it started and how it ended.
    assert set(by_part) == set(parts)
    assert any("2 shards queued" in m for m in by_part[None]), by_part[None]
    for part in parts[1:]:
        assert any(" started on " in m for m in by_part[part]), (part, by_part[part])
        assert any(m.endswith("ended done") for m in by_part[part]), (part, by_part[part])
    assert any("batches 2 to 3" in m for m in by_part["shard-1"]), by_part["shard-1"]


def long_sharded_job(client: Client, shards: int, **job: Any) -> str:
    """256 batches of a deep resnet on 32x32 images (seconds per shard), in ``shards``;
    ``job``: more fields of the job (``max_attempts``)."""
    model = created(client.add_model("resnet", {"in_channels": 1, "depth": 8, "width": 64}))
    x = np.random.default_rng(0).random((2048, 1, 32, 32), dtype=np.float32)
    dataset = created(client.add_dataset(npz_bytes(x=x)))
    body = adapt(model, dataset, estimator="precise", batch_size=8, shards=shards)
    return str(created(client.submit({**body, **job}), 202)["id"])


def test_progress_counts_all_shards_and_cancel_stops_them(stack: Stack) -> None:
    client = stack.client("cancel")
    job_id = long_sharded_job(client, shards=4)  # 4 shards of 64 batches, 2 workers
    shard_records = ShardRecords(stack.records().client)
    seen: list[dict[str, Any]] = []

    def two_shards_past_one_shards_worth() -> bool:
        progress = client.http.get(f"/v1/jobs/{job_id}").json()["progress"]
        if progress is not None:
            seen.append(progress)
        running = [c for c, s in (shard_records.children(job_id) or {}).items() if s == "running"]
        # No single shard can count more than its own 64 batches: two shards on two workers
        # are counted together.
        return len(running) == 2 and progress is not None and progress["done"] > 64

    wait_for(two_shards_past_one_shards_worth, timeout_s=180, what="two shards to progress")
    adapting = [p for p in seen if p["phase"] == "adapt"]
    assert {(p["total"], p["unit"]) for p in adapting} == {(256, "batches")}
    assert [p["done"] for p in adapting] == sorted(p["done"] for p in adapting)
    running = [c for c, s in (shard_records.children(job_id) or {}).items() if s == "running"]

    assert client.http.post(f"/v1/jobs/{job_id}:cancel").status_code == 202
    assert client.wait(job_id, timeout_s=60)["status"] == "canceled"
    for child in running:  # the first to see the cancel ended the job; the other follows
        children = once_ended(shard_records, job_id, child)
    queued = [c for c in SHARDS if c not in running]
    assert {children[c] for c in running} == {"stopped"}  # stopped at their next batch
    assert {children[c] for c in [*queued, MERGE]} == {"canceled"}
    assert set(shard_records.processes(job_id)) == set(running)  # the queued ones never ran
    assert registered_by_jobs(client) == []


def shard_process(shard_records: ShardRecords, job_id: str, child: str) -> int | None:
    """The pid of the process running ``child``, once it runs."""
    children = shard_records.children(job_id) or {}
    if children.get(child) is not ChildState.RUNNING:
        return None
    process = shard_records.processes(job_id).get(child)
    return None if process is None else int(process.rsplit(":", 1)[1])


def test_a_killed_shard_without_retries_fails_its_job_and_the_workers_go_on(stack: Stack) -> None:
    client = stack.client("killed")
    job_id = long_sharded_job(client, shards=2, max_attempts=1)
    shard_records = ShardRecords(stack.records().client)
    pid = wait_for(
        lambda: shard_process(shard_records, job_id, "shard-1"),
        timeout_s=300,
        what="shard 2 to start",
    )
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # as the OOM killer would
    done = client.wait(job_id, timeout_s=120)  # failed at once by the worker that saw it die
    assert done["status"] == "failed"
    assert done["error"].startswith("shard 2 of 2 died: the job's process died (signal 9;")
    children = once_ended(shard_records, job_id, "shard-0")
    assert children["shard-0"] in ("stopped", "canceled")
    assert children[MERGE] == "canceled"
    assert registered_by_jobs(client) == []

    # Both workers still serve a sharded job.
    small = created(client.add_model("digits_cnn", {"width": 8}))
    data = created(client.add_dataset(digits_npz(n=64)))
    body = adapt(small, data, estimator="cumulative", batch_size=16, shards=4)
    assert client.wait(created(client.submit(body), 202)["id"])["status"] == "succeeded"


def test_a_killed_shard_is_run_again_and_its_job_succeeds_once(stack: Stack) -> None:
    """NOTE [ Retried children ]: the shard's process is SIGKILLed mid-run; the same shard runs
    again in a new process, the merge follows, and the job registers exactly one model."""
    client = stack.client("retried")
    # 128 batches of a smaller resnet (a shard long enough to be caught running, short
    # enough to run twice on a loaded machine); max_attempts: the default, 3.
    model = created(client.add_model("resnet", {"in_channels": 1, "depth": 4, "width": 32}))
    x = np.random.default_rng(0).random((1024, 1, 32, 32), dtype=np.float32)
    dataset = created(client.add_dataset(npz_bytes(x=x)))
    body = adapt(model, dataset, estimator="precise", batch_size=8, shards=2)
    job_id = str(created(client.submit(body), 202)["id"])
    shard_records = ShardRecords(stack.records().client)
    pid = wait_for(
        lambda: shard_process(shard_records, job_id, "shard-1"),
        timeout_s=300,
        what="shard 2 to start",
    )
    assert pid is not None
    os.kill(pid, signal.SIGKILL)

    def run_again() -> int | None:
        again = shard_process(shard_records, job_id, "shard-1")
        done = (shard_records.children(job_id) or {}).get("shard-1") is ChildState.DONE
        return again if again not in (None, pid) else (-1 if done else None)

    assert wait_for(run_again, timeout_s=300, what="shard 2 to run again") != pid
    done = client.wait(job_id, timeout_s=600)
    assert done["status"] == "succeeded", done
    assert [m for m in client.http.get("/v1/models").json()["items"] if m["job_id"] == job_id]
    assert len(registered_by_jobs(client)) == 1
    report = client.http.get(done["result"]["report_url"]).json()
    assert [(s["index"], s["batches"]) for s in report["shards"]] == [(0, 64), (1, 64)]


@pytest.fixture(scope="module")
def trained() -> dict[str, Any]:
    """The digits CNN trained on the demo's split (tests/workers/estimators/test_auto.py), so that
    auto has a source model worth keeping or adapting."""
    return trained_digits()


def test_sharded_auto_equals_one_worker(stack: Stack, trained: dict[str, Any]) -> None:
    """auto with shards=2 on faint digits: two shards collect precise on the estimation batches,
    the merge scores the candidates on the held-out samples and keeps one, the evaluation
    children measure it; the report's candidates and choice are one worker's (scores within
    SHARDED_SCORE_ABS), its statistics within 1e-6 (assert_same_adaptation)."""
    client = stack.client("auto")
    model = created(client.add_model("digits_cnn", weights=trained["weights"]))
    x = (trained["split"].x_test * 0.05).astype(np.float32)  # 597 faint digits
    dataset = created(client.add_dataset(npz_bytes(x=x, y=trained["split"].y_test)))
    jobs = [
        created(
            client.submit(adapt(model, dataset, estimator="auto", batch_size=64, seed=5, shards=k)),
            202,
        )["id"]
        for k in (1, 2)
    ]
    single, sharded = (client.wait(job_id, timeout_s=300) for job_id in jobs)
    assert (single["status"], sharded["status"]) == ("succeeded", "succeeded"), (single, sharded)
    single_report, report = (
        Report.model_validate(client.http.get(job["result"]["report_url"]).json())
        for job in (single, sharded)
    )
    assert report.estimator == single_report.estimator == "auto"
    got, want = report.auto, single_report.auto
    assert got is not None and want is not None
    assert [c.name for c in got.candidates] == ["source", "precise", "prior", "prior", "prior"]
    assert_same_choice(got, want)
    assert_rule_holds(report)
    assert not got.kept_source  # faint digits: auto adapts
    assert (got.estimation_samples, got.held_out_samples) == (448, 149)
    # 448 estimation samples in 7 batches of 64, in shards of 4 and 3; the 149 held out in none.
    assert [(s.index, s.first_batch, s.batches, s.samples) for s in report.shards] == [
        (0, 0, 4, 256),
        (1, 4, 3, 192),
    ]
    assert (report.batches, report.samples) == (single_report.batches, single_report.samples)
    assert_same_adaptation(weights(client, sharded), weights(client, single), report.batches)
    # Measured on all 597 labelled digits by the evaluation children: the same accuracy.
    for which in ("metrics_before", "metrics_after"):
        found, expected = getattr(report, which), getattr(single_report, which)
        assert found is not None and expected is not None, which
        assert (found.num_samples, found.accuracy) == (597, expected.accuracy), which
    assert report.metrics_after is not None and report.metrics_before is not None
    assert report.metrics_after.accuracy > report.metrics_before.accuracy + 0.5
    shard_records = ShardRecords(stack.records().client)
    assert shard_records.children(sharded["id"]) == dict.fromkeys(
        ("shard-0", "shard-1", MERGE, "eval-0", "eval-1", FINISH), "done"
    )
    # The prediction diagnostics on the same 149 held-out digits, measured by the merge.
    found_d, expected_d = report.diagnostics, single_report.diagnostics
    assert found_d is not None and expected_d is not None
    assert (found_d.samples, found_d.held_out) == (expected_d.samples, True) == (149, True)
    assert found_d.before == expected_d.before  # the same input model on the same samples
    assert found_d.changed_fraction == pytest.approx(expected_d.changed_fraction, abs=1 / 149)
    assert found_d.after.mean_entropy == pytest.approx(expected_d.after.mean_entropy, abs=1e-4)
    # The demo's summary shows the sharded job's diagnostics and choice as one worker's.
    assert len(diagnostic_lines(report)) == len(diagnostic_lines(single_report))
    assert (
        diagnostic_lines(report)[-1]
        == diagnostic_lines(single_report)[-1]
        == (f"auto chose {want.chosen}")
    )


def test_shards_are_checked_at_submit(stack: Stack) -> None:
    client = stack.client("refused")
    model = created(client.add_model("digits_cnn", {"width": 8}))
    dataset = created(client.add_dataset(digits_npz(n=64)))
    too_many = client.submit(adapt(model, dataset, batch_size=16, shards=5))
    assert too_many.status_code == 422
    assert "shards=5 but the job runs only 4 batches" in too_many.json()["detail"]
    capped = client.submit(adapt(model, dataset, batch_size=8, max_batches=2, shards=3))
    assert "use shards <= 2" in capped.json()["detail"]
    ema = client.submit(adapt(model, dataset, estimator="ema", shards=2))
    assert ema.status_code == 422
    assert "sequential" in ema.json()["detail"]
    assert "use shards=1" in ema.json()["detail"]
    # auto shards, but not its entropy candidate; and its shards split only the 48 samples
    # (3 batches of 16) it does not hold out.
    entropy = client.submit(adapt(model, dataset, estimator="auto", allow_backward=True, shards=2))
    assert entropy.status_code == 422
    assert "use shards=1 to include entropy, or drop allow_backward" in entropy.json()["detail"]
    held = client.submit(adapt(model, dataset, estimator="auto", batch_size=16, shards=4))
    assert held.status_code == 422
    assert "shards=4 but the job runs only 3 batches" in held.json()["detail"]
    assert "holdout 0.25 held out of estimation" in held.json()["detail"]


def test_one_worker_runs_every_shard_of_a_job(stack: Stack) -> None:
    # The worker that starts a sharded job does not wait for its shards: alone, it then runs
    # them one after the other, and the merge. (Last in this module: it stops a worker.)
    while stack.more_workers:
        stop_process(stack.more_workers.pop(), timeout_s=40)
    client = stack.client("alone")
    model = created(client.add_model("digits_cnn", {"width": 8}))
    dataset = created(client.add_dataset(digits_npz(n=200)))
    body = adapt(model, dataset, estimator="precise", batch_size=16, shards=3)
    done = client.wait(created(client.submit(body), 202)["id"], timeout_s=120)
    assert done["status"] == "succeeded", done
    report = client.http.get(done["result"]["report_url"]).json()
    assert [s["batches"] for s in report["shards"]] == [5, 4, 4]  # 13 batches
    assert len({s["worker"] for s in report["shards"]}) == 1
