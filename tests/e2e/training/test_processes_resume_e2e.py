"""Training checkpoints of train jobs in several processes (NOTE [ Ranks in a checkpoint ] in
workers/training/train_state.py), through the real API, queue and worker on the CPU with gloo:
a rank SIGKILLed mid-training ends the attempt, and the retried attempt resumes every rank
from the latest checkpoint and ends bitwise where the uninterrupted job ends; ``resume_from``
continues an ended 2-process job bitwise as the whole run; a checkpoint resumes only with the
world size that wrote it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.answers import created, problem
from harness.digits import digits_npz
from harness.stack import Stack, running_stack
from tests.e2e.test_e2e import store_of
from tests.e2e.training.test_processes_e2e import rank_pids, wait_gone
from tests.e2e.training.test_train_resume_e2e import (
    assert_bitwise,
    assert_resumed_as_uninterrupted,
    checkpoint_of,
    report,
    sha_users,
    steps_at_first_checkpoint,
    weights,
)
from workers.training.train_state import load_state

pytestmark = pytest.mark.slow

SAVE_EVERY_STEPS = 10


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(tmp_path, {"BNADAPT_WORKER_THREADS": "1"}) as stack:
        yield stack


def test_a_killed_rank_resumes_from_the_checkpoint_and_ends_bitwise(own_stack: Stack) -> None:
    stack = own_stack
    client = stack.client("ranks-resumed")
    model = created(client.add_model("digits_cnn", {"width": 8}))
    dataset = created(client.add_dataset(digits_npz(n=1000)))
    body = {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        # 900 training samples in global batches of 20 (10 a rank): 45 steps an epoch, 270 in
        # all. Cosine and warm-up: the learning rate depends on the step resumed from.
        "params": {
            "epochs": 6,
            "batch_size": 20,
            "processes": 2,
            "save_every_steps": SAVE_EVERY_STEPS,
            "lr_schedule": "cosine",
            "warmup_steps": 20,
        },
        "max_attempts": 2,
    }
    job_id = str(created(client.submit(body), 202)["id"])
    done_at_kill = steps_at_first_checkpoint(client, stack, job_id)
    ranks = rank_pids(stack)
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    killed = client.wait(job_id, timeout_s=600)
    assert killed["status"] == "succeeded", killed
    [ended] = killed["attempts"]
    assert "was killed (SIGKILL)" in ended["reason"], ended
    wait_gone(stack)

    whole = client.wait(str(created(client.submit(body), 202)["id"]), timeout_s=600)
    assert whole["status"] == "succeeded", whole
    assert_bitwise(weights(client, killed), weights(client, whole))

    resumed, uninterrupted = report(client, killed), report(client, whole)
    assert_resumed_as_uninterrupted(resumed, uninterrupted, done_at_kill, SAVE_EVERY_STEPS, 270)
    assert resumed["world_size"] == uninterrupted["world_size"] == 2
    # Rank 0 published each epoch for the events stream, the attempts' together.
    streamed = [data for name, data in client.api.events(job_id) if name == "epoch"]
    assert streamed == [e | {"epochs": 6} for e in resumed["epochs"]]

    # One checkpoint for both ranks, their own parts in it, released with the job.
    sha256 = checkpoint_of(stack, job_id)
    assert sha256 is not None
    assert load_state(store_of(stack).local_path(sha256)).world_size == 2
    assert job_id in sha_users(stack, sha256)
    assert client.http.delete(f"/v1/jobs/{job_id}").status_code == 204
    assert job_id not in sha_users(stack, sha256)


@pytest.fixture(scope="module")
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


def test_resume_from_continues_an_ended_two_process_job(stack: Stack) -> None:
    client = stack.client("ranks-continued")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=300)))
    params: dict[str, Any] = {
        "batch_size": 20,
        "processes": 2,
        "save_every_steps": 1000,  # none but the final one
        "seed": 3,
        "lr": 0.05,  # constant: a schedule over the job's steps would differ with its epochs
    }
    base = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}
    first = client.wait(
        str(created(client.submit(base | {"params": params | {"epochs": 2}}), 202)["id"]),
        timeout_s=300,
    )
    assert first["status"] == "succeeded", first

    more = base | {"params": params | {"epochs": 3, "resume_from": first["id"]}}
    continued = client.wait(str(created(client.submit(more), 202)["id"]), timeout_s=300)
    whole = client.wait(
        str(created(client.submit(base | {"params": params | {"epochs": 3}}), 202)["id"]),
        timeout_s=300,
    )
    assert continued["status"] == whole["status"] == "succeeded", (continued, whole)
    assert_bitwise(weights(client, continued), weights(client, whole))
    got, expected = report(client, continued), report(client, whole)
    assert got["resumed_from_job"] == first["id"]
    # 270 training samples in global batches of 20: 14 steps an epoch (the last of 10).
    assert got["attempts"] == [{"attempt": 1, "resumed_from_step": 28}]
    assert got["epochs"] == expected["epochs"]

    # Another world size is refused at submission, naming what to change.
    problem(
        client.submit(
            base | {"params": params | {"epochs": 3, "processes": 1, "resume_from": first["id"]}}
        ),
        422,
        "processes 1 (job",
        "use that job's values",
    )
