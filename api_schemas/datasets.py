"""Datasets: an uploaded array file with ``x`` and optional ``y``, or a tar of images
(docs/datasets.md), and the preprocessing spec that turns images into model inputs."""

import math
from typing import Annotated, Final, Literal, Self

from pydantic import BaseModel, Field, model_validator

from api_schemas.common import RequestModel, ResourceId, Sha256Hex, UtcDatetime

__all__ = [
    "MAX_IMAGE_SIDE",
    "MAX_UPLOAD_PARTS",
    "ArrayFormat",
    "DatasetPublic",
    "ImageSize",
    "Interpolation",
    "LabelKind",
    "Preprocessing",
    "SampleDtype",
    "UploadComplete",
    "UploadCreate",
    "UploadPart",
    "UploadPublic",
]

# Parts of one resumable upload are numbered 1..MAX_UPLOAD_PARTS.
MAX_UPLOAD_PARTS: Final = 10_000

# "tar": WebDataset-style shards of images (docs/datasets.md), one or several joined end to end.
ArrayFormat = Literal["npz", "safetensors", "tar"]
SampleDtype = Literal["float32", "uint8"]
# "class": integer labels 0..num_classes-1; "target": float regression targets.
LabelKind = Literal["class", "target"]


MAX_IMAGE_SIDE: Final = 16384
# [height, width] in pixels.
ImageSize = Annotated[
    list[Annotated[int, Field(ge=1, le=MAX_IMAGE_SIDE)]],
    Field(
        min_length=2,
        max_length=2,
        description=f"[height, width] in pixels, each 1 to {MAX_IMAGE_SIDE}.",
    ),
]
# A mean or std of a channel: pixels are 0..255 (0..1 scaled), so 255 is as far as either goes.
MAX_PIXEL_VALUE: Final = 255.0
_CHANNELS: Final = {"rgb": 3, "bgr": 3, "gray": 1}
# How a resize samples: Pillow's filters, which widen with the downscale factor (antialiased,
# as torchvision's `antialias=True`); nearest takes one source pixel.
Interpolation = Literal["nearest", "bilinear", "bicubic", "lanczos"]


