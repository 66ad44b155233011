"""A floor on a train job's checkpoint intervals (issue 41, point 7): ``save_every_steps: 1``
once wrote a store object per optimizer step. Below ``MIN_SAVE_EVERY_STEPS`` steps or
``MIN_SAVE_EVERY_S`` seconds a submission is a 422 that names the floor; at the floor it is
accepted. The API in process, over HTTP."""

from __future__ import annotations

import pytest

from api_schemas.jobs.train import MIN_SAVE_EVERY_S, MIN_SAVE_EVERY_STEPS
from harness.answers import created, problem
from harness.digits import digits_npz
from harness.inprocess import InProcessApi


@pytest.mark.parametrize(
    ("field", "floor"),
    [("save_every_steps", MIN_SAVE_EVERY_STEPS), ("save_every_s", MIN_SAVE_EVERY_S)],
)
def test_checkpoint_intervals_below_the_floor_are_refused(
    api: InProcessApi, field: str, floor: int
) -> None:
    client = api.client(f"intervals-{field}")
    model = created(client.add_model("digits_cnn", {"width": 4}))
    dataset = created(client.add_dataset(digits_npz(n=40)))
    body = {"kind": "train", "model_id": model["id"], "dataset_id": dataset["id"]}
    for below in (1, floor - 1):
        refused = client.submit(body | {"params": {"batch_size": 8, field: below}})
        found = problem(refused, 422, field, f"greater than or equal to {floor}")
        assert any(field in item["loc"] for item in found["errors"]), found
    accepted = client.submit(body | {"params": {"batch_size": 8, field: floor}})
    assert accepted.status_code == 202, accepted.text
    # The OpenAPI document says the floor too (the web UI and generated clients read it).
    schema = api.anonymous().http.get("/openapi.json").json()["components"]["schemas"]
    declared = schema["TrainParams"]["properties"][field]["anyOf"][0]
    assert declared["minimum"] == floor, declared
