"""An adapt job's bf16 and channels-last passes (NOTE [ Adaptation in bf16 ] in
workers/passes/precision.py): each estimator's running statistics within the stated bound of
the fp32 pass on two models of the catalog, the buffers float32, the model's memory format put
back; fp32 the exact default."""

from __future__ import annotations

import copy
from typing import Final

import pytest
import torch
from torch import nn

from api_schemas import AdaptParams
from workers.estimators.base import select_batchnorm
from workers.estimators.dispatch import run_estimator
from workers.models.architectures import build_model
from workers.passes.hooks import NoHooks
from workers.passes.precision import adaptation_numerics

# The bound of NOTE [ Adaptation in bf16 ]: the largest difference of a selected layer's
# running mean or variance, relative to that layer's largest fp32 value.
BF16_BOUND: Final = 0.01
ESTIMATORS: Final = ["ema", "ema_momentum", "cumulative", "precise", "prior", "entropy"]
MODELS: Final = {
    "digits_cnn": ({"width": 8}, (1, 8, 8)),
    "resnet": ({"depth": 2, "width": 8}, (3, 32, 32)),
}


def model_and_data(name: str) -> tuple[nn.Module, torch.Tensor]:
    kwargs, shape = MODELS[name]
    torch.manual_seed(0)
    model = build_model(name, kwargs).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(96, *shape, generator=gen) * 2 + 0.25  # shifted from the init statistics
    return model, x


def adapted(
    model: nn.Module,
    x: torch.Tensor,
    estimator: str,
    precision: str,
    channels_last: bool,
    device: torch.device = torch.device("cpu"),  # noqa: B008 - immutable
) -> dict[str, torch.Tensor]:
    """What Adaptation.run does: the estimator's runner under adaptation_numerics, on
    ``device``; the state on the CPU."""
    model = copy.deepcopy(model).to(device)
    params = AdaptParams.model_validate(
        {
            "estimator": estimator,
            "batch_size": 32,
            "precision": precision,
            "channels_last": channels_last,
            "steps": 2,
        }
    )
    layers = select_batchnorm(model, params.include, params.exclude)
    torch.manual_seed(0)
    with adaptation_numerics(model, device, precision, channels_last):
        run_estimator(
            model,
            params,
            layers,
            NoHooks(),
            x=x,
            reset=params.effective_reset(),
            device=device,
        )
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def statistics_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest running-statistics difference, relative to its layer's largest value."""
    worst = 0.0
    for key in a:
        if key.endswith(("running_mean", "running_var")):
            scale = float(b[key].abs().max())
            worst = max(worst, float((a[key] - b[key]).abs().max()) / max(scale, 1e-12))
    return worst


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_bf16_statistics_are_within_the_stated_bound_of_fp32(
    model_name: str, estimator: str
) -> None:
    model, x = model_and_data(model_name)
    exact = adapted(model, x, estimator, "fp32", False)
    half = adapted(model, x, estimator, "bf16", False)
    distance = statistics_distance(half, exact)
    print(f"{model_name} {estimator}: {distance:.2e}")  # the NOTE's table: pytest -s
    assert 1e-4 < distance <= BF16_BOUND, distance  # above float32 rounding: it ran in bf16
    for key, value in half.items():
        assert value.dtype == exact[key].dtype, key  # statistics stay float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_on_cuda_bf16_statistics_are_within_the_same_bound(model_name: str, estimator: str) -> None:
    model, x = model_and_data(model_name)
    cuda = torch.device("cuda")
    exact = adapted(model, x, estimator, "fp32", False, cuda)
    half = adapted(model, x, estimator, "bf16", True, cuda)
    distance = statistics_distance(half, exact)
    print(f"cuda {model_name} {estimator}: {distance:.2e}")
    assert 1e-4 < distance <= BF16_BOUND, distance


def test_fp32_is_the_default_and_runs_bit_for_bit_as_without_numerics() -> None:
    assert AdaptParams().precision == "fp32" and AdaptParams().channels_last is False
    model, x = model_and_data("resnet")
    plain = copy.deepcopy(model)
    params = AdaptParams(estimator="precise", batch_size=32)
    layers = select_batchnorm(plain, params.include, params.exclude)
    run_estimator(plain, params, layers, NoHooks(), x=x, reset=True, device=torch.device("cpu"))
    exact = adapted(model, x, "precise", "fp32", False)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, exact[key]), key


def test_channels_last_runs_within_float_rounding_and_puts_the_format_back() -> None:
    model, x = model_and_data("resnet")
    exact = adapted(model, x, "precise", "fp32", False)
    last = adapted(model, x, "precise", "fp32", True)
    assert statistics_distance(last, exact) < 1e-5
    for key, value in last.items():
        assert value.is_contiguous(), key  # stored weights keep the default layout
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    with adaptation_numerics(model, torch.device("cpu"), "fp32", True):
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert conv.weight.is_contiguous()


def test_an_unknown_precision_is_refused() -> None:
    model, _ = model_and_data("digits_cnn")
    with (
        pytest.raises(ValueError, match="precision must be 'fp32' or 'bf16'"),
        adaptation_numerics(model, torch.device("cpu"), "fp16", False),
    ):
        pass


@pytest.mark.parametrize("estimator", ["precise", "cumulative"])
def test_a_compiled_pass_runs_through_the_graphs_and_equals_the_eager_one(estimator: str) -> None:
    """NOTE [ Compiled jobs ]: the estimator's pass goes through the forward the job gives it
    (graphs compiled), with the same statistics as eager (aot_eager's kernels are eager's)."""
    import torch._dynamo

    from workers.passes.steps import step_forward

    model, x = model_and_data("resnet")
    exact = adapted(model, x, estimator, "fp32", False)
    compiled = copy.deepcopy(model)
    params = AdaptParams.model_validate(
        {"estimator": estimator, "batch_size": 32, "compile": True, "compile_backend": "aot_eager"}
    )
    layers = select_batchnorm(compiled, params.include, params.exclude)
    torch._dynamo.reset()
    before = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    run_estimator(
        compiled,
        params,
        layers,
        NoHooks(),
        x=x,
        reset=True,
        device=torch.device("cpu"),
        forward=step_forward(compiled, "aot_eager"),
    )
    assert int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) > before
    for key, value in compiled.state_dict().items():
        assert torch.equal(value, exact[key]), key
