"""Compiled jobs end to end (NOTE [ Compiled jobs ] in api_schemas/jobs/params.py): a train job
and an entropy adapt job with ``compile: true`` (inductor, the default backend) through the real
API, queue and worker, on a model run through checkpoint wrappers. The checkpoint guarantee
holds under compile: every layer's num_batches_tracked grows by exactly the steps run, in the
report and in the stored weights, and the statistics agree with the same job run eagerly in
this process (to the rounding that compiling changes; bitwise agreement is not expected from
inductor's fused kernels).

On a GPU machine (``pytest -m gpu``) a worker serving the CUDA queue runs a compiled train job
on CUDA the same way."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import safetensors.torch
import torch

from api_schemas import AdaptParams, TrainParams
from harness.answers import created, problem
from harness.digits import digits_npz
from harness.stack import SHARED_STACK_THREADS, Client, Stack, job_payload, running_stack
from tests.e2e.test_e2e import store_of
from workers.kinds.changing import compute

pytestmark = pytest.mark.slow

WORKER_THREADS = SHARED_STACK_THREADS
# Inductor's first compilation of a small CNN's forward and backward takes tens of seconds on a
# loaded 2-core machine.
COMPILE_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


def eager_reference(stack: Stack, job_id: str) -> dict[str, torch.Tensor]:
    """The job's payload run here without compile, on as many threads as the worker."""
    payload = job_payload(stack, job_id)
    params = payload.params
    assert isinstance(params, AdaptParams | TrainParams)
    eager = payload.model_copy(update={"params": params.model_copy(update={"compile": False})})
    threads = torch.get_num_threads()
    torch.set_num_threads(WORKER_THREADS)
    try:
        return compute(eager, store_of(stack)).state_dict
    finally:
        torch.set_num_threads(threads)


def check_steps(report: dict[str, Any], backend: str) -> None:
    """The report's step timings add up, and say the steps ran compiled."""
    steps = report["steps"]
    assert steps["compiled"] is True and steps["backend"] == backend
    assert steps["steps"] == report["batches"] > 0
    assert steps["warmup_steps"] + steps["steady_steps"] == steps["steps"]
    assert steps["warmup_steps"] >= 1 and steps["graphs_compiled"] >= 1
    assert steps["steady_steps"] > 0 and steps["steady_samples_per_s"] > 0


def check_statistics(
    report: dict[str, Any],
    state: dict[str, torch.Tensor],
    eager: dict[str, torch.Tensor],
    rtol: float = 1e-3,
    atol: float = 1e-4,
) -> None:
    """num_batches_tracked exact in the report and the weights; running statistics as eager's
    (within ``rtol``/``atol``)."""
    for layer in report["batchnorm"]:
        start = 0 if layer["reset"] else layer["num_batches_tracked_before"]
        assert layer["num_batches_tracked_after"] == start + layer["batches_run"]
        assert layer["batches_run"] == report["batches"]
        name = layer["name"]
        tracked = f"{name}.num_batches_tracked"
        assert int(state[tracked]) == layer["num_batches_tracked_after"]
        assert torch.equal(state[tracked], eager[tracked])
        for buffer in ("running_mean", "running_var"):
            key = f"{name}.{buffer}"
            torch.testing.assert_close(state[key], eager[key], rtol=rtol, atol=atol)


def test_compile_is_refused_where_it_cannot_help(stack: Stack) -> None:
    client = stack.client("compile-refused")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=200)))
    ids = {"model_id": model["id"], "dataset_id": dataset["id"]}
    several_passes = {"estimator": "auto", "compile": True}
    body = problem(
        client.submit({"kind": "adapt", **ids, "params": several_passes}),
        422,
        "the auto estimator cannot run through torch.compile",
        "use estimator 'ema'",
    )
    assert body["status"] == 422
    sharded = {"estimator": "entropy", "compile": True, "shards": 2}
    problem(client.submit({"kind": "adapt", **ids, "params": sharded}), 422, "sequential")
    no_compile = {"compile_backend": "aot_eager"}
    problem(
        client.submit({"kind": "train", **ids, "params": no_compile}),
        422,
        "add compile: true, or drop compile_backend",
    )


def compiled_train(
    stack: Stack,
    client: Client,
    extra_params: dict[str, Any] | None = None,
    rtol: float = 1e-3,
    atol: float = 1e-4,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A compiled train job (2 epochs of 600 digits, ``extra_params`` added) through the API:
    its finished record and its report, its weights' statistics checked against the same job
    run eagerly here (within ``rtol``/``atol``)."""
    params = {"epochs": 2, "batch_size": 50, "lr": 0.02, "compile": True, **(extra_params or {})}
    model = created(client.add_model("digits_cnn", {"width": 8}, seed=1))
    labelled = created(client.add_dataset(digits_npz(n=600)))
    train = created(
        client.submit(
            {
                "kind": "train",
                "model_id": model["id"],
                "dataset_id": labelled["id"],
                "params": params,
            }
        ),
        202,
    )
    done = client.wait(train["id"], timeout_s=COMPILE_TIMEOUT_S)
    assert done["status"] == "succeeded", done
    report = client.http.get(done["result"]["report_url"]).json()
    check_steps(report, "inductor")
    state = safetensors.torch.load(client.http.get(done["result"]["weights_url"]).content)
    check_statistics(report, state, eager_reference(stack, train["id"]), rtol=rtol, atol=atol)
    return done, report


def test_compiled_train_then_entropy_keep_the_statistics_exact(stack: Stack) -> None:
    client = stack.client("compiled")
    done, report = compiled_train(stack, client)

    # TENT on shifted data, from the trained model: its counters start where training left them.
    shifted = created(client.add_dataset(digits_npz(shifted=True, n=600, labels=False)))
    adapt = created(
        client.submit(
            {
                "kind": "adapt",
                "model_id": done["result"]["model_id"],
                "dataset_id": shifted["id"],
                "params": {"estimator": "entropy", "batch_size": 50, "compile": True},
            }
        ),
        202,
    )
    adapted = client.wait(adapt["id"], timeout_s=COMPILE_TIMEOUT_S)
    assert adapted["status"] == "succeeded", adapted
    adapt_report = client.http.get(adapted["result"]["report_url"]).json()
    check_steps(adapt_report, "inductor")
    for layer in adapt_report["batchnorm"]:
        assert layer["num_batches_tracked_before"] == report["batches"]
        assert not layer["reset"]
    adapted_state = safetensors.torch.load(
        client.http.get(adapted["result"]["weights_url"]).content
    )
    check_statistics(adapt_report, adapted_state, eager_reference(stack, adapt["id"]))


@pytest.fixture(scope="module")
def cuda_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    limits = {"BNADAPT_WORKER_THREADS": str(WORKER_THREADS)}
    with running_stack(
        tmp_path_factory.mktemp("cuda-stack"), limits, worker_device="cuda"
    ) as stack:
        yield stack


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_train_on_cuda_keeps_the_statistics_exact(cuda_stack: Stack) -> None:
    """A compiled train job asking for CUDA waits in the CUDA queue, runs there under inductor,
    and keeps num_batches_tracked exact; its statistics agree with the same job run eagerly on
    CUDA in this process, to the looser rounding of CUDA's kernels (TF32 convolutions in both)."""
    client = cuda_stack.client("compiled-cuda")
    _, report = compiled_train(cuda_stack, client, {"device": "cuda"}, rtol=1e-2, atol=1e-3)
    assert report["device"] == "cuda"
