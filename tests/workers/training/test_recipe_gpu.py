"""fp16 training with a gradient scaler, and resuming it, on CUDA (skipped without it;
`bash bench/gpu_checks.sh` runs the gpu tests). CUDA kernels are not bitwise deterministic by
default (docs/training.md, the limits of bitwise equality): the resumed run is compared to
the uninterrupted one within a tolerance, the scaler's and the RNGs' states exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.workers.training.test_recipe import Saved
from tests.workers.training.test_training import SETTINGS, digits, digits_cnn
from workers.training.train_state import load_state
from workers.training.training import Checkpointing, Recipe, TrainSettings, train_model

__all__ = ["digits"]  # the fixture, imported for its name

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

RECIPE = Recipe(precision="fp16", clip_grad_norm=1.0, accumulate_steps=2)


def test_fp16_trains_and_resumes_on_cuda(
    digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    x, y = digits
    settings = SETTINGS | {"device": "cuda", "epochs": 3}
    saved = Saved(tmp_path)
    whole = digits_cnn()
    stats = train_model(
        whole, x, y, TrainSettings(**settings), recipe=RECIPE, checkpointing=Checkpointing(saved, 4)
    )
    assert all(math.isfinite(log.train_loss) for log in stats.epochs)
    middle = load_state(saved.paths[1])
    assert middle.scaler is not None and middle.scaler["scale"] > 0
    assert middle.cuda_rng is not None
    resumed = digits_cnn()
    resumed_stats = train_model(
        resumed,
        x,
        y,
        TrainSettings(**settings),
        recipe=RECIPE,
        checkpointing=Checkpointing(lambda s: None, resume=middle),
    )
    assert resumed_stats.steps == stats.steps and resumed_stats.batches == stats.batches
    for key, value in whole.state_dict().items():
        assert torch.allclose(resumed.state_dict()[key], value, rtol=1e-3, atol=1e-4), key


def test_bf16_trains_on_cuda(digits: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = digits
    stats = train_model(
        digits_cnn(),
        x,
        y,
        TrainSettings(**(SETTINGS | {"device": "cuda"})),
        recipe=Recipe(precision="bf16"),
    )
    assert all(math.isfinite(log.train_loss) for log in stats.epochs)
