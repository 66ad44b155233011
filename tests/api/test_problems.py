"""The refusals of the layer under the routes (service/errors.py: RefusedError and its
subclasses, raised by service/jobs/ and service/datasets/ without knowing HTTP) arrive as the
one problem body, mapped in service/api/problems.py: the whole body and its headers, not only
the status."""

from __future__ import annotations

import subprocess
import sys

from api_schemas.jobs.kinds import parse_job_create
from harness.answers import created
from harness.digits import digits_npz
from harness.inprocess import InProcessApi
from harness.stack import REPO
from service.jobs.idempotency import body_sha256

PROBLEM_JSON = "application/problem+json"


def test_an_idempotency_conflict_is_the_same_problem(api: InProcessApi) -> None:
    client = api.client("problem-lease")
    records = api.records()
    tenant = records.tenant_for_key(client.http.headers["authorization"].removeprefix("Bearer "))
    assert tenant is not None
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=16)))
    body = {"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}
    # The key leased by a request still in progress (NOTE [ Idempotency lease ]): the lease
    # outlasts the test, so the API's answer is the 409 of service/jobs/idempotency.py.
    digest = body_sha256(parse_job_create(body))
    records.remember_idempotency(tenant, "lease-1", digest, "job_inprogress", 600.0)

    leased = client.submit(body, **{"Idempotency-Key": "lease-1"})

    lease_s = api.settings.idempotency_lease_s
    assert leased.status_code == 409
    assert leased.headers["content-type"] == PROBLEM_JSON
    assert leased.headers["retry-after"] == str(max(1, round(lease_s)))
    assert leased.json() == {
        "type": "about:blank",
        "title": "Conflict",
        "status": 409,
        "detail": f"a request with Idempotency-Key 'lease-1' is still being processed; retry in "
        f"{lease_s:g} s at most (a request that crashed gives up the key by then)",
        "instance": "/v1/jobs",
    }


def test_a_preprocessing_refusal_and_a_missing_resource_are_the_same_problems(
    api: InProcessApi,
) -> None:
    client = api.client("problem-spec")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=16)))
    body = {
        "kind": "evaluate",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"preprocessing": "model"},
    }

    refused = client.submit(body)

    assert refused.status_code == 422
    assert refused.headers["content-type"] == PROBLEM_JSON
    assert "retry-after" not in refused.headers
    problem = refused.json()
    assert set(problem) == {"type", "title", "status", "detail", "instance"}
    assert problem["title"] == "Unprocessable content"
    assert problem["status"] == 422
    assert problem["detail"].startswith(
        f'"preprocessing": "model" asks for the evaluation transform of model {model["id"]}'
    )

    missing = client.submit({**body, "model_id": "mdl_missing", "params": {}})
    assert missing.status_code == 404
    assert missing.json() == {
        "type": "about:blank",
        "title": "Not found",
        "status": 404,
        "detail": "model 'mdl_missing' not found; list yours with GET /v1/models to see the ids",
        "instance": "/v1/jobs",
    }


def test_the_layer_under_the_routes_loads_no_web_framework() -> None:
    """What `lint-imports` holds for every import path, seen in a fresh interpreter: the
    modules that raise the refusals load neither service.api nor FastAPI nor Starlette."""
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, service.jobs.submission, service.datasets.imports; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'starlette') "
            "or m.startswith('service.api')))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.strip() == "[]"
