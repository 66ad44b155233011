"""An architecture's own evaluation transform as a preprocessing spec: what a job's
``"preprocessing": "model"`` stands for.

The inspector resolves it when a model is registered and the API keeps it in the model record
(``ModelPublic.preprocessing``), so the API, which never imports torch, substitutes it when a
job asks for it and checks the job's input shape against the model before it is queued.

- ``torchvision.<name>``: the transform of the model's DEFAULT weights
  (``get_model_weights(name).DEFAULT.transforms()``, an ``ImageClassification``): its
  ``resize_size`` (the shorter side), ``crop_size``, ``interpolation``, ``mean`` and ``std``.
  Nothing is downloaded: the transform is built from the weights' metadata. A model built
  for another input size (``image_size``, as a ViT takes) crops that size, and resizes the
  shorter side in the weights' proportion (256 for a crop of 224: 36 for 32).
- ``timm.<name>``: timm's data config (``resolve_data_config``, read from the pretrained config
  of the model built on the meta device with the model's kwargs): ``input_size``,
  ``interpolation``, ``crop_pct``, ``mean`` and ``std``; crop mode ``center`` with a square
  input becomes ``crop_pct``, ``squash`` an exact ``resize`` of each side to
  ``floor(side / crop_pct)``; timm's ``border`` mode (which pads) has no spec.
- anything else (the built-ins, entry points): none; a job then names its spec itself.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from api_schemas.datasets import Preprocessing

__all__ = ["evaluation_preprocessing"]

log = logging.getLogger(__name__)


def _torchvision(name: str, kwargs: Mapping[str, Any]) -> Preprocessing | None:
    models = importlib.import_module("torchvision.models")
    try:
        weights = models.get_model_weights(name)
    except ValueError:  # a model without published weights
        return None
    transform = weights.DEFAULT.transforms()
    resize, crop = getattr(transform, "resize_size", None), getattr(transform, "crop_size", None)
    interpolation = getattr(transform, "interpolation", None)
    if resize is None or crop is None or interpolation is None:
        return None  # not an ImageClassification transform
    shorter, crop_side = resize[0], crop[0]
    built = kwargs.get("image_size")
    if isinstance(built, int) and built != crop_side:
        # A model built for another input size (a ViT's image_size): the weights' transform
        # at that size, the crop in the same proportion to the resize.
        shorter, crop_side = math.floor(built * shorter / crop_side), built
    return Preprocessing(
        resize_shorter=shorter,
        center_crop=[crop_side, crop_side],
        interpolation=interpolation.value,
        mean=list(transform.mean),
        std=list(transform.std),
    )


def _timm(name: str, kwargs: Mapping[str, Any]) -> Preprocessing | None:
    timm = importlib.import_module("timm")
    data = importlib.import_module("timm.data")
    with torch.device("meta"):  # no memory, no initialisation: only its configuration is read
        model = timm.create_model(name, pretrained=False, **kwargs)
    config = data.resolve_data_config({}, model=model)
    channels, height, width = config["input_size"]
    if channels != kwargs.get("in_chans", 3):
        return None  # timm keeps the RGB configuration for in_chans=1: no spec to trust
    crop_pct, mode = float(config.get("crop_pct") or 0.875), config.get("crop_mode", "center")
    spec: dict[str, Any] = {
        "center_crop": [height, width],
        "interpolation": config["interpolation"],
        "mean": list(config["mean"]),
        "std": list(config["std"]),
    }
    if mode == "squash":
        spec["resize"] = [math.floor(height / crop_pct), math.floor(width / crop_pct)]
    elif mode == "center" and height == width:
        spec["crop_pct"] = crop_pct
    else:
        return None  # timm's border mode, or its ResizeKeepRatio for non-square inputs
    return Preprocessing.model_validate(spec)


def evaluation_preprocessing(architecture: str, kwargs: Mapping[str, Any]) -> Preprocessing | None:
    """The architecture's evaluation transform as a spec, or None when it has none (or one
    that the spec cannot say, which is logged)."""
    library, _, name = architecture.partition(".")
    try:
        if library == "torchvision":
            spec = _torchvision(name, kwargs)
        elif library == "timm":
            spec = _timm(name, kwargs)
        else:
            return None
    except Exception as exc:  # noqa: BLE001 - a library's metadata we cannot read: no spec
        log.warning("no evaluation transform for %s: %s", architecture, exc)
        return None
    return spec
