"""Compiled steps in the worker (NOTE [ Compiled jobs ] in api_schemas/jobs/params.py), run
in-process through compute(): a train job and an entropy job compiled with aot_eager (traced
like inductor's graphs, no C compilation, so the test stays quick) against the same jobs run
eagerly. The service end to end, with inductor: tests/e2e/training/test_compile_e2e.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

from api_schemas import AdaptParams, JobPayload, TrainParams
from api_schemas.jobs.public import JobPayloadDataset, JobPayloadModel
from harness.digits import digits
from harness.stack import npz_bytes
from service.local.summary import report_summary
from service.store.local import LocalStore
from workers.kinds.changing import compute
from workers.models.architectures import build_model
from workers.passes.steps import CompileError, StepClock, step_forward
from workers.running.compute import JobOutcome
from workers.running.saving import weights_bytes


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> LocalStore:
    return LocalStore(tmp_path_factory.mktemp("store"))


def run(store: LocalStore, kind: str, params: dict[str, Any], eager: bool = False) -> JobOutcome:
    """A job on a digits_cnn of width 4 (blocks checkpointed, the default policy) and 400
    shifted digits, compiled with aot_eager unless ``eager``."""
    x, y = digits(shifted=True, n=400)
    torch.manual_seed(2)
    model = build_model("digits_cnn", {"width": 4})
    compiled = {} if eager else {"compile": True, "compile_backend": "aot_eager"}
    job_params = (TrainParams if kind == "train" else AdaptParams).model_validate(
        {**params, **compiled}
    )
    payload = JobPayload(
        job_id="job_compiled",
        tenant_id="tn_test",
        kind=kind,  # type: ignore[arg-type]
        model=JobPayloadModel(
            id="mdl_source",
            architecture="digits_cnn",
            kwargs={"width": 4},
            weights_sha256=store.put_bytes(weights_bytes(model.state_dict())),
        ),
        dataset=JobPayloadDataset(
            id="ds_target", sha256=store.put_bytes(npz_bytes(x=x, y=y)), format="npz"
        ),
        params=job_params,
    )
    return compute(payload, store)


JOBS = [
    pytest.param("train", {"epochs": 2, "batch_size": 64, "lr": 0.02}, id="train"),
    pytest.param("adapt", {"estimator": "entropy", "batch_size": 64, "steps": 9}, id="entropy"),
]


@pytest.mark.parametrize(("kind", "params"), JOBS)
def test_compiled_job_keeps_the_statistics_exact(
    store: LocalStore, kind: str, params: dict[str, Any]
) -> None:
    compiled, eager = run(store, kind, params), run(store, kind, params, eager=True)
    steps, eager_steps = compiled.report.steps, eager.report.steps
    assert steps is not None and eager_steps is not None
    assert steps.compiled and steps.backend == "aot_eager" and steps.graphs_compiled >= 1
    assert not eager_steps.compiled and eager_steps.backend is None
    assert eager_steps.graphs_compiled == 0 and eager_steps.warmup_steps == 1
    for timed, report in ((steps, compiled.report), (eager_steps, eager.report)):
        assert timed.steps == report.batches > 0
        assert timed.warmup_steps + timed.steady_steps == timed.steps
        assert timed.warmup_steps >= 1 and timed.steady_samples_per_s is not None
        assert timed.steady_samples < report.samples
    assert compiled.report.batches == eager.report.batches
    assert any(
        line.startswith("steps (compiled with aot_eager)")
        for line in report_summary(compiled.report)
    )
    assert any(line.startswith("steps (eager): 1 warm-up") for line in report_summary(eager.report))
    assert list(compiled.state_dict) == list(eager.state_dict)  # unwrapped, uncompiled keys
    for layer in compiled.report.batchnorm:
        assert layer.consistent and layer.batches_run == compiled.report.batches
    for key, value in compiled.state_dict.items():
        if key.endswith("num_batches_tracked"):
            assert torch.equal(value, eager.state_dict[key]), key
            assert int(value) == compiled.report.batches
        elif "running_" in key:
            torch.testing.assert_close(value, eager.state_dict[key], rtol=1e-4, atol=1e-5)


def test_forward_only_jobs_report_no_steps(store: LocalStore) -> None:
    outcome = run(store, "adapt", {"estimator": "precise", "batch_size": 64}, eager=True)
    assert outcome.report.steps is None


def test_the_clock_counts_recompiling_steps_as_warm_up() -> None:
    """A shorter batch compiles another graph: that step is warm-up too, not steady."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    forward = step_forward(model, "aot_eager")
    clock = StepClock(torch.device("cpu"), "aot_eager")
    for size in (8, 8, 8, 5, 5):
        clock.start()
        forward(torch.randn(size, 6)).square().mean().backward()
        clock.stop(size)
    timings = clock.timings()
    assert timings.graphs_compiled == 2
    assert (timings.warmup_steps, timings.steady_steps) == (2, 3)
    assert timings.steady_samples == 8 + 8 + 5


def test_a_failing_compilation_says_what_to_do() -> None:
    def refuse(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        raise RuntimeError("this backend compiles nothing")

    torch._dynamo.reset()
    torch._dynamo.register_backend(refuse, name="bnadapt_test_refuse")
    forward = step_forward(nn.Linear(3, 2), "bnadapt_test_refuse")
    with pytest.raises(CompileError, match=r"backend 'bnadapt_test_refuse' failed .* without"):
        forward(torch.randn(4, 3))
    assert step_forward(nn.Linear(3, 2), None)(torch.randn(4, 3)).shape == (4, 2)
