"""Schemathesis over the API's own OpenAPI document, against the real stack over HTTP: no
request it generates may get a 5xx, a status or content type the document does not list, or
a body that does not match the documented schema. Examples per operation are bounded
(``FUZZ_EXAMPLES``, 10 by default) so that the suite stays short; raise it for a deeper run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from harness.stack import Stack, running_stack
from service.api.app import create_app
from service.settings import Settings

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "10"))


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("fuzz"), {"BNADAPT_WORKER_THREADS": "1"}) as stack:
        yield stack


@pytest.fixture(scope="module")
def auth(fuzz_stack: Stack) -> dict[str, str]:
    records = fuzz_stack.records()
    key = records.create_api_key("fuzz")
    # Thousands of requests from one tenant: no rate limit, so that each reaches its route.
    records.set_quota(key.tenant_id, "rate_per_s", 0)
    return {"Authorization": f"Bearer {key.key}"}


# The document the running API serves (/openapi.json) is built by the same factory; building
# it starts nothing (no Redis, no lifespan), and the server answers the requests.
schema = schemathesis.openapi.from_dict(create_app(Settings()).openapi())


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_conforms_to_its_openapi_document(
    case: Any, fuzz_stack: Stack, auth: dict[str, str]
) -> None:
    case.call_and_validate(
        base_url=fuzz_stack.url,
        headers={**(case.headers or {}), **auth},
        # A request the schema allows may still be refused with a documented 4xx: a
        # page_token this service did not issue, a job body without its `kind`.
        excluded_checks=[schemathesis.checks.positive_data_acceptance],
    )
