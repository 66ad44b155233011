"""A job's own failures (issue 27, deliver 7): out of memory and timeouts said in words and
never retried, judged from real failures (a real allocation that fails, RQ's real timeout,
a real process killed), and the memory the workers publish, in a real Redis-compatible
server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from rq.job import Job
from rq.timeouts import JobTimeoutException, UnixSignalDeathPenalty

from harness.stack import REPO
from service.records.connection import redis_client
from service.records.job_life.capacity import WorkerMemory
from service.records.job_life.retries import JobAttempts, enqueue_attempt
from service.settings import MIB, Settings
from workers.models.architectures import activation_footprint, build_model
from workers.running.capacity import killed_for_its_own_reasons, machine_memory, oom_kills
from workers.running.failures import failure_message, is_out_of_memory


def test_a_failed_allocation_is_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**62, dtype=torch.uint8)  # the CPU allocator refuses: a real failure
    assert is_out_of_memory(caught.value)
    message = failure_message(caught.value, None)
    assert message.startswith("the job ran out of memory (")
    assert "not retried" in message and "smaller batch_size" in message
    with pytest.raises(MemoryError) as python:
        bytearray(2**62)
    assert "ran out of memory (MemoryError)" in failure_message(python.value, None)
    assert not is_out_of_memory(RuntimeError("shapes do not match"))
    assert failure_message(ValueError("bad data"), None) == "bad data"


def test_rqs_timeout_is_said_as_a_timeout() -> None:
    with (
        pytest.raises(JobTimeoutException) as caught,
        UnixSignalDeathPenalty(1, JobTimeoutException),
    ):
        time.sleep(10)
    message = failure_message(caught.value, 1)
    assert message.startswith("the job timed out: it ran past its timeout of 1 s")
    assert "timeout_s" in message


def _status_of_killed(sig: signal.Signals) -> int:
    process = subprocess.Popen(["sleep", "30"])
    os.kill(process.pid, sig)
    _, status = os.waitpid(process.pid, 0)
    process.returncode = 0  # reaped above
    return status


def test_a_process_killed_past_its_timeout_is_its_own_failure() -> None:
    killed = _status_of_killed(signal.SIGKILL)
    long_ago = datetime.now(UTC) - timedelta(seconds=100)
    own = killed_for_its_own_reasons(killed, long_ago, 30, oom_kills())
    assert own is not None and "timed out" in own
    # Within its timeout, or ended by another signal: an interruption, retried.
    assert killed_for_its_own_reasons(killed, long_ago, 3600, oom_kills()) is None
    assert killed_for_its_own_reasons(killed, None, None, oom_kills()) is None
    terminated = _status_of_killed(signal.SIGTERM)
    assert killed_for_its_own_reasons(terminated, long_ago, 30, oom_kills()) is None


def test_a_process_killed_by_the_oom_killer_is_its_own_failure() -> None:
    count = oom_kills()
    if count is None:
        pytest.skip("no cgroup v2 memory.events here")
    killed = _status_of_killed(signal.SIGKILL)
    own = killed_for_its_own_reasons(killed, datetime.now(UTC), 3600, count - 1)
    assert own is not None and "out-of-memory killer" in own


@pytest.mark.slow  # fills a job process's memory to its limit
def test_a_job_process_is_held_to_the_workers_memory() -> None:
    # In a process of its own, as RQ's forked job process: 64 MiB beyond what it started with.
    code = (
        "import torch\n"
        "from workers.running.capacity import hold_job_to\n"
        "from workers.running.failures import failure_message\n"
        f"hold_job_to({64 * MIB}, 'cpu')\n"
        "small = torch.ones(8 * 2**20, dtype=torch.uint8)\n"
        "try:\n"
        "    torch.ones(256 * 2**20, dtype=torch.uint8)\n"
        "except RuntimeError as exc:\n"
        "    print(failure_message(exc, None))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=True,
    )
    assert done.stdout.startswith("the job ran out of memory ("), done.stdout + done.stderr


def test_activation_footprint() -> None:
    model = build_model("digits_cnn", {"width": 8})
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    footprint = activation_footprint(model, (1, 8, 8))
    assert not model.training  # its mode is given back
    # At least the input itself (4 bytes a float), more with gradients than without.
    assert footprint["backward_bytes_per_element"] > footprint["forward_bytes_per_element"] >= 4
    assert before.keys() == model.state_dict().keys()
    # Free sizes are measured on a probe: a per-element figure, the same order at any size.
    resnet = build_model("resnet", {"in_channels": 1, "width": 8, "depth": 2})
    assert activation_footprint(resnet, (1, None, None))["forward_bytes_per_element"] > 4


def test_machine_memory_is_known() -> None:
    memory = machine_memory()
    assert memory is not None and memory > 64 * MIB


def test_workers_publish_their_memory(redis_url: str) -> None:
    published = WorkerMemory(redis_client(redis_url))
    assert published.smallest("q") is None
    published.publish(["q", "q-cpu"], "a", 8 * 2**30, ttl_s=60)
    published.publish(["q"], "b", 2 * 2**30, ttl_s=60)
    assert published.smallest("q") == 2 * 2**30
    assert published.smallest("q-cpu") == 8 * 2**30
    published.publish(["q"], "b", 2 * 2**30, ttl_s=-1)  # b stopped: its entry expired
    assert published.smallest("q") == 8 * 2**30
    published.publish(["q"], "a", 8 * 2**30, ttl_s=60)  # publishing drops expired entries
    assert published.client.hkeys("bnadapt:worker-memory:q") == [b"a"]
    published.withdraw(["q", "q-cpu"], "a")
    assert published.smallest("q") is None


def test_a_retry_runs_under_the_jobs_own_timeout(redis_url: str, tmp_path: Path) -> None:
    settings = Settings(redis_url=redis_url, data_dir=tmp_path, queue="timeout-tests")
    attempts = JobAttempts(redis_client(redis_url))
    payload = {
        "job_id": "job_t",
        "tenant_id": "ten_t",
        "params": {"device": "auto"},
        "timeout_s": 77,
    }
    enqueue_attempt(attempts, settings, "job_t", "job_t-attempt-2", json.dumps(payload))
    job = Job.fetch("job_t-attempt-2", connection=attempts.client, serializer="json")
    assert job.timeout == 77
    del payload["timeout_s"]  # a payload of a release before: the service's default
    enqueue_attempt(attempts, settings, "job_u", "job_u-attempt-2", json.dumps(payload))
    job = Job.fetch("job_u-attempt-2", connection=attempts.client, serializer="json")
    assert job.timeout == settings.job_timeout_s == 6 * 3600
