"""Rounds of real faults against a running stack (harness/stack.py): each round submits a job,
waits until it trains, injects one fault and checks the job's end. Used by the chaos tests
(small N) and bench/service/chaos.py (large N).

Faults: ``job-kill`` (SIGKILL of the job's process, as the OOM killer), ``machine-lost``
(SIGKILL of the whole worker and the job's process, then a new worker), ``redis-outage``
(SIGKILL of Redis, restarted with the same AOF after ``OUTAGE_S``). Every round must end with
the job succeeded and exactly one model registered by it.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

from harness.answers import created
from harness.digits import digits_npz
from harness.servers import wait_for
from harness.stack import Client, Stack
from service.local.embedded import RedisServer

__all__ = ["FAULTS", "ChaosTally", "run_chaos"]

FAULTS: Final = ("job-kill", "machine-lost", "redis-outage")
OUTAGE_S: Final = 3.0


@dataclass
class ChaosTally:
    """What the rounds ended with; ``seconds_to_end`` per fault, from the fault to the job's
    terminal status as seen by polling (for the bench; tests assert outcomes only)."""

    rounds: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    attempts: Counter[int] = field(default_factory=Counter)
    seconds_to_end: dict[str, list[float]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


# Long enough that the job's progress shows the train phase for several publish intervals
# (PUBLISH_INTERVAL_S, 0.5 s) before it ends, so a round can see it training and fault it
# then: 6 epochs (192 steps) took ~0.5 s on the 2-core CI machine, shorter than an interval,
# and the round then waited in vain for a train phase that was never published.
EPOCHS = 50


def _job_body(client: Client) -> dict[str, Any]:
    model = created(client.add_model("digits_cnn", {"width": 16}))
    dataset = created(client.add_dataset(digits_npz(n=1024)))
    return {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"epochs": EPOCHS, "batch_size": 32},
    }


def _training(client: Client, job_id: str) -> bool:
    job = client.http.get(f"/v1/jobs/{job_id}").json()
    return job["status"] == "running" and (job.get("progress") or {}).get("phase") == "train"


def _job_pid(stack: Stack, job_id: str) -> int:
    worker = stack.records().client.hget(f"bnadapt:job:{job_id}", "worker")
    assert worker is not None
    return int(worker.decode().rsplit(":", 1)[1])


def _inject(stack: Stack, fault: str, job_id: str) -> None:
    if fault == "job-kill":
        os.kill(_job_pid(stack, job_id), signal.SIGKILL)
    elif fault == "machine-lost":
        pid = _job_pid(stack, job_id)
        stack.kill_worker_group()
        os.kill(pid, signal.SIGKILL)  # RQ's job process runs in a session of its own
        stack.start_worker()
    elif fault == "redis-outage":
        port, password = stack.redis.port, stack.redis.password
        stack.redis.kill()
        time.sleep(OUTAGE_S)
        stack.redis = RedisServer(stack.data_dir / "redis", port=port, password=password)
        stack.redis.start()
    else:
        raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")


def run_chaos(stack: Stack, rounds: int, seed: int = 0, timeout_s: float = 300) -> ChaosTally:
    """``rounds`` rounds, each with a fault drawn from :data:`FAULTS` (every fault once
    first, then at random)."""
    rng = random.Random(seed)
    client = stack.client(f"chaos-{seed}")
    body = _job_body(client)
    tally = ChaosTally()
    for index in range(rounds):
        fault = FAULTS[index] if index < len(FAULTS) else rng.choice(FAULTS)
        tally.rounds[fault] += 1
        job_id = str(created(client.submit(body), 202)["id"])
        wait_for(
            lambda job_id=job_id: _training(client, job_id),
            timeout_s=120,
            what=f"{job_id} to train",
        )
        _inject(stack, fault, job_id)
        faulted = time.monotonic()
        done = client.wait(job_id, timeout_s=timeout_s)
        tally.seconds_to_end.setdefault(fault, []).append(time.monotonic() - faulted)
        tally.outcomes[f"{fault}: {done['status']}"] += 1
        tally.attempts[len(done["attempts"]) + 1] += 1
        models = [
            m
            for m in client.http.get("/v1/models", params={"page_size": 200}).json()["items"]
            if m["job_id"] == job_id
        ]
        if done["status"] != "succeeded" or len(models) != 1:
            tally.problems.append(
                f"round {index} ({fault}): {done['status']}, {len(models)} models, "
                f"error {done.get('error')!r}"
            )
    return tally
