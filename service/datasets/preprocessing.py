"""What a preprocessing spec makes of a dataset: the sample shape after it, and the dataset as
a job with its own spec sees it. Registration (service/datasets/registration.py) and job
submission (service/jobs/submission.py) both check a spec against the data here."""

from __future__ import annotations

from typing import Literal

from api_schemas import DatasetPublic, ModelPublic, Preprocessing
from service.errors import InvalidRequestError

__all__ = ["model_spec", "preprocessed_shape", "with_job_spec"]


def model_spec(
    requested: Preprocessing | Literal["model"] | None, model: ModelPublic
) -> Preprocessing | None:
    """A job's spec with ``"model"`` replaced by the model's own evaluation transform (found
    when the model was registered); 422 when its architecture has none."""
    if requested != "model":
        return requested
    if model.preprocessing is None:
        raise InvalidRequestError(
            f'"preprocessing": "model" asks for the evaluation transform of model {model.id}, '
            f"but its architecture {model.architecture} has none (torchvision and timm models "
            "have one); give the spec itself, e.g. "
            '{"resize_shorter": 256, "center_crop": [224, 224], "interpolation": "bilinear"}',
        )
    return model.preprocessing


def with_job_spec(dataset: DatasetPublic, spec: Preprocessing | None) -> DatasetPublic:
    """The dataset as a job with its own preprocessing ``spec`` sees it: that spec, and the
    sample shape after it; 422 when the spec cannot apply to the dataset."""
    if spec is None:
        return dataset
    if dataset.image_size is None or (dataset.format != "tar" and dataset.dtype != "uint8"):
        if dataset.format != "tar":
            raise InvalidRequestError(
                f"dataset {dataset.id} holds no images (uint8 arrays of shape (N, C, H, W)); "
                "send the job without a preprocessing spec",
            )
        if not spec.fixed_size:
            raise InvalidRequestError(
                f"dataset {dataset.id} holds images of several sizes; a job's preprocessing "
                'spec needs a "resize": [height, width], or a "resize_shorter" (or "crop_pct") '
                'with a "center_crop"',
            )
        return dataset.model_copy(
            update={"preprocessing": spec, "sample_shape": spec.output_shape(1, 1)}
        )
    height, width = dataset.image_size
    if dataset.format == "tar":
        crop = spec.center_crop
        if crop is not None and _unresized(spec) and (crop[0] > height or crop[1] > width):
            raise InvalidRequestError(
                f"center_crop {crop} is larger than the images of dataset {dataset.id} ({height} "
                f"x {width} pixels); crop less, or resize first",
            )
        shape = spec.output_shape(height, width)
    else:
        # The array's own channels: the registered spec's, or the first dimension of x's samples.
        spec_before = dataset.preprocessing
        channels = dataset.sample_shape[0] if spec_before is None else spec_before.num_channels
        shape = preprocessed_shape("uint8", [channels, height, width], spec)
    return dataset.model_copy(update={"preprocessing": spec, "sample_shape": shape})


def _unresized(spec: Preprocessing) -> bool:
    """Whether the crop is taken from the images as stored (a resize makes room for it)."""
    return spec.resize is None and spec.shorter_side is None


def preprocessed_shape(dtype: str, shape: list[int], spec: Preprocessing) -> list[int]:
    """A uint8 array's sample shape after ``spec``; 422 when the spec cannot apply to it."""
    if dtype != "uint8" or len(shape) != 3 or shape[0] != spec.num_channels:
        raise InvalidRequestError(
            f"a preprocessing spec applies to uint8 images of shape (N, C, H, W) with C = "
            f"{spec.num_channels} for channels {spec.channels!r}, but x is {dtype} with samples "
            f"of shape {shape}; save x as uint8 (N, C, H, W), or register it without a spec",
        )
    if spec.interpolation == "lanczos":
        raise InvalidRequestError(
            "interpolation 'lanczos' applies to images decoded by Pillow (tars); uint8 arrays "
            "are resized by torch, which has none: use nearest, bilinear or bicubic",
        )
    crop = spec.center_crop
    if crop is not None and _unresized(spec) and (crop[0] > shape[1] or crop[1] > shape[2]):
        raise InvalidRequestError(
            f"center_crop {crop} is larger than the samples ({shape[1]} x {shape[2]} pixels); "
            "crop less, or resize first",
        )
    return spec.output_shape(shape[1], shape[2])
