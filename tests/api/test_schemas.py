"""The API contract: bounds, unknown fields, ids, the job union, timestamps, round trips."""

from __future__ import annotations

import math
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import ValidationError

import api_schemas
from api_schemas import (
    ESTIMATOR_NAMES,
    ESTIMATORS,
    MAX_BATCH_SIZE,
    AdaptJobCreate,
    AdaptParams,
    BatchNormChange,
    BatchNormLayer,
    DatasetPublic,
    JobPayload,
    JobPublic,
    JobStatus,
    Metrics,
    ModelCreate,
    ModelPublic,
    Page,
    Problem,
    Report,
    Timings,
    TrainJobCreate,
    TrainParams,
    new_id,
    parse_job_create,
    utc_now,
)

SHA = "ab" * 32


def error_types(exc: pytest.ExceptionInfo[ValidationError]) -> list[tuple[tuple[Any, ...], str]]:
    return [(tuple(e["loc"]), e["type"]) for e in exc.value.errors()]


def job_body(**overrides: Any) -> dict[str, Any]:
    return {"kind": "adapt", "model_id": "mdl_a", "dataset_id": "ds_b", **overrides}


def test_no_torch_import() -> None:
    code = "import sys, api_schemas; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_all_names_exist() -> None:
    assert len(set(api_schemas.__all__)) == len(api_schemas.__all__)
    for name in api_schemas.__all__:
        assert hasattr(api_schemas, name), name


@pytest.mark.parametrize("batch_size", [0, -1, MAX_BATCH_SIZE + 1])
def test_batch_size_out_of_range(batch_size: int) -> None:
    with pytest.raises(ValidationError) as exc:
        AdaptParams(batch_size=batch_size)
    assert error_types(exc)[0][0] == ("batch_size",)
    with pytest.raises(ValidationError):
        TrainParams(batch_size=batch_size)


@pytest.mark.parametrize("batch_size", [1, MAX_BATCH_SIZE])
def test_batch_size_bounds_inclusive(batch_size: int) -> None:
    assert AdaptParams(batch_size=batch_size).batch_size == batch_size


def test_unknown_estimator() -> None:
    with pytest.raises(ValidationError) as exc:
        AdaptParams.model_validate({"estimator": "magic"})
    assert error_types(exc) == [(("estimator",), "literal_error")]
    assert set(ESTIMATOR_NAMES) == {
        "ema",
        "ema_momentum",
        "cumulative",
        "precise",
        "prior",
        "entropy",
        "auto",
    }


@pytest.mark.parametrize(
    ("estimator", "reset", "expected"),
    [
        ("cumulative", None, True),
        ("precise", None, True),
        ("prior", None, True),
        ("ema", None, False),
        ("entropy", None, False),
        ("cumulative", True, True),
        ("ema", True, True),
        ("ema", False, False),
        ("entropy", True, True),
    ],
)
def test_effective_reset(estimator: str, reset: bool | None, expected: bool) -> None:
    params = AdaptParams.model_validate({"estimator": estimator, "reset": reset})
    assert params.effective_reset() is expected


@pytest.mark.parametrize("estimator", ["cumulative", "precise", "prior"])
def test_estimators_that_replace_statistics_refuse_reset_false(estimator: str) -> None:
    with pytest.raises(ValidationError, match=f"the {estimator} estimator replaces"):
        AdaptParams.model_validate({"estimator": estimator, "reset": False})


def test_prior_and_entropy_options() -> None:
    params = AdaptParams()
    assert params.prior_strength == 16.0
    assert params.prior_base == "precise"
    assert params.lr == 1e-3
    assert params.steps is None
    assert params.optimizer == "adam"
    assert AdaptParams(prior_strength=0.0).prior_strength == 0.0
    bad: list[tuple[str, object, str]] = [
        ("prior_strength", -1.0, "greater_than_equal"),
        ("prior_strength", "Infinity", "finite_number"),
        ("prior_base", "ema", "literal_error"),
        ("lr", 0.0, "greater_than"),
        ("steps", 0, "greater_than_equal"),
        ("optimizer", "adamw", "literal_error"),
    ]
    for field, value, kind in bad:
        with pytest.raises(ValidationError) as exc:
            AdaptParams.model_validate({field: value})
        assert error_types(exc) == [((field,), kind)], field


