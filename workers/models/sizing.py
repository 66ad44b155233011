"""A model's size before it is built, and the limits an inspection holds it to.

NOTE [ Bounded builds ]
The model inspector (workers/processes/inspector.py) builds whatever a tenant registers, and
the kwargs allow models far past any machine (a built-in ``mlp`` of 3e11 parameters, a ViT at
4096 x 4096). So before anything is allocated the model is built on torch's meta device
(shapes, no memory) and measured: its parameters, its ``state_dict``'s bytes, and the tensors
of the inspection's activation probe (a train-mode batch of two: the leaf modules' outputs
and the largest leaf's input and output, from a forward on meta inputs, the tensor part of
``activation_footprint``). It is refused, with a 422 that gives the numbers and the largest
value of each kwarg the caller raised that would fit, when
- its weights are past ``BNADAPT_MAX_WEIGHTS_BYTES``, the most a weights file may hold (its
  initial weights are stored as one; uploaded ones could not be larger), or
- what building and checking it needs is past what one inspection may allocate
  (:class:`BuildLimits`): the weights held :data:`WEIGHT_COPIES` times at once (the model
  and its serialized copy while it is stored; the model, its gradients and the probe's
  tensors while the probe runs) plus the probe's tensors.
A factory that cannot build on the meta device (one that reads tensor values while
building) is not measured; it and everything the estimate misses (an operator's workspace,
an entry point's factory that allocates on the CPU whatever the default device) meet the
inspection process's own cap instead: its allocations fail past it (``RLIMIT_DATA``) and the
inspector answers that the build ran out of memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from workers.errors import ArchitectureError
from workers.models.architectures import (
    ACTIVATION_PROBE_SIDE,
    LeafTensors,
    build_model,
    registry,
    resolve_kwargs,
    tensor_bytes,
)
from workers.models.spec import ParamValue

__all__ = [
    "PROBE_BATCH",
    "WEIGHT_COPIES",
    "BuildLimits",
    "ModelSize",
    "check_size",
    "format_bytes",
    "measure",
]

# NOTE [ Bounded builds ]: the copies of the weights an inspection holds at once.
WEIGHT_COPIES: Final = 3
# The activation probe's batch (activation_footprint in workers/models/architectures.py).
PROBE_BATCH: Final = 2
# Meta builds the search for what fits may make (each a few milliseconds for the built-ins,
# up to a tenth of a second for the zoo's larger models).
_HINT_BUILDS: Final = 96
_FLOAT32_BYTES: Final = 4


@dataclass(frozen=True)
class ModelSize:
    """A model as measured on the meta device."""

    parameter_count: int
    weights_bytes: int  # the state_dict's tensors: parameters and buffers
    probe_bytes: int | None  # None where a forward on meta inputs fails

    def needed_bytes(self) -> int:
        """What building and checking it allocates (NOTE [ Bounded builds ])."""
        return WEIGHT_COPIES * self.weights_bytes + (self.probe_bytes or 0)


@dataclass(frozen=True)
class BuildLimits:
    """What one inspection may build: ``max_weights_bytes`` of weights, ``memory_bytes`` of
    allocations beyond what its process holds idle."""

    max_weights_bytes: int
    memory_bytes: int

    def __post_init__(self) -> None:
        if self.max_weights_bytes < 1 or self.memory_bytes < 1:
            raise ValueError(
                f"build limits must be positive; got max_weights_bytes={self.max_weights_bytes}"
                f", memory_bytes={self.memory_bytes}"
            )

    def fits(self, size: ModelSize) -> bool:
        return (
            size.weights_bytes <= self.max_weights_bytes
            and size.needed_bytes() <= self.memory_bytes
        )


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if num_bytes < 1024 or unit == "PiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _probe_bytes(model: nn.Module, input_shape: Sequence[int | None], side: int) -> int | None:
    """The probe's tensors from a train-mode forward of a meta model on meta inputs: the
    input, every leaf's output (what a backward keeps) and the largest leaf's input and output
    (``backward_bytes_per_element`` of ``activation_footprint``, its tensor part). None where
    the forward fails on meta tensors."""
    shape = [side if d is None else d for d in input_shape]
    x = torch.zeros(PROBE_BATCH, *shape, device="meta")  # (2, *sample)
    leaves = LeafTensors(model)
    try:
        model.train()
        with torch.no_grad():
            model(x)
    except Exception:  # noqa: BLE001 - any operator without a meta kernel: not measured
        return None
    finally:
        leaves.remove()
    return tensor_bytes(x) + leaves.kept + leaves.largest


def measure(name: str, kwargs: Mapping[str, Any], probe: bool = True) -> ModelSize | None:
    """``name(**kwargs)`` measured on the meta device, nothing allocated (without ``probe``,
    its weights only); None for a factory that cannot build there. Raises
    ``ArchitectureError`` for a wrong name or kwargs."""
    resolved = resolve_kwargs(name, kwargs)
    try:
        with torch.device("meta"):
            model = build_model(name, resolved)
    except (NotImplementedError, RuntimeError):
        return None
    state = model.state_dict()
    input_shape = registry()[name].input_shape(resolved)
    return ModelSize(
        parameter_count=sum(p.numel() for p in model.parameters()),
        weights_bytes=sum(t.numel() * t.element_size() for t in state.values()),
        probe_bytes=_probe_bytes(model, input_shape, ACTIVATION_PROBE_SIDE) if probe else None,
    )


class _FitSearch:
    """The largest value of each int kwarg, the others as given, that fits: a bisection of
    meta builds, at most :data:`_HINT_BUILDS` in all."""

    def __init__(
        self,
        name: str,
        kwargs: dict[str, ParamValue],
        fits: Callable[[ModelSize], bool],
        probe: bool,
    ) -> None:
        self.name = name
        self.kwargs = kwargs
        self.fits = fits
        self.probe = probe
        self.builds = 0
        self._seen: dict[tuple[str, int], bool | None] = {}

    def _fits_at(self, param: str, value: int) -> bool | None:
        """None when it cannot say: out of builds, or not measurable on meta."""
        if (param, value) not in self._seen:
            if self.builds >= _HINT_BUILDS:
                return None
            self.builds += 1
            try:
                size = measure(self.name, {**self.kwargs, param: value}, self.probe)
            except ArchitectureError:
                size = None
            self._seen[param, value] = None if size is None else self.fits(size)
        return self._seen[param, value]

    def largest(self, param: str, low: int, high: int) -> int | None:
        """The largest value in [low, high] that fits, assuming the size grows with it."""
        if not self._fits_at(param, low):
            return None
        while low < high:
            middle = (low + high + 1) // 2
            found = self._fits_at(param, middle)
            if found is None:
                return low
            if found:
                low = middle
            else:
                high = middle - 1
        return low


def _what_fits(
    name: str, given: Mapping[str, Any], fits: Callable[[ModelSize], bool], probe: bool
) -> list[str]:
    """``["hidden <= 523", ...]``: for each int kwarg the caller set above its minimum (every
    such kwarg when the caller set none), the largest value that fits with the others as
    given."""
    arch = registry()[name]
    resolved = resolve_kwargs(name, given)
    search = _FitSearch(name, resolved, fits, probe)
    hints = []
    for spec in arch.params:
        value = resolved[spec.name]
        if spec.type != "int" or (given and spec.name not in given) or isinstance(value, bool):
            continue
        low = int(spec.minimum) if spec.minimum is not None else 1
        if not isinstance(value, int) or value <= low:
            continue
        best = search.largest(spec.name, low, value - 1)
        if best is not None:
            hints.append(f"{spec.name} <= {best}")
    return hints


def _advice(
    name: str, given: Mapping[str, Any], fits: Callable[[ModelSize], bool], probe: bool
) -> str:
    hints = _what_fits(name, given, fits, probe)
    if hints:
        return "use " + " or ".join(hints) + " (each with the other kwargs as given)"
    return "no one kwarg brings it within the limit: lower several, or start from the defaults"


def check_size(name: str, kwargs: Mapping[str, Any], limits: BuildLimits) -> ModelSize | None:
    """Raises ``ArchitectureError`` (a 422) when ``name(**kwargs)`` is past ``limits``
    (NOTE [ Bounded builds ]), saying the numbers and what fits; the measured size, or None
    for a model the meta device cannot build (the inspection's own cap bounds it then)."""
    size = measure(name, kwargs)
    if size is None or limits.fits(size):
        return size
    shown = dict(kwargs) or "its defaults"
    if size.weights_bytes > limits.max_weights_bytes:
        at_most = limits.max_weights_bytes // _FLOAT32_BYTES
        advice = _advice(
            name, kwargs, lambda s: s.weights_bytes <= limits.max_weights_bytes, probe=False
        )
        raise ArchitectureError(
            f"{name} with {shown} has {size.parameter_count:,} parameters, "
            f"{format_bytes(size.weights_bytes)} of weights, past this service's limit of "
            f"{format_bytes(limits.max_weights_bytes)} (BNADAPT_MAX_WEIGHTS_BYTES): at most "
            f"{at_most:,} float32 parameters. To fit, {advice}"
        )
    probe = size.probe_bytes or 0
    advice = _advice(name, kwargs, limits.fits, probe=True)
    raise ArchitectureError(
        f"building and checking {name} with {shown} needs about "
        f"{format_bytes(size.needed_bytes())} ({size.parameter_count:,} parameters: "
        f"{format_bytes(size.weights_bytes)} of weights held {WEIGHT_COPIES} times, and "
        f"{format_bytes(probe)} of activations for a probe batch of {PROBE_BATCH}), past the "
        f"{format_bytes(limits.memory_bytes)} one inspection may use "
        f"(BNADAPT_INSPECT_MEMORY_BYTES). To fit, {advice}"
    )
