"""The admission estimate of a train job in several processes counts each rank's weights and
slice (issue 41, point 3; ``needed_memory`` in service/jobs/submission.py): ranks sharing a
CPU worker's memory each hold a copy of the model and its optimizer state, besides the job's
own process's; on CUDA each rank has a GPU to itself."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from harness.answers import created, problem
from harness.digits import digits
from harness.inprocess import InProcessApi, running_api
from harness.stack import npz_bytes
from service.records.connection import redis_client
from service.records.job_life.capacity import WorkerMemory
from service.settings import MIB


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessApi]:
    with running_api(tmp_path_factory.mktemp("ranks-admission")) as api:
        yield api


def test_each_rank_counts_its_own_weights(api: InProcessApi) -> None:
    client = api.client("ranks-admission")
    # Weights that outweigh a small batch's activations: 64 -> 1024 -> 1024 -> 10.
    model = created(client.add_model("mlp", {"in_features": 64, "hidden": 1024}))
    x, y = digits(n=40)
    dataset = created(client.add_dataset(npz_bytes(x=x.reshape(len(x), 64), y=y)))
    # One process holds the weights 4 times (weights, gradients, two moments) and the batch's
    # activations; 2 ranks on one machine the weights 9 times (4 each, and the job's own
    # process's copy) and their slices' activations, the batch's. Workers with memory between.
    weights = model["parameter_count"] * 4
    activations = model["activations"]["backward_bytes_per_element"] * 64 * 20
    memory = math.ceil((activations + 6.5 * weights) / 0.7)
    published = WorkerMemory(redis_client(api.redis.url))
    queues = [api.settings.job_queue("cpu"), api.settings.job_queue("cuda")]
    published.publish(queues, "w-small", memory, ttl_s=60)
    ids = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}
    try:
        created(client.submit({**ids, "params": {"batch_size": 20, "device": "cpu"}}), 202)
        refused = problem(
            client.submit({**ids, "params": {"batch_size": 20, "device": "cpu", "processes": 2}}),
            422,
            "batch_size 20",
            f"workers have {memory / MIB:.1f} MiB",
            "fewer processes",
        )
        assert "each rank holds its own copy" in refused["detail"], refused
        # On CUDA each rank has a GPU to itself: one copy and one slice a GPU.
        created(
            client.submit({**ids, "params": {"batch_size": 20, "device": "cuda", "processes": 2}}),
            202,
        )
    finally:
        published.withdraw(queues, "w-small")
