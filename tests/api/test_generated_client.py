"""A client generated from the API's own OpenAPI document, at test time, by a real generator
(openapi-python-client), used against the real API over HTTP: register a model (with a
weights file) and a dataset, submit an adapt job, poll it, read its report and download the
output weights. A document the generator cannot read, or a response the generated models
cannot parse, fails here."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.digits import digits_npz
from harness.stack import Stack

pytestmark = pytest.mark.slow

GENERATOR = shutil.which("openapi-python-client", path=str(Path(sys.executable).parent))
if GENERATOR is None:  # the `dev` extra installs it
    pytest.skip("needs openapi-python-client", allow_module_level=True)

PACKAGE = "bnadapt_generated_client"


@pytest.fixture(scope="module")
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


@pytest.fixture(scope="module")
def generated(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The generated package, from the document the running API serves."""
    root = tmp_path_factory.mktemp("generated")
    document = root / "openapi.json"
    document.write_bytes(httpx.get(f"{stack.url}/openapi.json", timeout=30).content)
    result = subprocess.run(
        [GENERATOR, "generate", "--path", str(document), "--output-path", str(root / PACKAGE),
         "--meta", "none"],
        capture_output=True, text=True, cwd=root, timeout=300,
        # ruff (a `dev` tool) formats the generated code; it sits beside the generator.
        env={"PATH": f"{Path(GENERATOR).parent}:/usr/bin:/bin"},
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # The generator warns (and leaves an operation or a model out) where it cannot read the
    # document: none is acceptable.
    assert "Warning" not in output, output
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
            del sys.modules[name]


def api(package: Any, name: str) -> Any:
    """``package.api.<name>``: the generated module of one operation."""
    return importlib.import_module(f"{PACKAGE}.api.{name}")


def test_generated_client_registers_submits_polls_and_reads_the_report(
    stack: Stack, generated: Any
) -> None:
    models = importlib.import_module(f"{PACKAGE}.models")
    types = importlib.import_module(f"{PACKAGE}.types")
    key = stack.records().create_api_key("generated-client").key
    client = generated.AuthenticatedClient(
        base_url=stack.url, token=key, raise_on_unexpected_status=True, timeout=httpx.Timeout(60)
    )
    with client:
        # A model with a weights file: the first model's weights, downloaded by the client.
        initial = api(generated, "models.create_model_v1_models_post").sync(
            client=client,
            body=models.BodyCreateModelV1ModelsPost(
                meta=json.dumps({"architecture": "digits_cnn", "kwargs": {"width": 8}})
            ),
        )
        assert isinstance(initial, models.ModelPublic), initial
        weights = api(generated, "models.download_weights_v1_models_model_id_weights_get")
        downloaded = weights.sync_detailed(model_id=initial.id, client=client)
        assert downloaded.status_code == 200
        model = api(generated, "models.create_model_v1_models_post").sync(
            client=client,
            body=models.BodyCreateModelV1ModelsPost(
                meta=json.dumps({"architecture": "digits_cnn", "kwargs": {"width": 8}}),
                weights=types.File(payload=downloaded.content, file_name="w.safetensors"),
            ),
        )
        assert isinstance(model, models.ModelPublic), model
        assert model.sha256 == initial.sha256  # the same bytes, sent as a file

        dataset = api(generated, "datasets.create_dataset_v1_datasets_post").sync(
            client=client,
            body=models.CreateDatasetV1DatasetsPostFilesBody(
                file=types.File(payload=digits_npz(), file_name="digits.npz"), name="digits"
            ),
        )
        assert isinstance(dataset, models.DatasetPublic), dataset
        assert dataset.num_samples > 0

        body = models.AdaptJobCreate(
            kind="adapt",
            model_id=model.id,
            dataset_id=dataset.id,
            params=models.AdaptParams(estimator=models.AdaptParamsEstimator.PRECISE, batch_size=64),
            tags=models.AdaptJobCreateTags.from_dict({"client": "generated"}),
        )
        job = api(generated, "jobs.create_job_v1_jobs_post").sync(client=client, body=body)
        assert isinstance(job, models.JobPublic), job
        get_job = api(generated, "jobs.get_job_v1_jobs_job_id_get")
        deadline = time.monotonic() + 180
        while job.status.value not in ("succeeded", "failed", "canceled"):
            assert time.monotonic() < deadline, f"job {job.id} still {job.status.value}"
            time.sleep(0.3)
            job = get_job.sync(job_id=job.id, client=client)
            assert isinstance(job, models.JobPublic), job
        assert job.status.value == "succeeded", job.error
        assert job.tags.to_dict() == {"client": "generated"}

        listed = api(generated, "jobs.list_jobs_v1_jobs_get").sync(
            client=client, tag=["client:generated"]
        )
        assert isinstance(listed, models.PageJobPublic), listed
        assert [found.id for found in listed.items] == [job.id]

        report = api(generated, "jobs.get_report_v1_jobs_job_id_report_get").sync(
            job_id=job.id, client=client
        )
        assert isinstance(report, models.Report), report
        assert report.job_id == job.id
        assert report.estimator == "precise"
        assert report.batchnorm, "a BatchNorm layer changed"
        assert isinstance(report.diagnostics, models.PredictionDiagnostics)
        output = api(generated, "models.get_model_v1_models_model_id_get").sync(
            model_id=report.output_model_id, client=client
        )
        assert isinstance(output, models.ModelPublic), output
        assert output.parent == model.id

        # An error comes back as the documented problem, parsed.
        missing = get_job.sync(job_id="no-such-job", client=client)
        assert isinstance(missing, models.Problem), missing
        assert missing.status == 404
