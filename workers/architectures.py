"""The architecture registry: named model factories with checked kwargs.

Sources, in order of precedence (a later source never replaces an earlier name):
1. the built-ins :data:`BUILTINS` (``digits_cnn``, ``resnet``, ``mlp``);
2. entry points of the group ``bnadapt.architectures``: each loads an :class:`Architecture`
   or a zero-argument callable returning one;
3. torchvision's classification models as ``torchvision.<name>``, when torchvision imports.

Module names used here and across the workers are those of ``state_dict``: a checkpoint
wrapper adds nothing to them (see :func:`named_modules`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import itertools
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn

from workers.checkpoint import CheckpointWrapper
from workers.errors import ArchitectureError

__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "Architecture",
    "ConvBlock",
    "MLPBlock",
    "ParamSpec",
    "ResidualBlock",
    "batchnorm_layers",
    "build_model",
    "describe",
    "digits_cnn",
    "input_fits",
    "mlp",
    "named_modules",
    "parameter_count",
    "registry",
    "resnet",
    "resolve_kwargs",
    "state_spec",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "bnadapt.architectures"

ParamType = Literal["int", "float", "bool", "str"]
ParamValue = int | float | bool | str
InputShape = tuple[int | None, ...]  # per sample; None: any size


@dataclass(frozen=True)
class ParamSpec:
    """One keyword argument of a factory."""

    name: str
    type: ParamType
    default: ParamValue
    description: str
    minimum: float | None = None
    maximum: float | None = None


@dataclass(frozen=True)
class Architecture:
    """A named factory ``(**kwargs) -> nn.Module`` and what the service needs to know of it.

    ``input_shape`` maps the full kwargs (defaults filled in) to the shape of one sample.
    ``block_types`` are the modules the ``blocks`` checkpoint preset wraps.
    """

    name: str
    description: str
    factory: Callable[..., nn.Module]
    params: tuple[ParamSpec, ...]
    input_shape: Callable[[Mapping[str, Any]], InputShape]
    block_types: tuple[type[nn.Module], ...] = ()

    def defaults(self) -> dict[str, ParamValue]:
        return {p.name: p.default for p in self.params}


# --- Built-ins ----------------------------------------------------------------------------


class ConvBlock(nn.Module):
    """conv3x3 -> BatchNorm2d -> ReLU, same spatial size."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))  # (B, C_out, H, W)


def digits_cnn(width: int = 16, num_classes: int = 10) -> nn.Module:
    """For 1x8x8 grey images (sklearn's load_digits scaled to [0, 1])."""
    return nn.Sequential(
        OrderedDict(
            block1=ConvBlock(1, width),  # (B, W, 8, 8)
            block2=ConvBlock(width, 2 * width),  # (B, 2W, 8, 8)
            pool=nn.MaxPool2d(2),  # (B, 2W, 4, 4)
            flatten=nn.Flatten(),  # (B, 2W*16)
            head=nn.Linear(2 * width * 4 * 4, num_classes),  # (B, num_classes)
        )
    )


class ResidualBlock(nn.Module):
    """Two conv3x3-BN pairs plus a shortcut (1x1 conv + BN where the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C_in, H, W)
        h = torch.relu(self.bn1(self.conv1(x)))  # (B, C_out, H/stride, W/stride)
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


def resnet(
    in_channels: int = 3, num_classes: int = 10, depth: int = 4, width: int = 32
) -> nn.Module:
    """Stem, ``depth`` residual blocks in three stages (width, 2*width, 4*width channels; each
    later stage halves the resolution), global average pool, linear head. Any input size."""
    blocks: list[nn.Module] = []
    channels = width
    for i in range(depth):
        out_channels = width * 2 ** (i * 3 // depth)
        blocks.append(ResidualBlock(channels, out_channels, 2 if out_channels > channels else 1))
        channels = out_channels
    return nn.Sequential(
        OrderedDict(
            stem=ConvBlock(in_channels, width),  # (B, W, H, W)
            blocks=nn.Sequential(*blocks),  # (B, C, H', W')
            pool=nn.AdaptiveAvgPool2d(1),  # (B, C, 1, 1)
            flatten=nn.Flatten(),  # (B, C)
            head=nn.Linear(channels, num_classes),  # (B, num_classes)
        )
    )


class MLPBlock(nn.Module):
    """Linear -> BatchNorm1d -> ReLU."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bn = nn.BatchNorm1d(out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, F_in)
        return torch.relu(self.bn(self.linear(x)))  # (B, F_out)


def mlp(
    in_features: int = 64, hidden: int = 64, depth: int = 2, num_classes: int = 10
) -> nn.Module:
    sizes = [in_features] + [hidden] * depth
    return nn.Sequential(
        OrderedDict(
            blocks=nn.Sequential(*(MLPBlock(a, b) for a, b in itertools.pairwise(sizes))),
            head=nn.Linear(hidden, num_classes),  # (B, num_classes)
        )
    )


