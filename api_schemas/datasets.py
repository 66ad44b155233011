"""Datasets: an uploaded array file with ``x`` and optional ``y``."""

from typing import Annotated, Final, Literal, Self

from pydantic import BaseModel, Field, model_validator

from api_schemas.common import RequestModel, ResourceId, Sha256Hex, UtcDatetime

__all__ = [
    "MAX_UPLOAD_PARTS",
    "ArrayFormat",
    "DatasetPublic",
    "LabelKind",
    "SampleDtype",
    "UploadComplete",
    "UploadCreate",
    "UploadPart",
    "UploadPublic",
]

# Parts of one resumable upload are numbered 1..MAX_UPLOAD_PARTS.
MAX_UPLOAD_PARTS: Final = 10_000

ArrayFormat = Literal["npz", "safetensors"]
SampleDtype = Literal["float32", "uint8"]
# "class": integer labels 0..num_classes-1; "target": float regression targets.
LabelKind = Literal["class", "target"]


class DatasetPublic(BaseModel):
    """A stored dataset and the facts found when it was validated on upload."""

    id: ResourceId
    name: str = Field(min_length=1, max_length=256)
    num_samples: int = Field(ge=1)
    sample_shape: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)
    dtype: SampleDtype
    has_labels: bool
    label_kind: LabelKind | None = None
    num_classes: int | None = Field(default=None, ge=1)
    sha256: Sha256Hex
    size_bytes: int = Field(ge=0)
    format: ArrayFormat
    created_at: UtcDatetime

    @model_validator(mode="after")
    def _labels_agree(self) -> Self:
        if self.has_labels != (self.label_kind is not None):
            raise ValueError(
                f"has_labels={self.has_labels} but label_kind={self.label_kind!r}: "
                "label_kind is set exactly when there are labels"
            )
        if (self.label_kind == "class") != (self.num_classes is not None):
            raise ValueError(
                f"label_kind={self.label_kind!r} but num_classes={self.num_classes}: "
                "num_classes is set exactly for class labels"
            )
        return self


class UploadCreate(RequestModel):
    """Starts a resumable upload of one dataset file, sent in numbered parts. With
    ``size_bytes`` (the whole file's), a file over the limit is refused now, and completing
    checks that every byte arrived."""

    name: str | None = Field(default=None, min_length=1, max_length=256)
    size_bytes: int | None = Field(default=None, ge=1)


class UploadPart(BaseModel):
    """A part received: its place in the file and its bytes' digest (compare it with the
    part you sent to know whether to send it again)."""

    number: int = Field(ge=1, le=MAX_UPLOAD_PARTS)
    sha256: Sha256Hex
    size_bytes: int = Field(ge=0)


class UploadPublic(BaseModel):
    """A resumable upload: the parts received so far, in order. Send the missing ones with
    ``PUT /v1/uploads/{id}/parts/{number}`` (again, after a dropped connection), then
    ``POST /v1/uploads/{id}:complete``, which joins parts 1..n into the dataset file."""

    id: ResourceId
    name: str | None = None
    expected_bytes: int | None = Field(default=None, ge=1)  # the file's, when declared
    parts: list[UploadPart]
    size_bytes: int = Field(ge=0)  # of the parts received
    max_part_bytes: int = Field(ge=1)
    created_at: UtcDatetime
    expires_at: UtcDatetime


class UploadComplete(RequestModel):
    """Ends an upload: its parts, joined in order, become a dataset named ``name`` (default:
    the upload's name)."""

    name: str | None = Field(default=None, min_length=1, max_length=256)
    sha256: Sha256Hex | None = Field(
        default=None,
        description=(
            "The whole file's sha256, if the client knows it: an S3 store then writes the joined "
            "file straight to its content key; parts that join into other bytes are refused "
            "(422) and the upload stays."
        ),
    )
