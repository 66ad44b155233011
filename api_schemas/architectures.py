"""What the API tells about a registered architecture (a named model factory)."""

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
