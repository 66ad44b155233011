"""An adapt job's ``precision`` and ``channels_last`` through the real API, queue and worker
(NOTE [ Adaptation in bf16 ] in workers/passes/precision.py): the worker's weights are the
same computation run here, bit for bit, and within the stated bound of the fp32 job's."""

from __future__ import annotations

import safetensors.torch
import torch

from harness.answers import created
from harness.digits import digits_npz
from harness.stack import Stack
from tests.e2e.test_e2e import in_process
from tests.workers.estimators.test_adapt_precision import BF16_BOUND, statistics_distance


def test_a_bf16_channels_last_job_runs_as_asked(shared_stack: Stack) -> None:
    client = shared_stack.client("adapt-precision")
    model = created(client.add_model("digits_cnn", {"width": 8}, seed=3))
    dataset = created(client.add_dataset(digits_npz(shifted=True, n=400)))
    ids = {"model_id": model["id"], "dataset_id": dataset["id"]}
    states = {}
    for name, extra in (("fp32", {}), ("bf16", {"precision": "bf16", "channels_last": True})):
        params = {"batch_size": 100, "estimator": "precise", "measure_batches": 1, **extra}
        job = created(client.submit({"kind": "adapt", **ids, "params": params}), 202)
        done = client.wait(job["id"])
        assert done["status"] == "succeeded", done
        state = safetensors.torch.load(client.http.get(done["result"]["weights_url"]).content)
        expected = in_process(shared_stack, job["id"])
        for key, value in expected.items():
            assert torch.equal(state[key], value), key
        states[name] = state
    # Above channels_last's float32 rounding (< 1e-5): the pass ran in bf16.
    assert 1e-4 < statistics_distance(states["bf16"], states["fp32"]) <= BF16_BOUND
