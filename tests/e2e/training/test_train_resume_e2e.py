"""Resumable training over HTTP on the real stack (harness/stack.py): a train job whose process
is SIGKILLed after a checkpoint resumes in its retried attempt and ends bitwise where the
uninterrupted job ends; ``resume_from`` continues a finished job; the recipe's bad
combinations are refused with a 422 that says what to change; checkpoints are released with
their job."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

from harness.answers import created, problem
from harness.digits import digits_npz
from harness.servers import wait_for
from harness.stack import Client, Stack, npz_bytes, running_stack
from service.records import keys
from service.records.stored.train_checkpoints import CHECKPOINT_FIELD
from tests.e2e.test_e2e import store_of

pytestmark = pytest.mark.slow

SAVE_EVERY_STEPS = 10


def weights(client: Client, job: dict[str, Any]) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(client.http.get(job["result"]["weights_url"]).content)


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def report(client: Client, job: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = client.http.get(job["result"]["report_url"]).json()
    return body


def checkpoint_of(stack: Stack, job_id: str) -> str | None:
    raw = stack.records().client.hget(keys.record("job", job_id), CHECKPOINT_FIELD)
    return None if raw is None else raw.decode()


def sha_users(stack: Stack, sha256: str) -> set[str]:
    return {m.decode() for m in stack.records().client.smembers(keys.sha_refs(sha256))}


def steps_at_first_checkpoint(client: Client, stack: Stack, job_id: str) -> int:
    """Waits until the running job has recorded a training checkpoint and shown progress; the
    steps done then."""

    def checkpointed() -> int | None:
        job = client.http.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] in ("queued", "running"), job
        done = int((job.get("progress") or {}).get("done") or 0)
        if job["status"] == "running" and checkpoint_of(stack, job_id) and done:
            return done
        return None

    return wait_for(checkpointed, timeout_s=300, what="the job's first checkpoint")


def assert_resumed_as_uninterrupted(
    resumed: dict[str, Any],
    uninterrupted: dict[str, Any],
    done_at_kill: int,
    interval: int,
    batches: int,
) -> None:
    """The report of a job killed after ``done_at_kill`` steps against the uninterrupted job's:
    its second attempt resumed from a checkpoint and redid at most one ``interval``, and the
    epochs and BatchNorm updates are the uninterrupted job's."""
    first, second = resumed["attempts"]
    assert first == {"attempt": 1, "resumed_from_step": 0}
    assert second["attempt"] == 2
    step = second["resumed_from_step"]
    # A step's progress may show before that step's checkpoint is recorded, never before the
    # previous interval's: once the progress showed done_at_kill steps, the checkpoint of
    # done_at_kill less one interval at least was there.
    assert step > 0 and step % interval == 0
    assert step >= done_at_kill - interval
    assert uninterrupted["attempts"] == [{"attempt": 1, "resumed_from_step": 0}]
    assert resumed["epochs"] == uninterrupted["epochs"]
    assert resumed["batches"] == uninterrupted["batches"] == batches
    for layer in resumed["batchnorm"]:
        assert layer["num_batches_tracked_after"] - layer["num_batches_tracked_before"] == batches


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(tmp_path) as stack:
        yield stack


def test_a_killed_train_job_resumes_and_ends_bitwise_as_the_uninterrupted_one(
    own_stack: Stack,
) -> None:
    stack = own_stack
    client = stack.client("resumed")
    model = created(client.add_model("digits_cnn", {"width": 16}))
    dataset = created(client.add_dataset(digits_npz()))
    body = {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        # 1617 training samples in batches of 32: 51 steps an epoch, 306 in all.
        "params": {
            "epochs": 6,
            "batch_size": 32,
            "save_every_steps": SAVE_EVERY_STEPS,
            "lr_schedule": "cosine",
            "warmup_steps": 20,
            "label_smoothing": 0.05,
        },
    }
    job_id = str(created(client.submit(body), 202)["id"])
    done_at_kill = steps_at_first_checkpoint(client, stack, job_id)
    worker = stack.records().client.hget(keys.record("job", job_id), "worker")
    assert worker is not None
    os.kill(int(worker.decode().rsplit(":", 1)[1]), signal.SIGKILL)  # as the OOM killer would
    killed = client.wait(job_id, timeout_s=600)
    assert killed["status"] == "succeeded", killed
    [ended] = killed["attempts"]
    assert "process died (signal 9" in ended["reason"]

    whole = client.wait(str(created(client.submit(body), 202)["id"]), timeout_s=600)
    assert whole["status"] == "succeeded", whole
    assert_bitwise(weights(client, killed), weights(client, whole))

    assert_resumed_as_uninterrupted(
        report(client, killed), report(client, whole), done_at_kill, SAVE_EVERY_STEPS, 306
    )

    # The checkpoint goes with the job.
    sha256 = checkpoint_of(stack, job_id)
    assert sha256 is not None and job_id in sha_users(stack, sha256)
    assert client.http.delete(f"/v1/jobs/{job_id}").status_code == 204
    assert job_id not in sha_users(stack, sha256)


