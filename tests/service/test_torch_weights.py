"""The client's ``.pth`` conversion unpickles only with a torch whose ``weights_only=True`` has
no known hole (NOTE [ The torch that may unpickle ] in service/local/torch_weights.py): the
check on version strings, and one real conversion with the installed torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from service.errors import WeightsFileError
from service.local.torch_weights import check_torch_version, pth_to_safetensors


@pytest.mark.parametrize(
    "found",
    ["1.13.1", "2.5.1", "2.6.0+cu124", "2.9.1", "2.10.0a0+git1234", "2.10.0.dev20251201", "?"],
)
def test_a_torch_with_known_unpickler_holes_is_refused(found: str) -> None:
    with pytest.raises(WeightsFileError) as refused:
        check_torch_version(found)
    message = str(refused.value)
    for phrase in (f"found torch {found}", "torch >= 2.10.0", "upgrade torch", "CVE-2026-24747"):
        assert phrase in message, message


@pytest.mark.parametrize("found", ["2.10.0", "2.10.1", "2.10.0+cpu", "2.13.0+cu130", "2.11", "3.0"])
def test_a_torch_past_them_may_convert(found: str) -> None:
    check_torch_version(found)


def test_the_installed_torch_converts_a_checkpoint(tmp_path: Path) -> None:
    state = {
        "conv.weight": torch.arange(12.0).reshape(3, 4),
        "bn.num_batches_tracked": torch.tensor(7),
    }
    path = tmp_path / "checkpoint.pth"
    torch.save({"epoch": 3, "state_dict": state}, path)
    converted = safetensors.torch.load(pth_to_safetensors(path))
    assert converted.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(converted[name], tensor)