_MAX_CLASSES = 100_000


def _int(name: str, default: int, description: str, maximum: int) -> ParamSpec:
    return ParamSpec(name, "int", default, description, minimum=1, maximum=maximum)


BUILTINS: tuple[Architecture, ...] = (
    Architecture(
        name="digits_cnn",
        description="Two conv-BN-ReLU blocks, a 2x2 max pool and a linear head, for 1x8x8 "
        "images such as sklearn's load_digits scaled to [0, 1].",
        factory=digits_cnn,
        params=(
            _int("width", 16, "Channels of the first block; the second has twice as many.", 1024),
            _int("num_classes", 10, "Number of output classes.", _MAX_CLASSES),
        ),
        input_shape=lambda kw: (1, 8, 8),
        block_types=(ConvBlock,),
    ),
    Architecture(
        name="resnet",
        description="ResNet-style network with BatchNorm2d: a conv stem, `depth` residual "
        "blocks in three stages (width, 2x, 4x channels), global average pooling and a linear "
        "head. Fully convolutional: any image size.",
        factory=resnet,
        params=(
            _int("in_channels", 3, "Channels of the input images.", 64),
            _int("num_classes", 10, "Number of output classes.", _MAX_CLASSES),
            _int("depth", 4, "Number of residual blocks.", 64),
            _int("width", 32, "Channels of the first stage.", 512),
        ),
        input_shape=lambda kw: (int(kw["in_channels"]), None, None),
        block_types=(ResidualBlock,),
    ),
    Architecture(
        name="mlp",
        description="Multi-layer perceptron: `depth` Linear-BatchNorm1d-ReLU blocks and a "
        "linear head, for flat feature vectors.",
        factory=mlp,
        params=(
            _int("in_features", 64, "Features per sample.", 1_000_000),
            _int("hidden", 64, "Width of the hidden layers.", 65_536),
            _int("depth", 2, "Number of hidden blocks.", 64),
            _int("num_classes", 10, "Number of outputs.", _MAX_CLASSES),
        ),
        input_shape=lambda kw: (int(kw["in_features"]),),
        block_types=(MLPBlock,),
    ),
)


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


def _torchvision_block_types(models: Any, name: str) -> tuple[type[nn.Module], ...]:
    if name.startswith(("resnet", "resnext", "wide_resnet")):
        return (models.resnet.BasicBlock, models.resnet.Bottleneck)
    return ()


def _from_torchvision() -> Iterator[Architecture]:
    try:
        torchvision = importlib.import_module("torchvision")
    except Exception:  # noqa: BLE001 - optional: absent or broken (ABI mismatch) alike
        return
    models = torchvision.models
    for name in models.list_models(module=models):
        yield Architecture(
            name=f"torchvision.{name}",
            description=f"torchvision.models.{name}, randomly initialised (no pretrained "
            "weights are downloaded; upload weights instead).",
            factory=functools.partial(models.get_model, name, weights=None),
            params=(_int("num_classes", 1000, "Number of output classes.", _MAX_CLASSES),),
            input_shape=lambda kw: (3, None, None),
            block_types=_torchvision_block_types(models, name),
        )


@functools.lru_cache(maxsize=1)
def registry() -> Mapping[str, Architecture]:
    """Every known architecture by name; built once per process."""
    found: dict[str, Architecture] = {}
    for source in (iter(BUILTINS), _from_entry_points(), _from_torchvision()):
        for arch in source:
            if arch.name in found:
                logger.warning("ignoring a second architecture named %r", arch.name)
            else:
                found[arch.name] = arch
    return found


def _get(name: str) -> Architecture:
    known = registry()
    if name not in known:
        raise ArchitectureError(
            f"unknown architecture {name!r}; known: {', '.join(sorted(known))}. Pick one of "
            f"these, or install a package that registers it under {ENTRY_POINT_GROUP!r}"
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
    for the common dtypes. Built on the meta device: no memory, no initialisation cost."""
    with torch.device("meta"):
        model = build_model(name, kwargs)
    return {
        key: (tuple(value.shape), str(value.dtype).removeprefix("torch."))
        for key, value in model.state_dict().items()
    }


# --- Inspecting a model -------------------------------------------------------------------


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Like ``model.named_modules()``, but a checkpoint wrapper stands for the module it
    wraps, under that module's name: names are those of ``state_dict`` whether or not the
    model is wrapped."""
    return _named_modules(model, "", set())


def _named_modules(
    module: nn.Module, name: str, seen: set[nn.Module]
) -> Iterator[tuple[str, nn.Module]]:
    while isinstance(module, CheckpointWrapper):
        module = module.wrapped_module
    if module in seen:  # shared modules are listed once, as torch does
        return
    seen.add(module)
    yield name, module
    for child_name, child in module.named_children():
        yield from _named_modules(child, f"{name}.{child_name}" if name else child_name, seen)


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
