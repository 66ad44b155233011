"""SyncBatchNorm across ranks on CUDA (``pytest -m gpu``, on a machine with 2 GPUs or more;
skipped elsewhere: NCCL runs one rank a GPU). A 2-process train job with ``sync_batchnorm``
normalises each step with the statistics of the whole global batch, so it equals, to 1e-5,
the same job in one process on whole batches: weights, running statistics and
num_batches_tracked, which grows by exactly one a step (every rank checks it of itself before
the job succeeds: ``_check_one_update_a_step`` in workers/training/ranks.py). The MLP keeps the
comparison off TF32 convolutions, which would round differently for the two batch sizes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import safetensors.torch
import torch

from harness.answers import created
from harness.digits import digits
from harness.stack import Client, Stack, npz_bytes, running_stack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 CUDA devices",
    ),
]


@pytest.fixture(scope="module")
def cuda_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    limits = {"BNADAPT_WORKER_THREADS": "1"}
    with running_stack(
        tmp_path_factory.mktemp("ranks-cuda"), limits, worker_device="cuda"
    ) as stack:
        yield stack


def trained(client: Client, body: dict[str, Any], params: dict[str, Any]) -> tuple[Any, Any]:
    job = created(client.submit({**body, "params": params}), 202)
    done = client.wait(job["id"], timeout_s=600)
    assert done["status"] == "succeeded", done
    report = client.http.get(done["result"]["report_url"]).json()
    state = safetensors.torch.load(client.http.get(done["result"]["weights_url"]).content)
    return report, state


def test_sync_batchnorm_over_two_gpus_equals_one_process(cuda_stack: Stack) -> None:
    client = cuda_stack.client("sync-bn")
    model = created(client.add_model("mlp", {"in_features": 64, "hidden": 32}, seed=4))
    x, y = digits(n=600)
    dataset = created(client.add_dataset(npz_bytes(x=x.reshape(len(x), 64), y=y)))
    body = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}
    # 540 training samples in batches of 60: every global batch whole, 30 a rank.
    common = {"epochs": 2, "batch_size": 60, "lr": 0.05, "device": "cuda"}
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
    # Without sync_batchnorm each rank normalises its own 30 samples: another result.
    _, unsynced = trained(client, body, {**common, "processes": 2})
    assert any(
        not torch.allclose(unsynced[k], one[k], rtol=0, atol=1e-5)
        for k in one
        if k.endswith("running_var")
    )
