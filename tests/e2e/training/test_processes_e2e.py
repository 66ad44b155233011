"""Train jobs in several processes (docs/distributed.md) through the real API, queue and
worker, on the CPU with gloo: a 2-process job equals, to 1e-5, one process that runs the same
per-rank slices and averages their gradients (DDP's definition), keeping rank 0's running
statistics (DDP's buffer broadcast); with sync_batchnorm, a 2-process job equals, to 1e-5, the
same job in one process on whole batches; what submission refuses; a rank killed mid-training
ends the attempt as one interruption, retried, and a cancel ends all ranks, leaving no rank
process behind either way; nothing a job's processes open listens beyond the loopback."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from api_schemas import Report, TrainParams
from harness.answers import created, problem
from harness.digits import digits, digits_npz
from harness.socket_table import TcpSocket, descendants, sockets_of
from harness.stack import (
    SHARED_STACK_THREADS,
    Client,
    Stack,
    job_payload,
    npz_bytes,
    running_stack,
)
from service.local.summary import report_summary
from tests.e2e.test_e2e import store_of
from workers.kinds.changing import compute
from workers.passes.data import load_rows
from workers.running.evaluation import compute_loss
from workers.running.loading import load_job
from workers.training.training import RankSlice, batch_bounds, split_indices

WORKER_THREADS = SHARED_STACK_THREADS


@pytest.fixture(scope="module")
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


def ddp_reference(stack: Stack, job_id: str) -> dict[str, torch.Tensor]:
    """The job's training, one process doing what its ranks do: each step, every rank's slice
    of the global batch forward and backward with its mean loss over ``world_size`` (the
    gradients summed: DDP's average), rank 0's last, from the running statistics as they
    were before the step, so that the statistics kept are rank 0's alone."""
    payload = job_payload(stack, job_id)
    params = payload.params
    assert isinstance(params, TrainParams) and params.validation_fraction > 0
    world_size = params.processes
    threads = torch.get_num_threads()
    torch.set_num_threads(WORKER_THREADS)
    try:
        job = load_job(payload, store_of(stack))
        model, x, y = job.model, job.x, job.y
        assert y is not None
        generator = torch.Generator().manual_seed(params.seed)
        train_idx, _ = split_indices(len(x), params.validation_fraction, generator)
        bounds = RankSlice(0, world_size).keep(batch_bounds(train_idx.numel(), params.batch_size))
        opt = torch.optim.SGD(model.parameters(), lr=params.lr, momentum=params.momentum)
        torch.manual_seed(params.seed)
        model.train()
        for _ in range(params.epochs):
            order = train_idx[torch.randperm(train_idx.numel(), generator=generator)]
            for start, stop in bounds:
                opt.zero_grad(set_to_none=True)
                buffers = {k: v.clone() for k, v in model.named_buffers()}
                for rank in reversed(range(world_size)):
                    with torch.no_grad():  # each rank starts from the same statistics
                        for name, value in model.named_buffers():
                            value.copy_(buffers[name])
                    idx = RankSlice(rank, world_size).take(order[start:stop])
                    loss = compute_loss(model(load_rows(x, idx)), y[idx], "cross_entropy", "mean")
                    torch.autograd.backward(loss / world_size)
                opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow  # two ranks launched, twice over
def test_two_processes_equal_averaged_gradients(stack: Stack) -> None:
    client = stack.client("processes")
    model = created(client.add_model("digits_cnn", {"width": 8}, seed=2))
    dataset = created(client.add_dataset(digits_npz(n=500)))
    # 450 training samples in batches of 40: a short last batch of 10, 5 a rank.
    params = {"epochs": 2, "batch_size": 40, "lr": 0.05, "processes": 2}
    job = created(
        client.submit(
            {
                "kind": "train",
                "model_id": model["id"],
                "dataset_id": dataset["id"],
                "params": params,
            }
        ),
        202,
    )
    done = client.wait(job["id"], timeout_s=300)
    assert done["status"] == "succeeded", done
    report = client.http.get(done["result"]["report_url"]).json()
    assert report["world_size"] == 2
    assert report["batches"] == 2 * 12  # ceil(450 / 40) steps an epoch
    assert report["samples"] == 2 * 450
    assert [r["steps"] for r in report["rank_steps"]] == [report["batches"]] * 2
    assert all(r["steady_samples_per_s"] > 0 for r in report["rank_steps"])
    assert report["steps"] == report["rank_steps"][0]
    summary = report_summary(Report.model_validate(report))
    assert any(line.startswith("2 processes (ranks") for line in summary), summary
    assert [e["epoch"] for e in report["epochs"]] == [1, 2]
    assert report["epochs"][-1]["val_accuracy"] is not None
    for layer in report["batchnorm"]:
        grown = layer["num_batches_tracked_after"] - layer["num_batches_tracked_before"]
        assert grown == report["batches"]

    state = safetensors.torch.load(client.http.get(done["result"]["weights_url"]).content)
    expected = ddp_reference(stack, job["id"])
    assert set(state) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5, msg=key)
    # The test can tell: one process on whole batches of 40 keeps other statistics than rank
    # 0's slices of 20.
    payload = job_payload(stack, job["id"])
    assert isinstance(payload.params, TrainParams)
    single = payload.model_copy(
        update={"params": payload.params.model_copy(update={"processes": 1})}
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(WORKER_THREADS)
    try:
        whole = compute(single, store_of(stack)).state_dict
    finally:
        torch.set_num_threads(threads)
    differs = [
        k for k in whole if k.endswith("running_var") and not torch.allclose(whole[k], state[k])
    ]
    assert differs, "slices of 20 gave the statistics of batches of 40: the split did nothing"


def test_processes_are_checked_at_submission(stack: Stack) -> None:
    client = stack.client("processes-refused")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=100)))
    ids = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}

    def refused(params: dict[str, Any], *phrases: str) -> None:
        problem(client.submit({**ids, "params": params}), 422, *phrases)

    refused({"processes": 3, "batch_size": 64}, "multiple of processes", "e.g. 63")
    refused({"processes": 4, "batch_size": 4}, "at least 2", "batch_size >= 8")
    refused({"processes": 9, "batch_size": 72}, "less than or equal to 8")
    refused({"processes": 2, "device": "cuda:1"}, "one rank a GPU", "'cuda' or 'auto'")
    refused({"processes": 2, "compile": True}, "compile", "processes: 1")
    # sync_batchnorm runs on every device (bnadapt's SyncBatchNorm): no device refuses it (a
    # CPU job with it runs in test_sync_batchnorm_on_two_processes_equals_one_process), and it
    # meets the rules every job with processes meets.
    for device in ("cpu", "auto", "cuda"):
        TrainParams(processes=2, sync_batchnorm=True, device=device)
    refused({"processes": 3, "batch_size": 64, "sync_batchnorm": True}, "multiple of processes")