def test_adapt_defaults() -> None:
    params = AdaptParams()
    assert params.batch_size == 64
    assert params.estimator == "cumulative"
    assert params.include == ["*"]
    assert params.checkpoint.preset == "blocks"
    assert params.device == "auto"
    # default_factory: instances never share their lists
    assert AdaptParams().include is not params.include


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_batches", 0),
        ("include", []),
        ("include", [""]),
        ("device", "gpu"),
        ("device", "cuda:x"),
        ("seed", -1),
        ("seed", 2**63),
    ],
)
def test_adapt_params_rejected(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as exc:
        AdaptParams.model_validate({field: value})
    assert error_types(exc)[0][0][0] == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epochs", 0),
        ("epochs", 1001),
        ("lr", 0.0),
        ("lr", math.nan),
        ("lr", math.inf),
        ("momentum", 1.0),
        ("momentum", -0.1),
        ("weight_decay", -1e-4),
        ("validation_fraction", 0.95),
        ("optimizer", "adam"),
        ("loss", "l1"),
    ],
)
def test_train_params_rejected(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as exc:
        TrainParams.model_validate({field: value})
    assert error_types(exc)[0][0] == (field,)


def test_train_params_bounds_inclusive() -> None:
    params = TrainParams(epochs=1000, momentum=0.0, validation_fraction=0.9, weight_decay=0.0)
    assert params.validation_fraction == 0.9


def test_parse_job_create_picks_kind() -> None:
    adapt = parse_job_create(job_body(params={"estimator": "ema"}))
    assert isinstance(adapt, AdaptJobCreate)
    assert adapt.params.estimator == "ema"
    train = parse_job_create(job_body(kind="train", params={"epochs": 3}))
    assert isinstance(train, TrainJobCreate)
    assert train.params.epochs == 3
    assert isinstance(parse_job_create(job_body()).params, AdaptParams)


def test_unknown_kind() -> None:
    with pytest.raises(ValidationError) as exc:
        parse_job_create(job_body(kind="finetune"))
    assert error_types(exc) == [((), "union_tag_invalid")]


def test_missing_kind() -> None:
    body = job_body()
    del body["kind"]
    with pytest.raises(ValidationError) as exc:
        parse_job_create(body)
    assert error_types(exc) == [((), "union_tag_not_found")]


def test_params_of_other_kind_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        parse_job_create(job_body(kind="train", params={"estimator": "ema"}))
    assert error_types(exc) == [(("train", "params", "estimator"), "extra_forbidden")]


@pytest.mark.parametrize(
    "body",
    [
        job_body(urgency=1),
        job_body(params={"batchsize": 8}),
        job_body(params={"checkpoint": {"preset": "blocks", "wrap": True}}),
    ],
)
def test_extra_fields_rejected(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as exc:
        parse_job_create(body)
    assert [t for _, t in error_types(exc)] == ["extra_forbidden"]


@pytest.mark.parametrize("priority", [-11, 11, 1.5, "1", True])
def test_priority_is_a_small_integer(priority: Any) -> None:
    """A tenant orders its own jobs with -10..10 (NOTE [ Fair turns ] in
    service/records/tenancy/turns.py); 0 when left out."""
    assert parse_job_create(job_body()).priority == 0
    assert parse_job_create(job_body(priority=-10)).priority == -10
    with pytest.raises(ValidationError) as exc:
        parse_job_create(job_body(priority=priority))
    assert [loc[-1] for loc, _ in error_types(exc)] == ["priority"]


@pytest.mark.parametrize("bad", ["", "abc:cancel", "../etc", "a/b", "a" * 65, "mdl_a\n", "é"])
def test_bad_ids(bad: str) -> None:
    with pytest.raises(ValidationError) as exc:
        parse_job_create(job_body(model_id=bad))
    assert error_types(exc) == [(("adapt", "model_id"), "string_pattern_mismatch")]


def test_new_id_matches_pattern() -> None:
    job_id = new_id("job")
    assert job_id.startswith("job_")
    assert len(job_id) == len("job_") + 22
    assert parse_job_create(job_body(model_id=job_id)).model_id == job_id
    assert new_id("job") != job_id


def test_job_public_params_follow_kind() -> None:
    # {"batch_size": 8} alone fits both params classes; `kind` decides.
    record = {
        "id": "job_x",
        "kind": "train",
        "status": "queued",
        "model_id": "mdl_a",
        "dataset_id": "ds_b",
        "params": {"batch_size": 8},
        "created_at": "2026-01-02T03:04:05Z",
    }
    job = JobPublic.model_validate(record)
    assert isinstance(job.params, TrainParams)
    assert JobPublic.model_validate({**record, "kind": "adapt"}).params == AdaptParams(batch_size=8)
    assert JobPublic.model_validate_json(job.model_dump_json()) == job


def test_job_public_rejects_params_of_other_kind() -> None:
    with pytest.raises(ValidationError, match="params are TrainParams but kind is 'adapt'"):
        JobPublic(
            id="job_x",
            kind="adapt",
            status=JobStatus.RUNNING,
            model_id="mdl_a",
            dataset_id="ds_b",
            params=TrainParams(),
            created_at=utc_now(),
        )


def test_job_public_reports_errors_once_with_location() -> None:
    with pytest.raises(ValidationError) as exc:
        JobPublic.model_validate(
            {
                "id": "job_x",
                "kind": "adapt",
                "status": "queued",
                "model_id": "mdl_a",
                "dataset_id": "ds_b",
                "params": {"batch_size": 0},
                "created_at": utc_now(),
            }
        )
    assert error_types(exc) == [(("params", "batch_size"), "greater_than_equal")]


def test_job_payload_json_round_trip() -> None:
    payload = JobPayload.model_validate(
        {
            "job_id": "job_x",
            "tenant_id": "tn_1",
            "kind": "adapt",
            "model": {
                "id": "mdl_a",
                "architecture": "resnet",
                "kwargs": {"depth": 18},
                "weights_sha256": SHA,
            },
            "dataset": {"id": "ds_b", "sha256": SHA, "format": "npz"},
            "params": {"estimator": "ema", "max_batches": 10},
        }
    )
    again = JobPayload.model_validate_json(payload.model_dump_json())
    assert again == payload
    assert isinstance(again.params, AdaptParams)
    assert again.params.max_batches == 10
    with pytest.raises(ValidationError):
        JobPayload.model_validate({**payload.model_dump(), "extra": 1})


def test_job_status() -> None:
    assert [s.value for s in JobStatus] == ["queued", "running", "succeeded", "failed", "canceled"]
    assert JobStatus("failed") == "failed"
    assert f"{JobStatus.RUNNING}" == "running"
    assert not JobStatus.RUNNING.is_terminal
    assert JobStatus.CANCELED.is_terminal


def test_timestamps_are_utc() -> None:
    now = utc_now()
    assert now.tzinfo is UTC
    progress = {"done": 1, "total": 2, "unit": "batches", "samples_per_second": 3.0, "phase": "x"}
    local = datetime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    parsed = api_schemas.Progress.model_validate({**progress, "updated_at": local})
    assert parsed.updated_at.utcoffset() == timedelta(0)
    assert parsed.updated_at == local
    assert parsed.updated_at.hour == 10
    with pytest.raises(ValidationError) as exc:
        api_schemas.Progress.model_validate({**progress, "updated_at": datetime(2026, 1, 1)})
    assert error_types(exc) == [(("updated_at",), "timezone_aware")]


def test_model_create_keeps_kwarg_types() -> None:
    created = ModelCreate.model_validate_json(
        '{"architecture": "mlp", "kwargs": {"a": 1, "b": 1.0, "c": true, "d": "x", "e": null}}'
    )
    assert [type(v) for v in created.kwargs.values()] == [int, float, bool, str, type(None)]
    assert created.seed == 0
    with pytest.raises(ValidationError):
        ModelCreate.model_validate({"architecture": "mlp", "kwargs": {"layers": {"n": 2}}})
    with pytest.raises(ValidationError):
        ModelCreate.model_validate({"architecture": "../mlp"})


def test_model_public_and_page() -> None:
    model = ModelPublic(
        id="mdl_a",
        architecture="digits_cnn",
        kwargs={},
        sha256=SHA,
        size_bytes=10,
        parameter_count=5,
        batchnorm_layers=[
            BatchNormLayer(
                name="bn1",
                kind="BatchNorm2d",
                num_features=8,
                momentum=None,
                track_running_stats=True,
            )
        ],
        input_shape=[1, 28, 28],
        source="init",
        created_at=utc_now(),
    )
    page = Page[ModelPublic](items=[model])
    assert Page[ModelPublic].model_validate_json(page.model_dump_json()) == page
    with pytest.raises(ValidationError):
        ModelPublic.model_validate({**model.model_dump(), "sha256": SHA.upper()})


def test_dataset_public_label_facts_agree() -> None:
    fields: dict[str, Any] = {
        "id": "ds_a",
        "name": "digits",
        "num_samples": 10,
        "sample_shape": [1, 8, 8],
        "dtype": "float32",
        "has_labels": True,
        "label_kind": "class",
        "num_classes": 10,
        "sha256": SHA,
        "size_bytes": 100,
        "format": "npz",
        "created_at": utc_now(),
    }
    assert DatasetPublic.model_validate(fields).num_classes == 10
    bads: list[dict[str, Any]] = [
        {"has_labels": False},
        {"num_classes": None},
        {"label_kind": "target"},
    ]
    for bad in bads:
        with pytest.raises(ValidationError):
            DatasetPublic.model_validate({**fields, **bad})


def test_problem() -> None:
    problem = Problem(title="Not Found", status=404, detail="no model mdl_a")
    assert problem.type == "about:blank"
    with pytest.raises(ValidationError):
        Problem(title="OK", status=200)


def test_report_keeps_nan_through_json() -> None:
    report = Report(
        job_id="job_x",
        kind="train",
        input_model_id="mdl_a",
        output_model_id="mdl_b",
        device="cpu",
        torch_version="2.13.0",
        batches=3,
        samples=96,
        timings=Timings(load_s=0.1, compute_s=1.0, total_s=1.2),
        batchnorm=[
            BatchNormChange(
                name="bn1",
                adapted=True,
                running_mean_mean_abs_shift=0.5,
                running_var_mean_ratio=1.1,
                num_batches_tracked_before=0,
                num_batches_tracked_after=3,
                batches_run=3,
            )
        ],
        tensors=[],
        metrics_after=Metrics(num_samples=96, loss=math.nan, accuracy=0.1),
    )
    text = report.model_dump_json()
    assert '"loss":"NaN"' in text
    again = Report.model_validate_json(text)
    assert again.metrics_after is not None
    assert math.isnan(again.metrics_after.loss)
    assert again.epochs == []


def test_layerwise_is_a_precise_option_for_one_worker() -> None:
    assert AdaptParams(estimator="precise", layerwise=True).layerwise
    with pytest.raises(ValidationError, match="layerwise is an option of the precise estimator"):
        AdaptParams(estimator="cumulative", layerwise=True)
    with pytest.raises(ValidationError, match="cannot be split into shards; use shards=1"):
        AdaptParams(estimator="precise", layerwise=True, shards=2)


def test_compile_is_for_train_jobs_and_the_estimators_whose_passes_compile() -> None:
    """NOTE [ Compiled jobs ]: compile for train jobs and every estimator whose row has
    ``compiles``; refused for the others (auto) and layerwise, naming those that accept it."""
    assert TrainParams(compile=True).compile_backend == "inductor"
    assert TrainParams(compile=True, compile_backend="aot_eager").compile
    compiling = [name for name, spec in ESTIMATORS.items() if spec.compiles]
    assert compiling == ["ema", "ema_momentum", "cumulative", "precise", "prior", "entropy"]
    for name in compiling:
        assert AdaptParams.model_validate({"estimator": name, "compile": True}).compile
    with pytest.raises(
        ValidationError,
        match=r"the auto estimator cannot run through torch.compile: it runs and scores "
        r"several candidates.*use estimator 'ema', .*'prior' or 'entropy'",
    ):
        AdaptParams.model_validate({"estimator": "auto", "compile": True})
    with pytest.raises(ValidationError, match="drop compile, or drop layerwise"):
        AdaptParams(estimator="precise", layerwise=True, compile=True)
    with pytest.raises(ValidationError, match="the entropy estimator is sequential"):
        AdaptParams(estimator="entropy", compile=True, shards=2)
    for params in (TrainParams, AdaptParams):
        with pytest.raises(ValidationError, match="add compile: true, or drop compile_backend"):
            params.model_validate({"compile_backend": "aot_eager"})
        # Stored params carry every field: the default backend without compile passes.
        assert params.model_validate(params().model_dump()).compile is False
        with pytest.raises(ValidationError, match="compile_backend"):
            params.model_validate({"compile": True, "compile_backend": "cudagraphs"})
