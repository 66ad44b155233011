"""The ``evaluate`` job: the contract in process, then end to end over HTTP with a real
Redis-compatible server, the API under uvicorn and a real worker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from pydantic import ValidationError

from api_schemas import (
    EvaluateJobCreate,
    EvaluateParams,
    JobPublic,
    JobResultLinks,
    parse_job_create,
)
from api_schemas.reports import Report
from harness.answers import created, problem
from harness.digits import digits, digits_npz
from harness.stack import Client, Stack, job_payload, npz_bytes
from service.client import Client as ApiClient
from service.client import new_model_id
from service.errors import BnadaptError
from service.local.cli import main as cli_main
from service.store.local import LocalStore
from workers.kinds.evaluate import compute_evaluation
from workers.models.architectures import build_model
from workers.running.evaluation import evaluate_sums


def test_evaluate_request_and_result_links() -> None:
    request = parse_job_create({"kind": "evaluate", "model_id": "mdl_a", "dataset_id": "ds_b"})
    assert isinstance(request, EvaluateJobCreate)
    assert request.params == EvaluateParams(batch_size=512, loss=None, device="auto")
    with pytest.raises(ValidationError, match="estimator"):
        parse_job_create(
            {
                "kind": "evaluate",
                "model_id": "mdl_a",
                "dataset_id": "ds_b",
                "params": {"estimator": "precise"},
            }
        )
    links = JobResultLinks(model_id=None, weights_url=None, report_url="/v1/jobs/job_a/report")
    # Present and null, not omitted: clients can rely on the keys.
    assert json.loads(links.model_dump_json()) == {
        "model_id": None,
        "weights_url": None,
        "report_url": "/v1/jobs/job_a/report",
    }
    with pytest.raises(ValidationError, match="both set"):
        JobResultLinks(model_id="mdl_a", weights_url=None, report_url="/r")
    with pytest.raises(ValidationError, match="EvaluateParams"):
        JobPublic.model_validate(
            {
                "id": "job_a",
                "kind": "adapt",
                "status": "queued",
                "model_id": "mdl_a",
                "dataset_id": "ds_b",
                "params": EvaluateParams(),
                "created_at": "2026-01-01T00:00:00Z",
            }
        )


@pytest.fixture(scope="module")
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


def evaluate_body(model_id: str, dataset_id: str, **params: Any) -> dict[str, Any]:
    return {"kind": "evaluate", "model_id": model_id, "dataset_id": dataset_id, "params": params}


def weights(client: Client, model_id: str) -> dict[str, torch.Tensor]:
    response = client.http.get(f"/v1/models/{model_id}/weights")
    assert response.status_code == 200, response.text
    return safetensors.torch.load(response.content)


@pytest.mark.usefixtures("one_torch_thread")  # the shared stack's worker runs on one
def test_evaluate_job_reports_what_evaluate_computes(stack: Stack) -> None:
    client = stack.client("evaluate")
    model = created(client.add_model("digits_cnn", {"width": 8}, seed=3))
    dataset = created(client.add_dataset(digits_npz(shifted=True)))
    models_before = client.http.get("/v1/models").json()["items"]

    submitted = client.submit(evaluate_body(model["id"], dataset["id"], batch_size=100))
    job = created(submitted, 202)
    assert submitted.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["kind"] == "evaluate"
    assert job["params"] == {
        "batch_size": 100,
        "loss": None,
        "device": "auto",
        "preprocessing": None,
    }
    done = client.wait(job["id"])
    assert done["status"] == "succeeded", done
    assert done["result"] == {
        "model_id": None,
        "weights_url": None,
        "report_url": f"/v1/jobs/{job['id']}/report",
    }
    # No model registered.
    assert client.http.get("/v1/models").json()["items"] == models_before

    report = Report.model_validate(client.http.get(done["result"]["report_url"]).json())
    assert report.kind == "evaluate"
    assert report.input_model_id == model["id"]
    assert report.output_model_id is None
    assert report.metrics_after is None
    assert report.batchnorm == [] and report.tensors == []
    assert (report.batches, report.samples) == (18, 1797)  # ceil(1797 / 100) batches
    metrics = report.metrics_before
    assert metrics is not None and metrics.accuracy is not None

    # The plain computation, in this process, on the model's weights as served.
    net = build_model("digits_cnn", {"width": 8})
    net.load_state_dict(weights(client, model["id"]), strict=True)
    x, y = digits(shifted=True)
    expected = evaluate_sums(
        net, torch.from_numpy(x), torch.from_numpy(y), batch_size=100, loss="cross_entropy"
    ).metrics()
    assert metrics.num_samples == expected.num_samples == 1797
    assert metrics.accuracy == expected.accuracy
    assert metrics.loss == pytest.approx(expected.loss, rel=1e-6)
    assert metrics.mse is None
    # The job function itself, run here on the job's payload: the same numbers exactly.
    payload = job_payload(stack, job["id"])
    again = compute_evaluation(payload, LocalStore(stack.data_dir / "store"))
    assert again.metrics_before == metrics


@pytest.mark.slow
def test_evaluate_matches_the_adapt_report_and_lists(stack: Stack) -> None:
    """An adapt job's ``metrics_after`` and an evaluate job of its output model on the same
    dataset, in the adapt job's batch size, are the same computation."""
    client = stack.client("evaluate-adapted")
    model = created(client.add_model("digits_cnn", {"width": 8}, seed=1))
    dataset = created(client.add_dataset(digits_npz(shifted=True, n=600)))
    adapt = created(
        client.submit(
            {
                "kind": "adapt",
                "model_id": model["id"],
                "dataset_id": dataset["id"],
                # Measured on all 600 samples (10 batches), as the evaluate job measures.
                "params": {
                    "estimator": "precise",
                    "batch_size": 64,
                    "max_batches": 2,
                    "measure_batches": 10,
                },
            }
        ),
        202,
    )
    adapted = client.wait(adapt["id"])
    assert adapted["status"] == "succeeded", adapted
    body = evaluate_body(adapted["result"]["model_id"], dataset["id"], batch_size=64)
    check = created(client.submit(body), 202)
    assert client.wait(check["id"])["status"] == "succeeded"
    adapt_report = client.http.get(f"/v1/jobs/{adapt['id']}/report").json()
    check_report = client.http.get(f"/v1/jobs/{check['id']}/report").json()
    assert check_report["metrics_before"] == adapt_report["metrics_after"]
    assert adapt_report["metrics_after"] != adapt_report["metrics_before"]

    listed = client.http.get("/v1/jobs").json()["items"]
    assert [(j["id"], j["kind"]) for j in listed] == [
        (check["id"], "evaluate"),
        (adapt["id"], "adapt"),
    ]
    succeeded = client.http.get("/v1/jobs", params={"status": "succeeded"}).json()["items"]
    assert check["id"] in {j["id"] for j in succeeded}
    shown = client.http.get(f"/v1/jobs/{check['id']}").json()
    assert shown["kind"] == "evaluate" and shown["result"]["model_id"] is None


