"""Weights as people hold them (issue 28, deliver 4), in process: keys prefixed by
DataParallel (``module.``) or torch.compile (``_orig_mod.``), in any combination, load; the
stored weights carry the architecture's own keys and the model record says what was renamed.
And a job's ``"preprocessing": "model"`` on an architecture without an evaluation transform is
refused with the reason (the zoo's architectures: tests/zoo/test_preprocessing_zoo.py)."""

from __future__ import annotations

from typing import Any

import pytest
import safetensors.torch
import torch

from harness.answers import created, problem
from harness.digits import digits_npz
from harness.inprocess import InProcessApi
from tests.e2e.test_e2e import weights_of


def _prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + key: value for key, value in state.items()}


@pytest.mark.parametrize(
    ("prefix", "stripped"),
    [
        ("module.", ["module."]),
        ("_orig_mod.", ["_orig_mod."]),
        ("module._orig_mod.", ["module.", "_orig_mod."]),
        ("_orig_mod.module.", ["_orig_mod.", "module."]),
    ],
)
def test_prefixed_keys_load_and_are_stored_canonical(
    api: InProcessApi, prefix: str, stripped: list[str]
) -> None:
    client = api.client(f"prefixes-{len(prefix)}-{stripped[0]}")
    state = weights_of("digits_cnn", {})
    uploaded = safetensors.torch.save(_prefixed(state, prefix))
    model = created(client.add_model("digits_cnn", {}, uploaded))
    assert model["renamed_keys"] == {
        "stripped_prefixes": stripped,
        "layout": None,
        "count": len(state),
    }
    stored = client.http.get(f"/v1/models/{model['id']}/weights")
    assert stored.status_code == 200
    loaded = safetensors.torch.load(stored.content)
    assert sorted(loaded) == sorted(state)
    assert all(torch.equal(loaded[key], state[key]) for key in state)


def test_canonical_keys_are_stored_as_uploaded(api: InProcessApi) -> None:
    client = api.client("canonical-keys")
    uploaded = safetensors.torch.save(weights_of("digits_cnn", {}))
    model = created(client.add_model("digits_cnn", {}, uploaded))
    assert model["renamed_keys"] is None
    assert client.http.get(f"/v1/models/{model['id']}/weights").content == uploaded


def test_a_prefix_on_some_keys_only_is_refused_with_the_keys(api: InProcessApi) -> None:
    client = api.client("partial-prefix")
    state = weights_of("digits_cnn", {})
    first = next(iter(state))
    mixed = {("module." + k if k == first else k): v for k, v in state.items()}
    body = problem(client.add_model("digits_cnn", {}, safetensors.torch.save(mixed)), 422)
    assert f"module.{first}" in body["detail"]
    assert "missing" in body["detail"] and "unexpected" in body["detail"]


def test_model_preprocessing_without_an_evaluation_transform_is_refused(
    api: InProcessApi,
) -> None:
    client = api.client("model-spec-none")
    model = created(client.add_model("digits_cnn", {}))
    assert model["preprocessing"] is None
    dataset = created(client.add_dataset(digits_npz()))
    params: dict[str, Any] = {"preprocessing": "model"}
    response = client.api.request(
        "POST",
        "/v1/jobs",
        json={
            "kind": "adapt",
            "model_id": model["id"],
            "dataset_id": dataset["id"],
            "params": params,
        },
    )
    problem(response, 422, '"preprocessing": "model"', "digits_cnn has none", "give the spec")