@pytest.fixture(scope="module")
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


def test_resume_from_continues_a_finished_job_for_more_epochs(stack: Stack) -> None:
    client = stack.client("continued")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=300)))
    params = {"batch_size": 32, "save_every_steps": 1000, "seed": 5}
    base = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}
    first = client.wait(
        str(created(client.submit(base | {"params": params | {"epochs": 2}}), 202)["id"])
    )
    assert first["status"] == "succeeded", first
    first_checkpoint = checkpoint_of(stack, first["id"])
    assert first_checkpoint is not None

    more = base | {"params": params | {"epochs": 4, "resume_from": first["id"]}}
    continued = client.wait(str(created(client.submit(more), 202)["id"]))
    whole = client.wait(
        str(created(client.submit(base | {"params": params | {"epochs": 4}}), 202)["id"])
    )
    assert continued["status"] == whole["status"] == "succeeded", (continued, whole)
    assert_bitwise(weights(client, continued), weights(client, whole))
    got, expected = report(client, continued), report(client, whole)
    assert got["resumed_from_job"] == first["id"]
    # 270 training samples in batches of 32: 9 steps an epoch.
    assert got["attempts"] == [{"attempt": 1, "resumed_from_step": 18}]
    assert got["epochs"] == expected["epochs"]
    assert [e["epoch"] for e in got["epochs"]] == [1, 2, 3, 4]
    # Each epoch's validation metrics, as they came, in the job's log (and events stream).
    logged = client.http.get(f"/v1/jobs/{continued['id']}/logs").json()["items"]
    epochs = [e["message"] for e in logged if e["message"].startswith("epoch ")]
    assert [m.split(":")[0] for m in epochs] == ["epoch 3 of 4", "epoch 4 of 4"]
    assert f"val_loss {got['epochs'][3]['val_loss']:.6g}" in epochs[1]

    # What it must share with the job it continues, and what another tenant sees.
    problem(
        client.submit(
            more | {"params": params | {"epochs": 4, "resume_from": first["id"], "batch_size": 16}}
        ),
        422,
        "batch_size 16",
        "use that job's values",
    )
    problem(
        client.submit(base | {"params": params | {"epochs": 2, "resume_from": first["id"]}}),
        422,
        "trained all its 2 epochs",
    )
    stranger = stack.client("stranger")
    theirs = stranger.submit(
        {
            "kind": "train",
            "model_id": created(stranger.add_model("digits_cnn", {"width": 4}))["id"],
            "dataset_id": created(stranger.add_dataset(digits_npz(n=300)))["id"],
            "params": params | {"epochs": 4, "resume_from": first["id"]},
        }
    )
    missing = stranger.submit(
        {
            "kind": "train",
            "model_id": model["id"],
            "dataset_id": dataset["id"],
            "params": params | {"epochs": 4, "resume_from": "job_" + "0" * 26},
        }
    )
    problem(theirs, 404, "not found")
    problem(missing, 404)

    # The continued job holds the checkpoint it started from: deleting the first job leaves it.
    assert client.http.delete(f"/v1/jobs/{first['id']}").status_code == 204
    assert sha_users(stack, first_checkpoint) == {continued["id"]}