@pytest.mark.slow
def test_evaluate_regression_targets(stack: Stack) -> None:
    client = stack.client("evaluate-mse")
    model = created(client.add_model("digits_cnn", {"width": 8, "num_classes": 1}))
    x, _ = digits(n=64)
    targets = np.linspace(0, 1, 64, dtype=np.float32)
    dataset = created(client.add_dataset(npz_bytes(x=x, y=targets)))
    job = created(client.submit(evaluate_body(model["id"], dataset["id"])), 202)
    assert client.wait(job["id"])["status"] == "succeeded"
    metrics = client.http.get(f"/v1/jobs/{job['id']}/report").json()["metrics_before"]
    assert metrics["accuracy"] is None
    assert metrics["mse"] == metrics["loss"] >= 0


@pytest.mark.slow
def test_evaluate_refuses_what_it_cannot_measure(stack: Stack) -> None:
    client = stack.client("evaluate-bad")
    model = created(client.add_model("digits_cnn", {"width": 8}))
    labelled = created(client.add_dataset(digits_npz(n=64)))
    unlabelled = created(client.add_dataset(digits_npz(n=64, labels=False)))
    x, _ = digits(n=64)
    targets = created(client.add_dataset(npz_bytes(x=x, y=np.linspace(0, 1, 64, dtype=np.float32))))

    body = problem(client.submit(evaluate_body(model["id"], unlabelled["id"])), 422)
    assert body["detail"] == (
        f"evaluate jobs need labels but dataset {unlabelled['id']} has no y; upload a "
        "dataset with y (int64 class labels or float targets)"
    )
    problem(
        client.submit(evaluate_body(model["id"], targets["id"], loss="cross_entropy")),
        422,
        "loss cross_entropy needs int64 class labels",
    )
    problem(
        client.submit(evaluate_body(model["id"], labelled["id"], loss="mse")),
        422,
        "loss mse needs float targets",
    )
    body = problem(client.submit(evaluate_body(model["id"], labelled["id"], batch_size=0)), 422)
    assert body["errors"][0]["loc"][-1] == "batch_size"
    problem(client.submit(evaluate_body(model["id"], labelled["id"], device="tpu")), 422, "device")
    problem(
        client.submit(evaluate_body(model["id"], labelled["id"], estimator="precise")),
        422,
        "estimator",
    )
    problem(client.submit(evaluate_body("mdl_doesnotexist", labelled["id"])), 404, "model")
    assert client.http.get("/v1/jobs").json()["items"] == []  # nothing was created


@pytest.mark.slow
def test_client_and_cli_handle_an_evaluate_job(
    stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = stack.records().create_api_key("evaluate-cli").key
    client = ApiClient(stack.url, key)
    x, y = digits(n=200)
    (tmp_path / "d.npz").write_bytes(npz_bytes(x=x, y=y))
    model = client.add_model("digits_cnn", {"width": 8})
    dataset = client.add_dataset(tmp_path / "d.npz")
    job = client.wait(client.submit("evaluate", model.id, dataset.id).id, timeout_s=120)
    assert job.status.value == "succeeded"
    with pytest.raises(BnadaptError, match="registers no model; its result is the report"):
        new_model_id(job)
    metrics = client.report(job.id).metrics_before
    assert metrics is not None and metrics.accuracy is not None

    flags = ["--url", stack.url, "--key", key]
    capsys.readouterr()
    assert cli_main([*flags, "jobs", "show", job.id]) == 0
    shown = capsys.readouterr()
    assert json.loads(shown.out)["result"]["model_id"] is None
    assert f"accuracy {metrics.accuracy:.4f}" in shown.err
    out = tmp_path / "out"
    assert cli_main([*flags, "jobs", "download", job.id, "--out", str(out)]) == 0
    downloaded = capsys.readouterr()
    assert "report only" in downloaded.err
    assert sorted(p.name for p in out.iterdir()) == [f"{job.id}.report.json"]
    assert Report.model_validate_json((out / f"{job.id}.report.json").read_text()).kind == (
        "evaluate"
    )
    assert cli_main([*flags, "jobs", "list"]) == 0
    assert f"{job.id}  evaluate" in capsys.readouterr().out
    client.close()