class Preprocessing(RequestModel):
    """How a uint8 image becomes a model input, in this order: decoded in ``channels`` order
    (``gray``: one channel); resized with ``interpolation`` to ``resize`` [height, width], or
    its shorter side to ``resize_shorter`` (aspect kept, as torchvision's ``Resize(int)``), or,
    with ``crop_pct`` (timm), its shorter side to ``floor(crop / crop_pct)``; cropped to
    ``center_crop`` [height, width] around its centre; laid out channels first (C, H, W);
    divided by 255 to [0, 1] when ``scale``; then ``(value - mean) / std`` per channel. Given
    with a tar of images or a uint8 array dataset of shape (N, C, H, W) when it is registered,
    kept with the dataset and reported by every job on it."""

    resize: ImageSize | None = None
    resize_shorter: Annotated[int, Field(ge=1, le=MAX_IMAGE_SIDE)] | None = None
    interpolation: Interpolation = "bilinear"
    # timm's crop fraction: the image's shorter side goes to floor(crop / crop_pct), then the
    # square center_crop is taken (0.875: 224 of 256).
    crop_pct: Annotated[float, Field(gt=0, le=1)] | None = None
    center_crop: ImageSize | None = None
    scale: bool = True
    mean: list[Annotated[float, Field(ge=-MAX_PIXEL_VALUE, le=MAX_PIXEL_VALUE)]] | None = Field(
        default=None,
        min_length=1,
        max_length=3,
        description=f"Per channel, subtracted after scaling; each within +-{MAX_PIXEL_VALUE:g} "
        "(pixels are 0 to 255, or 0 to 1 when scaled).",
    )
    std: list[Annotated[float, Field(gt=0, le=MAX_PIXEL_VALUE)]] | None = Field(
        default=None,
        min_length=1,
        max_length=3,
        description=f"Per channel, divided by after the mean; each above 0, at most "
        f"{MAX_PIXEL_VALUE:g}.",
    )
    channels: Literal["rgb", "bgr", "gray"] = "rgb"

    @property
    def num_channels(self) -> int:
        return _CHANNELS[self.channels]

    @property
    def shorter_side(self) -> int | None:
        """The size the shorter side is resized to (``resize_shorter``, or from ``crop_pct``)."""
        if self.crop_pct is not None and self.center_crop is not None:
            return math.floor(self.center_crop[0] / self.crop_pct)
        return self.resize_shorter

    @property
    def fixed_size(self) -> bool:
        """Whether every image, whatever its size, comes out with one shape."""
        return self.resize is not None or (
            self.center_crop is not None and self.shorter_side is not None
        )

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """[height, width] after the resize step, as torchvision computes it for a shorter
        side (the longer one truncated, not rounded)."""
        if self.resize is not None:
            return self.resize[0], self.resize[1]
        shorter = self.shorter_side
        if shorter is None:
            return height, width
        if width <= height:
            return int(shorter * height / width), shorter
        return shorter, int(shorter * width / height)

    def output_shape(self, height: int, width: int) -> list[int]:
        """The (C, H, W) of a preprocessed image of ``height`` x ``width`` pixels."""
        height, width = self.resized_size(height, width)
        if self.center_crop is not None:
            height, width = self.center_crop
        return [self.num_channels, height, width]

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.mean is None) != (self.std is None):
            raise ValueError("give mean and std together (one value per channel), or neither")
        for name, values in (("mean", self.mean), ("std", self.std)):
            if values is not None and len(values) != self.num_channels:
                raise ValueError(
                    f"{name} has {len(values)} values but channels {self.channels!r} gives "
                    f"{self.num_channels}: give one value per channel"
                )
        crop, resize = self.center_crop, self.resize
        if crop and resize and any(c > r for c, r in zip(crop, resize, strict=True)):
            raise ValueError(
                f"center_crop {crop} is larger than resize {resize}: crop at most the resized size"
            )
        given = [
            n for n in ("resize", "resize_shorter", "crop_pct") if getattr(self, n) is not None
        ]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} each set the resized size; give one of them")
        if self.crop_pct is not None and (crop is None or crop[0] != crop[1]):
            raise ValueError(
                f"crop_pct {self.crop_pct} resizes for a square center_crop, but center_crop is "
                f"{crop}; give a square center_crop, or resize and center_crop instead"
            )
        shorter = self.resize_shorter
        if crop and shorter is not None and max(crop) > shorter:
            raise ValueError(
                f"center_crop {crop} is larger than resize_shorter {shorter}: crop at most the "
                "resized shorter side"
            )
        return self


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
    # Set for tars of images (always) and for uint8 arrays registered with one; sample_shape
    # is then the shape after preprocessing.
    preprocessing: Preprocessing | None = None
    # [height, width] of the images as stored, when they all have one size (tars) or of a
    # uint8 (N, C, H, W) array: what a job's own preprocessing spec starts from.
    image_size: ImageSize | None = None
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
    transfer_url: str | None = Field(
        default=None,
        description=(
            "Where to send this upload's parts and its completion, when the operator runs API "
            "processes of their own for upload bytes: the same paths under this base URL, with "
            "the same key. Null: to this API."
        ),
    )


class UploadComplete(RequestModel):
    """Ends an upload: its parts, joined in order, become a dataset named ``name`` (default:
    the upload's name), preprocessed by ``preprocessing`` (default: the upload's)."""

    name: str | None = Field(default=None, min_length=1, max_length=256)
    sha256: Sha256Hex | None = Field(
        default=None,
        description=(
            "The whole file's sha256, if the client knows it: an S3 store then writes the joined "
            "file straight to its content key; parts that join into other bytes are refused "
            "(422) and the upload stays."
        ),
    )
    preprocessing: Preprocessing | None = None