BAD_RECIPES: list[tuple[dict[str, Any], list[str]]] = [
    ({"lr_schedule": "step"}, ["needs lr_step_epochs"]),
    ({"lr_step_epochs": 2}, ["add lr_schedule: 'step'"]),
    ({"precision": "fp16", "device": "cpu"}, ["fp16 runs on CUDA only", "bf16"]),
    ({"precision": "fp16"}, ["fp16 runs on CUDA only"]),
    ({"keep_best": True, "validation_fraction": 0.0}, ["no validation split"]),
    ({"label_smoothing": 0.1, "loss": "mse"}, ["not to loss mse"]),
    ({"accumulate_steps": 0}, ["accumulate_steps"]),
    ({"warmup_steps": 9, "epochs": 1}, ["warmup_steps=9", "9 optimizer steps", "below 9"]),
    ({"save_every_steps": 0}, ["save_every_steps"]),
    ({"clip_grad_norm": -1}, ["clip_grad_norm"]),
    ({"augmentation": {"crop_scale": [0.5, 0.2]}}, ["0 < low <= high <= 1", "[0.08, 1.0]"]),
    ({"loader_workers": 17}, ["loader_workers"]),
]


@pytest.mark.parametrize(("params", "phrases"), BAD_RECIPES)
def test_bad_recipes_are_refused_with_what_to_change(
    stack: Stack, params: dict[str, Any], phrases: list[str]
) -> None:
    client = stack.client("recipes")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=300)))
    body = {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"batch_size": 32} | params,
    }
    problem(client.submit(body), 422, *phrases)


def test_resume_from_a_job_without_a_checkpoint_is_refused(stack: Stack) -> None:
    client = stack.client("no-checkpoint")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=300)))
    base = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}
    plain = client.wait(str(created(client.submit(base | {"params": {"epochs": 1}}), 202)["id"]))
    assert plain["status"] == "succeeded"
    refused = client.submit(base | {"params": {"epochs": 2, "resume_from": plain["id"]}})
    problem(refused, 422, "kept no training checkpoint", "save_every_steps")


def test_augmentation_of_samples_that_are_not_images_is_refused(stack: Stack) -> None:
    client = stack.client("flat")
    model = created(client.add_model("mlp", {"in_features": 64}))
    x = np.random.default_rng(0).random((100, 64), dtype=np.float32)
    y = np.arange(100, dtype=np.int64) % 10
    dataset = created(client.add_dataset(npz_bytes(x=x, y=y)))
    body = {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"augmentation": {"horizontal_flip": True}},
    }
    problem(client.submit(body), 422, "images (C, H, W)", "[64]", "drop augmentation")


def test_checkpoints_count_in_the_tenants_stored_bytes_until_their_job_is_deleted(
    stack: Stack,
) -> None:
    client = stack.client("checkpoint-bytes")
    records = stack.records()
    tenant = records.find_tenant("checkpoint-bytes")
    assert tenant is not None
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=300)))
    base = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}
    params = {"epochs": 1, "batch_size": 32, "save_every_steps": 1000}

    def stored() -> int:
        return int(records.quota_usage(tenant)["max_stored_bytes"])

    before = stored()
    job = client.wait(str(created(client.submit(base | {"params": params}), 202)["id"]))
    assert job["status"] == "succeeded", job
    sha256 = checkpoint_of(stack, job["id"])
    assert sha256 is not None
    checkpoint_bytes = store_of(stack).local_path(sha256).stat().st_size
    trained = client.http.get(f"/v1/models/{job['result']['model_id']}").json()
    # The model the job registered and its final checkpoint, both the tenant's.
    assert stored() == before + trained["size_bytes"] + checkpoint_bytes
    assert client.http.delete(f"/v1/jobs/{job['id']}").status_code == 204
    assert stored() == before + trained["size_bytes"]

    # A tenant whose next checkpoint does not fit: the job fails once, naming the quota.
    records.set_quota(tenant, "max_stored_bytes", float(stored() + checkpoint_bytes // 2))
    # Two epochs: the first checkpoint comes at step 10, the floor of the interval.
    full = base | {"params": params | {"epochs": 2, "save_every_steps": 10}, "max_attempts": 3}
    refused = client.wait(str(created(client.submit(full), 202)["id"]))
    assert refused["status"] == "failed", refused
    assert refused["attempts"] == []  # not retried: the next attempt's would not fit either
    for phrase in ("training checkpoint at step 10", "quota max_stored_bytes exceeded", "DELETE"):
        assert phrase in refused["error"], refused["error"]
    assert checkpoint_of(stack, refused["id"]) is None
    assert stored() == before + trained["size_bytes"]
