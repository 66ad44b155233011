"""NOTE [ Shared job fields ]: every kind's params and request derive from the bases in
api_schemas/jobs/params.py, a kind's request narrows only ``kind`` and ``params``, and every
field of a base is in every kind's schema, as the base declares it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from api_schemas.jobs import (
    JOB_KINDS,
    BaseJobCreate,
    BaseJobParams,
    JobKindSpec,
    ModelJobParams,
)

KEPT_DOCUMENT = Path(__file__).parents[1] / "openapi.json"
ROWS = list(JOB_KINDS.items())
ROW_IDS = list(JOB_KINDS)


def properties(model: type[BaseModel]) -> dict[str, Any]:
    schema: dict[str, Any] = model.model_json_schema(ref_template="{model}")
    return {name: {**value, "default": None} for name, value in schema["properties"].items()}


@pytest.mark.parametrize(("name", "spec"), ROWS, ids=ROW_IDS)
def test_every_kind_derives_from_the_bases(name: str, spec: JobKindSpec) -> None:
    assert issubclass(spec.params, BaseJobParams)
    assert issubclass(spec.create, BaseJobCreate)
    # The kinds that change a model (and so register one) have the model-changing fields.
    assert issubclass(spec.params, ModelJobParams) is spec.registers_model


@pytest.mark.parametrize(("name", "spec"), ROWS, ids=ROW_IDS)
def test_a_kind_request_narrows_only_kind_and_params(name: str, spec: JobKindSpec) -> None:
    fields = spec.create.model_fields
    assert fields["kind"].annotation == Literal[name]
    assert fields["params"].annotation is spec.params
    # What the class itself declares; the rest it inherits.
    assert set(vars(spec.create)["__annotations__"]) == {"kind", "params"}
    assert list(fields) == list(BaseJobCreate.model_fields)
    request = spec.create.model_validate({"kind": name, "model_id": "m", "dataset_id": "d"})
    assert request.params == spec.params()


@pytest.mark.parametrize(("name", "spec"), ROWS, ids=ROW_IDS)
def test_every_field_of_a_base_is_in_every_kind_schema_as_declared(
    name: str, spec: JobKindSpec
) -> None:
    """A field added to a base is checked here with no edit: its schema (defaults aside, which
    a kind may change) is in each kind's schema."""
    bases: list[type[BaseModel]] = [BaseJobParams]
    if spec.registers_model:
        bases.append(ModelJobParams)
    kind = properties(spec.params)
    for base in bases:
        for field, schema in properties(base).items():
            assert kind.get(field) == schema, (spec.params.__name__, field)
    request = properties(spec.create)
    for field, schema in properties(BaseJobCreate).items():
        if field not in ("kind", "params"):
            assert request.get(field) == schema, (spec.create.__name__, field)


def test_the_bases_have_no_schema_of_their_own_in_the_document() -> None:
    """pydantic flattens inherited fields into each kind's schema: the document names the
    kinds' classes only."""
    schemas = json.loads(KEPT_DOCUMENT.read_text())["components"]["schemas"]
    assert not {"BaseJobParams", "ModelJobParams", "BaseJobCreate"} & set(schemas)
    for spec in JOB_KINDS.values():
        for cls in (spec.params, spec.create):
            assert "allOf" not in json.dumps(schemas[cls.__name__])
