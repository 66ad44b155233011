"""The architecture registry: named model factories with checked kwargs.

Sources, in order of precedence (a later source never replaces an earlier name):
1. the built-ins :data:`BUILTINS` (``digits_cnn``, ``resnet``, ``mlp``);
2. entry points of the group ``bnadapt.architectures``: each loads an :class:`Architecture`
   or a zero-argument callable returning one;
3. torchvision's classification models as ``torchvision.<name>`` and timm's as
   ``timm.<name>``, when those libraries import (workers/models/zoo.py, the ``zoo`` extra).

Module names used here and across the workers are those of ``state_dict``: a checkpoint
wrapper adds nothing to them (see :func:`named_modules`).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from workers.errors import ArchitectureError
from workers.models.builtin import (
    BUILTINS,
    ConvBlock,
    MLPBlock,
    ResidualBlock,
    digits_cnn,
    mlp,
    resnet,
)
from workers.models.modules import named_modules
from workers.models.spec import (
    Architecture,
    ParamSpec,
    ParamValue,
)
from workers.models.zoo import from_timm, from_torchvision

__all__ = [
    "ACTIVATION_PROBE_SIDE",
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "Architecture",
    "ConvBlock",
    "LeafTensors",
    "MLPBlock",
    "ParamSpec",
    "ResidualBlock",
    "activation_footprint",
    "batchnorm_layers",
    "build_model",
    "describe",
    "digits_cnn",
    "input_fits",
    "load_weights",
    "mlp",
    "parameter_count",
    "registry",
    "resnet",
    "resolve_kwargs",
    "state_spec",
    "tensor_bytes",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "bnadapt.architectures"
_NAMES_SHOWN = 40  # names an unknown-architecture error lists

# --- Registry -----------------------------------------------------------------------------


def _from_entry_points() -> Iterator[Architecture]:
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry_point.load()
            arch = loaded if isinstance(loaded, Architecture) else loaded()
            if not isinstance(arch, Architecture):
                raise TypeError(f"it gave a {type(arch).__name__}, not an Architecture")
        except Exception:
            logger.warning(
                "skipping architecture entry point %r (%s); fix or uninstall the package "
                "that provides it",
                entry_point.name,
                entry_point.value,
                exc_info=True,
            )
            continue
        yield arch


@functools.lru_cache(maxsize=1)
def registry() -> Mapping[str, Architecture]:
    """Every known architecture by name; built once per process."""
    found: dict[str, Architecture] = {}
    for source in (iter(BUILTINS), _from_entry_points(), from_torchvision(), from_timm()):
        for arch in source:
            if arch.name in found:
                logger.warning("ignoring a second architecture named %r", arch.name)
            else:
                found[arch.name] = arch
    return found


def _get(name: str) -> Architecture:
    known = registry()
    if name not in known:
        # The zoo holds over a thousand names: the message shows the closest ones.
        close = []
        if len(known) > _NAMES_SHOWN:
            close = difflib.get_close_matches(name, list(known), n=10, cutoff=0.5)
        shown = ", ".join(close or sorted(known)[:_NAMES_SHOWN])
        raise ArchitectureError(
            f"unknown architecture {name!r}; {'close' if close else 'known'}: {shown} "
            f"({len(known)} in all, `bnadapt architectures` lists them). Pick one of these, "
            f"install the zoo (bnadapt[zoo]) or a package that registers it under "
            f"{ENTRY_POINT_GROUP!r}"
        )
    return known[name]


def _check_value(arch: Architecture, spec: ParamSpec, value: Any) -> ParamValue:
    where = f"{arch.name}: kwarg {spec.name!r}"
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    checked: ParamValue
    if spec.type == "int" and isinstance(value, int) and not isinstance(value, bool):
        checked = value
    elif spec.type == "float" and is_number and math.isfinite(value):
        checked = float(value)
    elif (spec.type == "bool" and isinstance(value, bool)) or (
        spec.type == "str" and isinstance(value, str)
    ):
        checked = value
    else:
        raise ArchitectureError(
            f"{where} must be a finite {spec.type}, got {value!r} ({type(value).__name__}); "
            f"the default is {spec.default!r}"
        )
    if is_number and spec.minimum is not None and value < spec.minimum:
        raise ArchitectureError(f"{where} is {value!r}, below the minimum {spec.minimum:g}")
    if is_number and spec.maximum is not None and value > spec.maximum:
        raise ArchitectureError(f"{where} is {value!r}, above the maximum {spec.maximum:g}")
    return checked


def resolve_kwargs(name: str, kwargs: Mapping[str, Any]) -> dict[str, ParamValue]:
    """The checked kwargs with the defaults filled in."""
    arch = _get(name)
    specs = {p.name: p for p in arch.params}
    unknown = sorted(set(kwargs) - set(specs))
    if unknown:
        raise ArchitectureError(
            f"{arch.name}: unknown kwargs {unknown}; it takes {sorted(specs) or 'none'}"
        )
    resolved = arch.defaults()
    for key, value in kwargs.items():
        resolved[key] = _check_value(arch, specs[key], value)
    return resolved


def build_model(name: str, kwargs: Mapping[str, Any]) -> nn.Module:
    """A new, randomly initialised model, on the current default device."""
    return _get(name).factory(**resolve_kwargs(name, kwargs))


def describe(arch: Architecture) -> dict[str, Any]:
    """The catalog entry (the contract's ``ArchitecturePublic``)."""
    return {
        "name": arch.name,
        "description": arch.description,
        "params": [asdict(p) for p in arch.params],
        "input_shape": list(arch.input_shape(arch.defaults())),
    }


def input_fits(expected: Sequence[int | None], sample_shape: Sequence[int]) -> bool:
    """Whether a sample of ``sample_shape`` fits ``expected`` (None matches any size)."""
    return len(expected) == len(sample_shape) and all(
        e is None or e == s for e, s in zip(expected, sample_shape, strict=True)
    )


def state_spec(name: str, kwargs: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``state_dict`` key -> (shape, dtype name such as ``"float32"``), the names numpy uses
    for the common dtypes. Built on the meta device: no memory, no initialisation cost; a
    factory that reads tensor values while building (torchvision's RegNet computes its widths
    with torch) is built on the CPU instead."""
    try:
        with torch.device("meta"):
            model = build_model(name, kwargs)
    except (NotImplementedError, RuntimeError):
        model = build_model(name, kwargs)
    return {
        key: (tuple(value.shape), str(value.dtype).removeprefix("torch."))
        for key, value in model.state_dict().items()
    }


def load_weights(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state, strict=True)`` for weights read from a safetensors file.

    Such a file keeps tensors only, not the module versions ``state_dict()`` records in its
    ``_metadata``; a module that reads its version when loading (torchvision's MNASNet raises
    without one) is given that of the model being loaded into: the weights were checked against
    this architecture's keys and shapes already."""
    metadata = getattr(state, "_metadata", None)
    if metadata is None:
        loaded = OrderedDict(state)
        loaded._metadata = model.state_dict()._metadata  # type: ignore[attr-defined]
        state = loaded
    model.load_state_dict(state, strict=True)


# --- Inspecting a model -------------------------------------------------------------------


def batchnorm_layers(model: nn.Module) -> list[dict[str, Any]]:
    """One entry per BatchNorm layer (the contract's ``BatchNormLayer``)."""
    return [
        {
            "name": name,
            "kind": type(module).__name__,
            "num_features": module.num_features,
            "momentum": module.momentum,
            "track_running_stats": module.track_running_stats,
        }
        for name, module in named_modules(model)
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
    ]


def parameter_count(model: nn.Module) -> int:
    """Number of parameter elements, shared parameters counted once."""
    return sum(p.numel() for p in model.parameters())


# NOTE [ Activation estimate ] in service/jobs/submission.py: a sample's free sizes (None in
# the input shape) are measured at this size; a convolutional model's activations per input
# element do not depend on it (its head, which does, is small).
ACTIVATION_PROBE_SIDE = 64


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(item) for item in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    return 0


def activation_footprint(model: nn.Module, input_shape: Sequence[int | None]) -> dict[str, float]:
    """The model's activation bytes per input element (the contract's ``ActivationFootprint``)
    from a batch of 2 in train mode (BatchNorm needs more than one sample) on the CPU. Each
    figure is the larger of two: what the allocator held at its peak (the profiler's memory
    events: a forward under no_grad; a forward and backward), and what the tensors alone
    come to (a hook on every leaf module: ``forward`` the input and twice the largest leaf's
    input and output; ``backward`` the input, every leaf's output and the largest leaf's
    input and output). The peak counts what tensors miss: an operator's workspace, a
    convolution's copies of its input and output in another layout. Moves the model's
    BatchNorm running statistics: use it on a model kept for nothing else, or last."""
    shape = [ACTIVATION_PROBE_SIDE if d is None else d for d in input_shape]
    x = torch.zeros(2, *shape)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    def forward_and_backward() -> None:
        loss = _float_sum(model(x))
        if loss is not None and loss.requires_grad:
            torch.autograd.backward(loss)

    leaves = LeafTensors(model)
    was_training = model.training
    try:
        model.train()
        forward_peak = _peak_allocated(forward)
        leaves.remove()
        backward_peak = _peak_allocated(forward_and_backward)
    finally:
        model.train(was_training)
        leaves.remove()
        for parameter in model.parameters():
            parameter.grad = None
    elements = x.numel()
    inputs = tensor_bytes(x)
    # Twice the largest leaf's: a residual block holds its input beside its branch's, and the
    # allocator's caching keeps a freed block for the next; with gradients, the largest leaf's
    # gradients join what autograd kept.
    return {
        "forward_bytes_per_element": (inputs + max(2 * leaves.largest, forward_peak)) / elements,
        "backward_bytes_per_element": (inputs + max(leaves.kept + leaves.largest, backward_peak))
        / elements,
    }


class LeafTensors:
    """The bytes of the tensors a model's leaf modules pass while hooked (from construction
    to :meth:`remove`): ``kept``, every leaf's output (what a backward keeps), and
    ``largest``, the largest leaf's input and output together."""

    def __init__(self, model: nn.Module) -> None:
        self.largest = 0
        self.kept = 0
        leaves = [m for m in model.modules() if next(m.children(), None) is None]
        self._handles = [leaf.register_forward_hook(self._measure) for leaf in leaves]

    def _measure(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        out = tensor_bytes(output)
        self.largest = max(self.largest, tensor_bytes(args) + out)
        self.kept += out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _float_sum(output: Any) -> torch.Tensor | None:
    """A scalar that depends on every floating-point tensor in a model's output."""
    if isinstance(output, torch.Tensor):
        return output.float().sum() if output.is_floating_point() else None
    if isinstance(output, dict):
        parts = list(output.values())
    elif isinstance(output, list | tuple):
        parts = list(output)
    else:
        return None
    sums = [s for s in (_float_sum(part) for part in parts) if s is not None]
    return torch.stack(sums).sum() if sums else None


# Kineto's log level past its errors: nothing printed.
_KINETO_QUIET = "6"


def _peak_allocated(run: Callable[[], None]) -> int:
    """The most bytes the CPU allocator held at once while ``run`` ran, beyond what it held
    before: the running sum of the profiler's memory events (allocations positive, frees
    negative), in order. 0 where the profiler records none. The profiler's own log lines
    (start, stop) stay out of the process's stderr."""
    os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_QUIET)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU
    )
    held = peak = 0
    for _, change in events:
        held += change
        peak = max(peak, held)
    return peak
