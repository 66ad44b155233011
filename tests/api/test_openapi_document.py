"""The OpenAPI document is the API's contract with its clients (the generated client, the
UI, the docs): a change to it must be deliberate. This compares the document the app serves
with the one kept beside this file; after a deliberate change, rewrite it with
``BNADAPT_UPDATE_OPENAPI=1 pytest tests/api/test_openapi_document.py`` and review the diff."""

from __future__ import annotations

import json
import os
from pathlib import Path

from service.api.app import create_app
from service.settings import Settings

KEPT = Path(__file__).with_name("openapi.json")


def served_document() -> str:
    return json.dumps(create_app(Settings()).openapi(), indent=1, sort_keys=True) + "\n"


def test_the_document_is_the_one_kept() -> None:
    served = served_document()
    if os.environ.get("BNADAPT_UPDATE_OPENAPI") == "1":
        KEPT.write_text(served)
    kept = KEPT.read_text()
    assert served == kept, (
        "the OpenAPI document changed; if that is deliberate, rewrite tests/api/openapi.json "
        "with BNADAPT_UPDATE_OPENAPI=1 and review its diff"
    )
