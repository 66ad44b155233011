"""What the API tells about a registered architecture (a named model factory)."""

import re
from typing import Annotated, Final, Literal

from pydantic import BaseModel, Field, StringConstraints

__all__ = [
    "ARCHITECTURE_NAME_PATTERN",
    "ArchitectureKwargs",
    "ArchitectureName",
    "ArchitectureParam",
    "ArchitecturePublic",
    "InputShape",
    "KwargValue",
    "ParamType",
    "architecture_family",
]

# Loose enough for torchvision names (`resnet18`, `vit_b_16`) and entry-point names.
ARCHITECTURE_NAME_PATTERN: Final = r"^[A-Za-z0-9_.-]{1,128}$"
ArchitectureName = Annotated[str, StringConstraints(pattern=ARCHITECTURE_NAME_PATTERN)]

ParamType = Literal["int", "float", "bool", "str"]

# Factories take scalars only; nested structures would need a schema per architecture. In a
# union pydantic keeps the exact JSON type: `1` stays int, `1.0` float, `true` bool.
KwargValue = bool | int | float | str | None
ArchitectureKwargs = Annotated[dict[str, KwargValue], Field(max_length=64)]

# Per sample, e.g. [1, 28, 28]; None where the architecture takes any size.
InputShape = list[Annotated[int, Field(ge=1)] | None]


class ArchitectureParam(BaseModel):
    """One keyword argument of an architecture's factory."""

    name: str
    type: ParamType
    default: KwargValue
    description: str = ""
    minimum: float | None = None
    maximum: float | None = None


class ArchitecturePublic(BaseModel):
    """A registered architecture; ``input_shape`` is the one for the default kwargs."""

    name: ArchitectureName
    description: str = ""
    params: list[ArchitectureParam]
    input_shape: InputShape


_FAMILY: Final = re.compile(r"((?:tf|tv|gluon|legacy|ig|ssl|swsl)_)?([a-z]+?)(v[0-9]+)?(?![a-z])")


def architecture_family(name: str) -> str:
    """The family of a zoo name, for listings: the source and the model name's leading letters
    with a version suffix and a weight-port prefix (``timm.resnet50d`` -> ``timm.resnet``,
    ``torchvision.mobilenet_v3_large`` -> ``torchvision.mobilenet``,
    ``timm.mobilenetv3_small_050`` -> ``timm.mobilenetv3``, ``timm.tf_efficientnet_b0`` ->
    ``timm.tf_efficientnet``). A name without a source (a built-in) is its own family."""
    source, dot, model = name.partition(".")
    if not dot:
        return name
    found = _FAMILY.match(model.lower())
    return f"{source}.{''.join(g or '' for g in found.groups()) if found else model}"
