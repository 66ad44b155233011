"""What an architecture is: a named model factory and its checked keyword arguments.

Packages that offer architectures through the ``bnadapt.architectures`` entry-point group
build :class:`Architecture` values (also importable from :mod:`workers.models.architectures`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

__all__ = [
    "MAX_CLASSES",
    "Architecture",
    "InputShape",
    "ParamSpec",
    "ParamType",
    "ParamValue",
    "int_param",
]

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


MAX_CLASSES = 100_000


def int_param(name: str, default: int, description: str, maximum: int) -> ParamSpec:
    """A whole-number parameter from 1 to ``maximum``."""
    return ParamSpec(name, "int", default, description, minimum=1, maximum=maximum)
