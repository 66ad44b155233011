"""Training, evaluation and data loading; checkpointed training against plain, bitwise."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from workers.errors import DataError, JobCanceled, TrainError
from workers.models.architectures import build_model, registry
from workers.models.policy import apply_checkpoint_policy
from workers.passes.data import iter_batches, num_batches, to_tensors
from workers.running.evaluation import Metrics, evaluate_sums, loss_for
from workers.training.training import (
    EpochLog,
    TrainHooks,
    TrainSettings,
    TrainStats,
    batch_bounds,
    train_model,
)

SETTINGS: dict[str, Any] = {
    "epochs": 2,
    "batch_size": 32,
    "optimizer": "sgd",
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "loss": "cross_entropy",
    "validation_fraction": 0.2,
    "seed": 7,
    "device": "cpu",
}


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """300 digits as (N, 1, 8, 8) in [0, 1] and int64 labels."""
    data = load_digits()
    x = (data.images[:300, None] / 16).astype(np.float32)
    x_t, y_t = to_tensors(x, data.target[:300])
    assert y_t is not None
    return x_t, y_t


def digits_cnn() -> nn.Module:
    torch.manual_seed(0)
    return build_model("digits_cnn", {"width": 4})


def nbt(model: nn.Module) -> list[int]:
    return [int(v) for k, v in model.state_dict().items() if k.endswith("num_batches_tracked")]


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_checkpointed_training_is_bitwise_plain_training(
    digits: tuple[torch.Tensor, torch.Tensor], optimizer: str
) -> None:
    x, y = digits
    plain = digits_cnn()
    wrapped = copy.deepcopy(plain)
    names = apply_checkpoint_policy(wrapped, registry()["digits_cnn"], "blocks", [], [], False)
    assert names == ["block1", "block2"]
    settings = SETTINGS | {"optimizer": optimizer}
    stats_plain = train_model(plain, x, y, TrainSettings(**settings))
    stats_wrapped = train_model(wrapped, x, y, TrainSettings(**settings))
    assert_same_state(plain, wrapped)
    assert stats_plain == stats_wrapped
    # 300 samples, 60 for validation, 240 = 7 batches of 32 + 16, per epoch
    assert stats_plain.steps == 16 and stats_plain.samples == 480
    assert nbt(plain) == nbt(wrapped) == [16, 16], "one statistics update per step"
    assert [log.epoch for log in stats_plain.epochs] == [1, 2]
    last = stats_plain.epochs[-1]
    assert last.val_loss is not None and last.val_accuracy is not None
    assert last.val_accuracy > 0.5, "it learns something"


def test_training_is_deterministic_and_leaves_the_rng_alone(
    digits: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, y = digits
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    a, b, c = digits_cnn(), digits_cnn(), digits_cnn()
    torch.set_rng_state(rng)
    train_model(a, x, y, TrainSettings(**SETTINGS))
    assert torch.equal(torch.get_rng_state(), rng)
    train_model(b, x, y, TrainSettings(**SETTINGS))
    train_model(c, x, y, TrainSettings(**SETTINGS | {"seed": 8}))
    assert_same_state(a, b)
    assert not torch.equal(a.state_dict()["head.weight"], c.state_dict()["head.weight"])


def test_progress_cancel_and_flags(digits: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = digits
    model = digits_cnn()
    model.eval()
    seen: list[tuple[int, int]] = []
    progress = TrainHooks(progress=lambda d, t: seen.append((d, t)))
    train_model(model, x, y, TrainSettings(**SETTINGS), hooks=progress)
    assert seen == [(i, 16) for i in range(1, 17)]
    assert not any(m.training for m in model.modules()), "flags restored"

    model.train()
    with pytest.raises(JobCanceled, match="after 3 of 16 steps"):
        train_model(
            model,
            x,
            y,
            TrainSettings(**SETTINGS),
            hooks=TrainHooks(
                progress=lambda d, t: seen.append((d, t)), should_stop=lambda: len(seen) > 18
            ),
        )
    # the stop is asked before a step, progress after it
    assert all(m.training for m in model.modules())


def test_regression_and_no_validation() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(65, 5, generator=gen)
    y = x.sum(dim=1)  # (N,) float targets; the model outputs (B, 1)
    torch.manual_seed(0)
    model = build_model("mlp", {"in_features": 5, "hidden": 8, "num_classes": 1})
    settings = SETTINGS | {"loss": loss_for(y), "validation_fraction": 0.0, "epochs": 3}
    stats = train_model(model, x, y, TrainSettings(**settings))
    assert settings["loss"] == "mse"
    # 65 = 2 * 32 + 1: the one-sample tail is dropped
    assert stats.steps == 6 and stats.samples == 3 * 64
    # No validation: no best epoch; a constant schedule: the job's lr throughout.
    assert stats.epochs[0] == EpochLog(1, stats.epochs[0].train_loss, None, None, 0.05, False)
    assert nbt(model) == [6, 6]
    metrics = evaluate_sums(model, x, y, batch_size=10, loss="mse").metrics()
    assert metrics.accuracy is None and metrics.mse == metrics.loss


@pytest.mark.parametrize(
    ("labels", "settings", "error", "message"),
    [
        (torch.full((40,), 10), {}, DataError, r"span \[10, 10\] but the model has 10 classes"),
        (torch.full((40,), -1), {}, DataError, r"labels must be in \[0, 9\]"),
        (torch.zeros(40), {}, DataError, "cross_entropy needs int64 class labels"),
        (torch.zeros(40, dtype=torch.int64), {"loss": "mse"}, DataError, "mse needs float"),
        (torch.zeros(40, dtype=torch.int64), {"loss": "hinge"}, TrainError, "unknown loss"),
        (torch.zeros(40, dtype=torch.int64), {"optimizer": "lbfgs"}, TrainError, "optimizer"),
        (torch.zeros(39, dtype=torch.int64), {}, DataError, "x has 40 samples but y has 39"),
        (
            torch.zeros(40, dtype=torch.int64),
            {"lr": 1e30, "loss": "cross_entropy"},
            TrainError,
            "loss became",
        ),
    ],
)
def test_bad_labels_and_settings(
    labels: torch.Tensor, settings: dict[str, Any], error: type[Exception], message: str
) -> None:
    x = torch.rand(40, 1, 8, 8)
    with pytest.raises(error, match=message):
        train_model(digits_cnn(), x, labels, TrainSettings(**SETTINGS | settings))


def test_too_few_training_samples() -> None:
    x, y = torch.rand(2, 1, 8, 8), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(TrainError, match="leave 1 for training"):
        train_model(digits_cnn(), x, y, TrainSettings(**SETTINGS | {"validation_fraction": 0.1}))


def test_batch_bounds() -> None:
    assert batch_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert batch_bounds(9, 4) == [(0, 4), (4, 8)]
    assert batch_bounds(1, 4) == [(0, 1)]
    assert batch_bounds(3, 1) == [(0, 1), (1, 2), (2, 3)]


def test_stats_convert_with_asdict() -> None:
    from dataclasses import asdict

    stats = TrainStats([EpochLog(1, 0.5, 0.4, 0.9)], steps=3, samples=96)
    assert asdict(stats)["epochs"] == [
        {
            "epoch": 1,
            "train_loss": 0.5,
            "val_loss": 0.4,
            "val_accuracy": 0.9,
            "lr": None,
            "best": False,
        }
    ]
    assert set(asdict(Metrics(1, 0.0, None, 0.0))) == {"num_samples", "loss", "accuracy", "mse"}


# --- Evaluation ----------------------------------------------------------------------------


def test_evaluate_matches_the_plain_computation(
    digits: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, y = digits
    model = digits_cnn()
    train_model(model, x, y, TrainSettings(**SETTINGS | {"epochs": 1}))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = evaluate_sums(model, x, y, batch_size=64, loss="cross_entropy").metrics()
    assert all(m.training for m in model.modules()), "flags restored"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "no BN update"
    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert metrics.num_samples == 300
    assert metrics.accuracy == (logits.argmax(1) == y).sum().item() / 300
    expected = nn.functional.cross_entropy(logits.double(), y).item()
    assert metrics.loss == pytest.approx(expected, rel=1e-6)  # float32 batches vs one float64
    assert metrics.mse is None


def test_evaluate_refuses_empty_data() -> None:
    with pytest.raises(DataError, match="at least one sample"):
        evaluate_sums(
            digits_cnn(), torch.rand(0, 1, 8, 8), torch.zeros(0), batch_size=4, loss="mse"
        )


# --- Data ----------------------------------------------------------------------------------


def test_to_tensors() -> None:
    x8 = np.array([[0, 255], [51, 102]], dtype=np.uint8)
    x, y = to_tensors(x8, np.array([1, 2], dtype=np.int32))
    assert x.dtype == torch.float32 and torch.equal(x, torch.tensor([[0, 1], [0.2, 0.4]]))
    assert y is not None and y.dtype == torch.int64
    xf = np.ones((2, 3), dtype=np.float32)
    x, y = to_tensors(xf, np.array([0.5, 1.5]))
    assert y is not None and y.dtype == torch.float32
    assert np.shares_memory(x.numpy(), xf)
    xf.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, y = to_tensors(xf, None)
    assert y is None and torch.equal(x, torch.ones(2, 3))
    with pytest.raises(DataError, match="x must be float32 or uint8, got int64"):
        to_tensors(np.zeros((2, 2), dtype=np.int64), None)
    with pytest.raises(DataError, match="got bool"):
        to_tensors(xf, np.array([True, False]))
    with pytest.raises(DataError, match="x has 2 samples but y has 3"):
        to_tensors(xf, np.arange(3))


def test_iter_batches() -> None:
    x = torch.arange(10)
    assert [b.tolist() for b in iter_batches(x, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b.tolist() for b in iter_batches(x, 4, max_batches=2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [b.tolist() for b in iter_batches(x, 20, max_batches=5)] == [list(range(10))]
    assert num_batches(10, 4) == 3 and num_batches(10, 4, 1) == 1 and num_batches(0, 4) == 0
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        iter_batches(x, 0)
    with pytest.raises(ValueError, match="max_batches must be >= 1"):
        iter_batches(x, 2, max_batches=0)


def test_samples_read_rows_when_loaded() -> None:
    from workers.passes.data import Batches, Samples, load_rows

    x8 = np.arange(10 * 2 * 3, dtype=np.uint8).reshape(10, 2, 3)
    as_tensor = torch.from_numpy(x8).to(torch.float32).div_(255)
    samples = Samples(x8)
    assert samples.shape == (10, 2, 3) and len(samples[2:7]) == 5
    assert torch.equal(samples[2:7][1:3].load(), as_tensor[3:5])
    picked = torch.tensor([9, 0, 4])
    assert torch.equal(load_rows(samples, picked), as_tensor[picked])
    assert torch.equal(samples[5:][torch.tensor([1, 0])].load(), as_tensor[[6, 5]])
    big_endian = np.arange(12, dtype=">f4").reshape(6, 2)
    assert torch.equal(Samples(big_endian).load(), torch.arange(12.0).reshape(6, 2))
    batches = Batches(samples, 4, max_batches=2)
    assert len(batches) == 2 and torch.equal(batches[-1], as_tensor[4:8])
    assert [b.shape[0] for b in iter_batches(samples, 4)] == [4, 4, 2]
    with pytest.raises(ValueError, match="step 1"):
        samples[::2]