def trained(client: Client, body: dict[str, Any], params: dict[str, Any]) -> tuple[Any, Any]:
    """A train job's report and weights, once it succeeded."""
    job = created(client.submit({**body, "params": params}), 202)
    done = client.wait(job["id"], timeout_s=300)
    assert done["status"] == "succeeded", done
    report = client.http.get(done["result"]["report_url"]).json()
    state = safetensors.torch.load(client.http.get(done["result"]["weights_url"]).content)
    return {**report, "job_id": job["id"]}, state


@pytest.mark.slow  # two ranks launched, twice over
def test_sync_batchnorm_on_two_processes_equals_one_process(stack: Stack) -> None:
    """On the CPU (gloo), a 2-process job with sync_batchnorm normalises each step with the
    whole global batch's statistics, so it equals the same job in one process on whole batches
    within 1e-5: weights, running statistics, and num_batches_tracked, one a step on every
    rank (the ranks check it of themselves). Its blocks run checkpointed (the default policy),
    so the statistics come from the wrapper's first forward."""
    client = stack.client("sync-batchnorm")
    model = created(client.add_model("mlp", {"in_features": 64, "hidden": 32}, seed=4))
    x, y = digits(n=600)
    dataset = created(client.add_dataset(npz_bytes(x=x.reshape(len(x), 64), y=y)))
    body = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}
    # 540 training samples in batches of 60: every global batch whole, 30 a rank.
    common = {"epochs": 2, "batch_size": 60, "lr": 0.05}
    one_report, one = trained(client, body, common)
    two_report, two = trained(client, body, {**common, "processes": 2, "sync_batchnorm": True})
    assert two_report["world_size"] == 2 and len(two_report["rank_steps"]) == 2
    assert two_report["batches"] == one_report["batches"] == 18
    assert set(two) == set(one)
    for key, value in one.items():
        torch.testing.assert_close(two[key], value, rtol=0, atol=1e-5, msg=key)
    for layer in two_report["batchnorm"]:
        grown = layer["num_batches_tracked_after"] - layer["num_batches_tracked_before"]
        assert grown == two_report["batches"]
    # The test can tell: without sync_batchnorm (each rank normalising its own 30 samples, the
    # computation ddp_reference repeats) the statistics are another job's.
    unsynced = ddp_reference(stack, two_report["job_id"])
    assert any(
        not torch.allclose(unsynced[k], one[k], rtol=0, atol=1e-5)
        for k in one
        if k.endswith("running_var")
    )


