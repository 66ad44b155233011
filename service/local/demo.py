"""``bnadapt demo``: the main job, end to end, on scikit-learn's bundled digits (no download).

Starts everything (``bnadapt up``'s stack), trains the digits CNN through the service, uploads a
shifted copy of the held-out digits (contrast halved, brightness raised), BN-adapts the trained
model to it, downloads the adapted weights, and prints accuracy before and after with the
report's summary, then lets the ``auto`` estimator choose for the clean and the shifted digits
and prints its candidates and choice. bench/adaptation/quality.py reuses its data split and
training.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from api_schemas import JobPublic
from api_schemas.reports import Report
from service.client import Client, new_model_id
from service.local.summary import outcome_lines, report_summary
from service.local.up import LocalStack

__all__ = [
    "SPLIT_SEED",
    "TRAIN_PARAMS",
    "TRAIN_SAMPLES",
    "DigitsSplit",
    "digits_split",
    "run_demo",
    "shift",
    "train_digits_cnn",
    "write_npz",
]

TRAIN_SAMPLES: Final = 1200
SPLIT_SEED: Final = 0
# The train job's params: 15 epochs of SGD (lr 0.05, momentum 0.9) on 90% of the train split.
TRAIN_PARAMS: Final[dict[str, Any]] = {
    "epochs": 15,
    "batch_size": 32,
    "lr": 0.05,
    "validation_fraction": 0.1,
}
CONTRAST: Final = 0.5
BRIGHTNESS: Final = 0.3


@dataclass(frozen=True)
class DigitsSplit:
    """scikit-learn's 1,797 bundled digits as (N, 1, 8, 8) float32 in [0, 1] with int64
    labels, split once by a fixed permutation: :data:`TRAIN_SAMPLES` to train, the rest to
    test."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def digits_split() -> DigitsSplit:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8) in [0, 1]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    train, test = order[:TRAIN_SAMPLES], order[TRAIN_SAMPLES:]
    return DigitsSplit(x[train], y[train], x[test], y[test])


def shift(x: np.ndarray) -> np.ndarray:
    """The demo's covariate shift: lower contrast, higher brightness, still in [0, 1]."""
    return np.clip(x * CONTRAST + BRIGHTNESS, 0.0, 1.0).astype(np.float32)


def write_npz(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=y)
    path.write_bytes(buffer.getvalue())
    return path


def _succeeded(client: Client, job: JobPublic) -> JobPublic:
    from service.local.cli_client import wait_with_bar

    done = wait_with_bar(client, job.id)
    if done.status.value != "succeeded" or done.result is None:
        raise RuntimeError(f"job {done.id} ended {done.status.value}: {done.error}")
    return done


def train_digits_cnn(client: Client, train_file: Path, epochs: int | None = None) -> str:
    """Registers the digits CNN with fresh weights (seed 0), uploads ``train_file`` and trains
    the model on it through the service with :data:`TRAIN_PARAMS` (``epochs`` replaces
    theirs); the trained model's id."""
    model = client.add_model("digits_cnn", seed=0)
    train_set = client.add_dataset(train_file, "digits train")
    params = TRAIN_PARAMS if epochs is None else {**TRAIN_PARAMS, "epochs": epochs}
    return new_model_id(_succeeded(client, client.submit("train", model.id, train_set.id, params)))


def _accuracy(report: Report, when: str) -> float:
    metrics = report.metrics_before if when == "before" else report.metrics_after
    if metrics is None or metrics.accuracy is None:
        raise RuntimeError(f"the report of job {report.job_id} has no accuracy {when}")
    return metrics.accuracy


def run_demo(data_dir: Path, port: int) -> int:
    split = digits_split()
    work = data_dir / "demo"
    work.mkdir(parents=True, exist_ok=True)
    train_file = write_npz(work / "digits-train.npz", x=split.x_train, y=split.y_train)
    clean_file = write_npz(work / "digits-test.npz", x=split.x_test, y=split.y_test)
    shifted_file = write_npz(
        work / "digits-test-shifted.npz", x=shift(split.x_test), y=split.y_test
    )

    with LocalStack(data_dir, port=port) as stack:
        assert stack.client_config is not None
        client = Client(stack.client_config.url, stack.client_config.key)
        print(f"bnadapt is up at {stack.url}; state in {stack.data_dir}\n")

        print("1. register the digits CNN (fresh weights) and train it on 1,200 clean digits")
        source_id = train_digits_cnn(client, train_file)

        print(f"\n2. upload the {len(split.x_test)} held-out digits, clean and shifted")
        clean_set = client.add_dataset(clean_file, "digits test")
        shifted_set = client.add_dataset(
            shifted_file, f"digits test, contrast x{CONTRAST}, brightness +{BRIGHTNESS}"
        )

        print("\n3. BN-adapt the trained model to the clean and to the shifted digits")
        params = {"estimator": "cumulative", "batch_size": 64}
        on_clean = _succeeded(client, client.submit("adapt", source_id, clean_set.id, params))
        adapted = _succeeded(client, client.submit("adapt", source_id, shifted_set.id, params))
        print("   and let the auto estimator choose for both, without labels")
        auto_params = {"estimator": "auto", "batch_size": 64}
        auto_clean = _succeeded(
            client, client.submit("adapt", source_id, clean_set.id, auto_params)
        )
        auto_shifted = _succeeded(
            client, client.submit("adapt", source_id, shifted_set.id, auto_params)
        )
        weights = client.download_weights(new_model_id(adapted), work / "adapted.safetensors")
        report = client.report(adapted.id)
        (work / "adapt-report.json").write_text(report.model_dump_json(indent=2))
        clean_report = client.report(on_clean.id)

        print("\n4. results")
        print(f"   source model, clean test digits:     {_accuracy(clean_report, 'before'):.3f}")
        print(f"   source model, shifted test digits:   {_accuracy(report, 'before'):.3f}")
        print(f"   adapted model, shifted test digits:  {_accuracy(report, 'after'):.3f}")
        print(f"   adapted weights: {weights}")
        print(f"   report:          {work / 'adapt-report.json'}\n")
        for line in report_summary(report):
            print(f"   {line}")
        for name, job in (("clean", auto_clean), ("shifted", auto_shifted)):
            auto_report = client.report(job.id)
            print(
                f"\n   auto on the {name} digits: accuracy {_accuracy(auto_report, 'before'):.3f}"
                f" -> {_accuracy(auto_report, 'after'):.3f}"
            )
            for line in outcome_lines(job, auto_report):
                print(f"   {line}")
    return 0 if all(layer.consistent for layer in report.batchnorm) else 1