def rank_pids(stack: Stack) -> list[int]:
    """The rank processes under the stack's worker: the processes torch's launcher spawned
    (``multiprocessing.spawn``) among the worker supervisor's descendants, less the
    inspector's builders (spawned too: NOTE [ Bounded builds ])."""
    assert stack.worker is not None
    parents: dict[int, int] = {}
    spawned: list[int] = []
    inspectors: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        if b"spawn_main" in cmdline:
            spawned.append(int(entry.name))
        if b"workers.processes.inspector" in cmdline:
            inspectors.add(int(entry.name))

    def under_worker(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid in inspectors:
                return False
            if pid == stack.worker.pid:  # type: ignore[union-attr]
                return True
        return False

    return sorted(pid for pid in spawned if under_worker(pid))


def wait_training(client: Client, job_id: str, timeout_s: float = 240) -> None:
    """Until the job's ranks have run at least one step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = client.http.get(f"/v1/jobs/{job_id}").json()
        assert record["status"] in ("queued", "running"), record
        progress = record.get("progress") or {}
        if progress.get("phase") == "train" and progress.get("done", 0) >= 1:
            return
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not start training in {timeout_s} s")


def wait_gone(stack: Stack, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while rank_pids(stack) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rank_pids(stack) == [], "rank processes outlived their job"


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(tmp_path, {"BNADAPT_WORKER_THREADS": "1"}) as stack:
        yield stack


def long_job(client: Client, max_attempts: int, epochs: int = 40, **extra: Any) -> str:
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=1000)))
    params = {"epochs": epochs, "batch_size": 20, "processes": 2, "validation_fraction": 0.0}
    body = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}
    body = {**body, "params": params, "max_attempts": max_attempts, **extra}
    job = created(client.submit(body), 202)
    return str(job["id"])


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
def test_nothing_a_job_opens_listens_beyond_loopback(stack: Stack) -> None:
    """Read from the kernel's socket table while a 2-process job trains: no process of the job
    (its own process, its ranks, anything under them) listens on an address other than the
    loopback, and the ranks' gloo connections run over the loopback (NOTE [ Ranks meet on
    the loopback ] in workers/training/ranks.py)."""
    client = stack.client("ranks-sockets")
    job_id = long_job(client, max_attempts=1)
    wait_training(client, job_id)
    ranks = rank_pids(stack)
    assert len(ranks) == 2, ranks
    job_process = parent_of(ranks[0])
    assert parent_of(ranks[1]) == job_process
    seen: set[TcpSocket] = set()
    for _ in range(20):  # the ranks train meanwhile: sockets opened at any step are seen
        seen.update(sockets_of(descendants(job_process)))
        time.sleep(0.1)
    client.api.cancel(job_id)
    assert client.wait(job_id, timeout_s=120)["status"] == "canceled"
    beyond = sorted(str(s) for s in seen if s.listening and not s.loopback)
    assert beyond == [], f"the job's processes listen beyond the loopback: {beyond}"
    # The table is the right one: the ranks' gloo pairs are in it, on the loopback.
    between_ranks = [s for s in seen if s.pid in ranks and not s.listening]
    assert between_ranks, sorted(map(str, seen))
    assert all(s.loopback for s in between_ranks), sorted(map(str, between_ranks))


@pytest.mark.slow
def test_a_rank_killed_ends_the_attempt_and_the_retry_succeeds(own_stack: Stack) -> None:
    client = own_stack.client("rank-killed")
    job_id = long_job(client, max_attempts=2)
    wait_training(client, job_id)
    ranks = rank_pids(own_stack)
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    done = client.wait(job_id, timeout_s=600)
    assert done["status"] == "succeeded", done
    assert len(done["attempts"]) == 1, done["attempts"]  # the killed run, one attempt
    assert "was killed (SIGKILL)" in done["attempts"][0]["reason"], done["attempts"][0]
    wait_gone(own_stack)
    assert all(not Path(f"/proc/{pid}").exists() for pid in ranks)


@pytest.mark.slow
def test_a_canceled_job_ends_its_ranks(own_stack: Stack) -> None:
    client = own_stack.client("ranks-canceled")
    job_id = long_job(client, max_attempts=1)
    wait_training(client, job_id)
    assert len(rank_pids(own_stack)) == 2
    client.api.cancel(job_id)
    done = client.wait(job_id, timeout_s=120)
    assert done["status"] == "canceled", done
    assert done["result"] is None
    wait_gone(own_stack)


@pytest.mark.slow
def test_a_job_past_its_timeout_ends_its_ranks(own_stack: Stack) -> None:
    """RQ's timeout interrupts the job's process inside the launcher: the agent stops the
    ranks on its way out, and the job fails as timed out, once."""
    client = own_stack.client("ranks-timeout")
    job_id = long_job(client, max_attempts=2, epochs=400, timeout_s=30)
    wait_training(client, job_id)
    done = client.wait(job_id, timeout_s=300)
    assert done["status"] == "failed", done
    assert "timed out" in done["error"] or "timeout" in done["error"], done["error"]
    assert done["attempts"] == []
    wait_gone(own_stack)


@pytest.mark.slow
def test_a_ranks_own_error_fails_the_job_with_its_message(stack: Stack) -> None:
    """Inputs whose harm the API cannot see (one sample near float32's largest): the training
    loss becomes NaN on every rank, which raises the error one process would, and the job
    fails once (no retry) with that error's message, not the launcher's."""
    client = stack.client("rank-error")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    x, y = digits(n=200)
    x[3] = 3e38
    dataset = created(client.add_dataset(npz_bytes(x=x, y=y)))
    body = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}
    errors = []
    for processes in (1, 2):
        params = {"processes": processes, "batch_size": 20, "validation_fraction": 0.0}
        job = created(client.submit({**body, "params": params, "max_attempts": 3}), 202)
        done = client.wait(job["id"], timeout_s=300)
        assert done["status"] == "failed", done
        assert done["attempts"] == []
        errors.append(done["error"])
    assert errors[1] == errors[0]
    assert "training loss became nan" in errors[1], errors[1]
    assert "rank" not in errors[1] and "exit code" not in errors[1]
