"""Image datasets: WebDataset-style tar shards, checked at registration and read by workers.

A sample is the members of the tar that share a key (the member's path up to the first dot of
its file name): one image (``key.jpg``, ``key.jpeg`` or ``key.png``) and, for a labelled
dataset, one label (``key.cls``: an integer as text; or ``key.json``: an integer, or an object
with an integer ``"label"``). Other members (``key.txt``, directories) are ignored. A dataset
is one tar, or several joined end to end (``cat a.tar b.tar``, or one resumable-upload part
per shard): NOTE [ Image datasets ].

No torch here: the API scans tars with it, workers decode with it (workers/passes/images.py
turns the decoded pixels into batches).

# NOTE [ Image datasets ]
- **One file, many shards.** A dataset is one object in the store, as for arrays; several
  shards are that object's bytes joined end to end, which Python's tarfile reads as one
  archive when told to skip the zero blocks between them (``ignore_zeros``). A resumable
  upload already joins its parts in order, so "one part per shard" uploads many shards with
  no new route, record or store object, and the store, the collector, sharded jobs and
  imports work on image datasets unchanged.
- **Registration scans, never extracts.** :func:`describe_tar` reads the tar member by member
  from the stored file: member names (an absolute path, ``..``, a link or a device is refused:
  nothing is ever written from a tar, but such a member means a tool built it wrongly or on
  purpose), the label of each sample, and each image's header through Pillow's lazy open
  (format and size, not the pixels): a decompression bomb is refused by its declared pixels
  (``BNADAPT_MAX_IMAGE_PIXELS``) before any is decoded, mixed sizes without a ``resize`` are
  refused with the first sample that differs. Pixels are decoded only by a job, so a body
  that is damaged behind a sound header fails the job with the sample's key.
- **Workers index, then decode a batch at a time.** :func:`index_tar` reads the headers
  again (512 bytes a member, seeking over the data) and the small label members, giving the
  offset of every image; a batch decodes only its own images (a shard of a sharded job only
  its range). Decoding runs in DataLoader processes (workers/passes/images.py).
- **One header at a time.** Python's ``TarFile`` keeps the header of every member it has read
  (``members``), so a tar of a million tiny members would hold a million ``TarInfo`` objects
  while it is scanned. Both scans read with :func:`_each_member`, which forgets each header
  once the next one is read: their memory is what they return (a key per sample), whatever
  else the tar holds.
- **Pillow, not torchvision.** Pillow decodes JPEG and PNG with the same code in the API
  (headers) and the workers (pixels) and needs no torch, so the API can depend on it.

# NOTE [ Reduced-size JPEG decoding ]
A JPEG whose resize target is at most half its size in both sides is decoded at 1/2, 1/4 or
1/8 of its size in the DCT domain (Pillow's ``draft``: the smallest scale still at least the
target), then resized to the target exactly as any image is. Measured here on a 4000 x 3000
photo to 256 then 224: 92 ms a decode instead of 619 (6.7x); the pixels differ from a
full-size decode by at most 5 levels of 255 and by under 0.8 on average
(tests/service/store/test_reduced_decoding.py). Targets larger than half the image (a 500 x 375
photo to 256: what the libraries' own transforms are checked against, within 1/255) and PNGs
decode at full size, as before.
"""

from __future__ import annotations

import io
import json
import tarfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

import numpy as np
import numpy.typing as npt
from PIL import Image

from api_schemas.datasets import Preprocessing
from service.errors import ArrayFileError, ArrayLimitError
from service.formats.image_tars import IMAGE_EXTENSIONS

__all__ = [
    "IMAGE_EXTENSIONS",
    "TarFacts",
    "TarIndex",
    "crop_origin",
    "decode_image",
    "describe_tar",
    "index_tar",
]

_LABEL_EXTENSIONS: Final = frozenset({"cls", "json"})
_FORMATS: Final = frozenset({"JPEG", "PNG"})
_MAX_LABEL_BYTES: Final = 4096
# Pillow's resize filters, as torchvision hands them to Pillow for a PIL image: bilinear,
# bicubic and lanczos widen with the downscale factor (antialiased), nearest does not.
_RESAMPLING: Final = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
_HOW_TO_BUILD: Final = (
    "build the tar with one image per sample (key.jpg or key.png) and its label "
    "(key.cls holding the class as text), e.g. with webdataset's TarWriter or tar itself"
)


@dataclass(frozen=True)
class TarFacts:
    """What registration found: the file-derived part of an image ``DatasetPublic``."""

    num_samples: int
    sample_shape: tuple[int, ...]  # after preprocessing: (C, H, W)
    has_labels: bool
    num_classes: int | None
    image_size: tuple[int, int] | None  # (height, width) when all images have it


@dataclass(frozen=True)
class TarIndex:
    """Where each sample's image lies in the file, in tar order, and its label."""

    keys: list[str]
    offsets: npt.NDArray[np.int64]  # (N,) first byte of the image member's data
    sizes: npt.NDArray[np.int64]  # (N,) its bytes
    labels: npt.NDArray[np.int64] | None  # (N,) class labels, or None without labels


def _split(name: str) -> tuple[str, str]:
    """A member's sample key and extension (lower case): ``a/b.c.png`` -> (``a/b``, ``c.png``)."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (ext.lower() if dot else "")


def _check_member(info: tarfile.TarInfo) -> None:
    """Refuses members that could point outside an extraction, and anything but files and
    folders (NOTE [ Image datasets ])."""
    name = info.name
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or ".." in parts or (len(name) > 1 and name[1] == ":"):
        raise ArrayFileError(
            f"the tar member {name!r} has a path that leaves the archive (absolute, or with "
            f"'..'); {_HOW_TO_BUILD}, with paths relative to the archive"
        )
    if not (info.isfile() or info.isdir()):
        raise ArrayFileError(
            f"the tar member {name!r} is a link or a special file; only regular files are "
            f"read: {_HOW_TO_BUILD}"
        )


def _each_member(archive: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The archive's members in order, holding one header at a time (NOTE [ Image datasets ]):
    ``TarFile.next`` appends each header it reads to ``members``, emptied here before the
    member is handed on. The random-access mode is kept (not the stream mode ``r|``, which
    forgets headers too) because Pillow seeks back within a member to read an image's header."""
    while (info := archive.next()) is not None:
        archive.members.clear()  # type: ignore[attr-defined]  # (typeshed omits it)
        yield info


def _members(path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(path, mode="r:", ignore_zeros=True)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ArrayFileError(f"the tar could not be read ({exc}); {_HOW_TO_BUILD}") from exc


def _label(data: bytes, ext: str, key: str, max_classes: int) -> int:
    try:
        value: object = json.loads(data) if ext == "json" else int(data.decode().strip())
        if isinstance(value, dict):
            value = value.get("label")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{value!r} is not an integer")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArrayFileError(
            f"the label of sample {key!r} (member {key}.{ext}) is not a class ({exc}); write "
            "the class as an integer: '3' in key.cls, or {\"label\": 3} in key.json"
        ) from exc
    if not 0 <= value < max_classes:
        raise ArrayFileError(
            f"sample {key!r} has the label {value}; class labels must be 0..{max_classes - 1} "
            "(BNADAPT_MAX_CLASSES): remap them"
        )
    return value


def _read_member(archive: tarfile.TarFile, info: tarfile.TarInfo, limit: int) -> bytes:
    if info.size > limit:
        raise ArrayFileError(f"the tar member {info.name!r} has {info.size} bytes, over {limit}")
    file = archive.extractfile(info)
    assert file is not None  # a regular file
    data = file.read()
    if len(data) != info.size:
        raise ArrayFileError(
            f"the tar member {info.name!r} is truncated: {len(data)} of {info.size} bytes; "
            "upload the complete tar"
        )
    return data


def _image_size(file: IO[bytes], key: str, max_pixels: int) -> tuple[int, int]:
    """(height, width) from the image's header; the pixels are not decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(file, formats=sorted(_FORMATS))
            width, height = image.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ArrayLimitError(_bomb(key, exc)) from exc
    except (OSError, SyntaxError, ValueError) as exc:  # Pillow's "cannot identify image file"
        raise ArrayFileError(
            f"the image of sample {key!r} is not a readable JPEG or PNG ({exc}); re-encode it"
        ) from exc
    if width * height > max_pixels:
        raise ArrayLimitError(_bomb(key, f"{width} x {height} pixels"))
    return height, width


def _bomb(key: str, what: object) -> str:
    return (
        f"the image of sample {key!r} declares too many pixels ({what}); at most "
        "BNADAPT_MAX_IMAGE_PIXELS are decoded, so that a small file cannot take gigabytes of "
        "memory (a decompression bomb): downscale the image, or ask the operator to raise it"
    )


def describe_tar(
    path: Path,
    preprocessing: Preprocessing,
    *,
    max_pixels: int,
    max_classes: int,
    max_elements: int,
) -> TarFacts:
    """Checks a tar of images without extracting it (NOTE [ Image datasets ]) and returns its
    facts; ``ArrayFileError`` naming the member or sample to fix, ``ArrayLimitError`` for a
    decompression bomb or a dataset over ``max_elements``."""
    found = _TarSamples(preprocessing, max_pixels, max_classes)
    with _members(path) as archive:
        try:
            for info in _each_member(archive):
                found.read(archive, info)
        except tarfile.TarError as exc:
            raise ArrayFileError(
                f"the tar is damaged or truncated ({exc}); upload it again"
            ) from exc
        if archive.offset > path.stat().st_size:
            raise ArrayFileError(
                "the tar is truncated: its last member ends past the end of the file; upload "
                "the complete tar"
            )
    images, labels = found.images, found.labels
    _check_pairs(images, labels)
    height, width = next(iter(images.values()))
    shape = tuple(preprocessing.output_shape(height, width))
    _check_crop(preprocessing, images)
    elements = len(images) * int(np.prod(shape))
    if elements > max_elements:
        raise ArrayLimitError(
            f"the {len(images)} preprocessed images hold {elements} numbers, more than the "
            f"limit of {max_elements} (BNADAPT_MAX_DATASET_ELEMENTS); split the dataset"
        )
    return TarFacts(
        num_samples=len(images),
        sample_shape=shape,
        has_labels=bool(labels),
        num_classes=max(labels.values()) + 1 if labels else None,
        image_size=(height, width) if found.one_size else None,
    )


class _TarSamples:
    """What :func:`describe_tar` has read of a tar so far: each sample's image size and
    label, checked member by member."""

    def __init__(self, preprocessing: Preprocessing, max_pixels: int, max_classes: int) -> None:
        self.preprocessing = preprocessing
        self.max_pixels = max_pixels
        self.max_classes = max_classes
        self.images: dict[str, tuple[int, int]] = {}  # key -> (height, width)
        self.labels: dict[str, int] = {}
        self.first_size: tuple[str, tuple[int, int]] | None = None
        self.one_size = True

    def read(self, archive: tarfile.TarFile, info: tarfile.TarInfo) -> None:
        """Checks the member ``info`` and notes its image's size or its label."""
        _check_member(info)
        if info.isdir():
            return
        key, ext = _split(info.name)
        if ext in IMAGE_EXTENSIONS:
            if key in self.images:
                raise ArrayFileError(f"sample {key!r} has two images; give one per key")
            file = archive.extractfile(info)
            assert file is not None
            self.images[key] = self._sized(key, _image_size(file, key, self.max_pixels))
        elif ext in _LABEL_EXTENSIONS:
            if key in self.labels:
                raise ArrayFileError(f"sample {key!r} has two labels; give one per key")
            self.labels[key] = _label(
                _read_member(archive, info, _MAX_LABEL_BYTES), ext, key, self.max_classes
            )

    def _sized(self, key: str, size: tuple[int, int]) -> tuple[int, int]:
        """``size``, once checked against the first image's: another size needs a
        preprocessing that gives every image one size."""
        if self.first_size is None:
            self.first_size = key, size
        elif size != self.first_size[1]:
            self.one_size = False
            if not self.preprocessing.fixed_size:
                first_key, (first_height, first_width) = self.first_size
                raise ArrayFileError(
                    f"sample {key!r} is {size[1]} x {size[0]} pixels but sample "
                    f"{first_key!r} is {first_width} x {first_height}; "
                    "images of a batch must have one size: register the dataset "
                    'with a preprocessing "resize": [height, width], or a '
                    '"resize_shorter" (or "crop_pct") with a "center_crop"'
                )
        return size


def _check_pairs(images: dict[str, tuple[int, int]], labels: dict[str, int]) -> None:
    """Every sample has an image, and every one a label or none does."""
    if not images:
        raise ArrayFileError(f"the tar holds no .jpg or .png image; {_HOW_TO_BUILD}")
    unlabelled = [key for key in images if key not in labels]
    if labels and unlabelled:
        raise ArrayFileError(
            f"sample {unlabelled[0]!r} has no label ({len(unlabelled)} of {len(images)} samples "
            f"have none) but others have one; give every sample a key.cls, or none"
        )
    orphans = [key for key in labels if key not in images]
    if orphans:
        raise ArrayFileError(
            f"the label {orphans[0]!r} has no image ({len(orphans)} labels have none); "
            f"{_HOW_TO_BUILD}"
        )


def _check_crop(spec: Preprocessing, images: dict[str, tuple[int, int]]) -> None:
    if spec.center_crop is None or spec.resize is not None or spec.shorter_side is not None:
        return  # a resize to at least the crop (checked with the spec)
    for key, (height, width) in images.items():
        if spec.center_crop[0] > height or spec.center_crop[1] > width:
            raise ArrayFileError(
                f"center_crop {spec.center_crop} is larger than sample {key!r} "
                f"({height} x {width} pixels); crop less, or resize first"
            )


def index_tar(path: Path) -> TarIndex:
    """The samples of a registered tar, in tar order (NOTE [ Image datasets ]): headers and
    labels only, no pixels."""
    keys: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    labels: dict[str, int] = {}
    with _members(path) as archive:
        for info in _each_member(archive):
            if not info.isfile():
                continue
            key, ext = _split(info.name)
            if ext in IMAGE_EXTENSIONS:
                keys.append(key)
                offsets.append(info.offset_data)
                sizes.append(info.size)
            elif ext in _LABEL_EXTENSIONS:
                labels[key] = _label(
                    _read_member(archive, info, _MAX_LABEL_BYTES), ext, key, 1 << 62
                )
    y = np.array([labels[key] for key in keys], dtype=np.int64) if labels else None
    return TarIndex(keys, np.array(offsets, np.int64), np.array(sizes, np.int64), y)


def crop_origin(size: tuple[int, int], crop: list[int]) -> tuple[int, int]:
    """(top, left) of a centre crop of ``crop`` [height, width] from an image of ``size``
    (height, width), rounded as torchvision's ``center_crop`` rounds (half to even)."""
    return round((size[0] - crop[0]) / 2.0), round((size[1] - crop[1]) / 2.0)


def decode_image(
    data: bytes, key: str, spec: Preprocessing, max_pixels: int
) -> npt.NDArray[np.uint8]:
    """One image's pixels, decoded, resized and cropped: (C, H, W) uint8 in ``spec.channels``
    order. ``ArrayFileError`` naming the sample when its bytes do not decode."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image: Image.Image = Image.open(io.BytesIO(data), formats=sorted(_FORMATS))
            if image.width * image.height > max_pixels:
                raise ArrayLimitError(_bomb(key, f"{image.width} x {image.height} pixels"))
            mode = "L" if spec.channels == "gray" else "RGB"
            height, width = spec.resized_size(image.height, image.width)
            if image.format == "JPEG" and 2 * height <= image.height and 2 * width <= image.width:
                # NOTE [ Reduced-size JPEG decoding ]: decoded at 1/2, 1/4 or 1/8 of its size
                # in the DCT domain (still at least the target's), then resized exactly.
                image.draft(mode, (width, height))
            image = image.convert(mode)
        if image.size != (width, height):
            image = image.resize((width, height), _RESAMPLING[spec.interpolation])
        if spec.center_crop is not None:
            top, left = crop_origin((image.height, image.width), spec.center_crop)
            height, width = spec.center_crop
            image = image.crop((left, top, left + width, top + height))
        pixels = np.asarray(image)
    except ArrayLimitError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ArrayLimitError(_bomb(key, exc)) from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise ArrayFileError(
            f"the image of sample {key!r} could not be decoded ({exc}); it is damaged or "
            "truncated: re-encode it and upload the dataset again"
        ) from exc
    if pixels.ndim == 2:
        return pixels[np.newaxis]  # (1, H, W)
    chw = pixels.transpose(2, 0, 1)  # (3, H, W) RGB
    return chw[::-1] if spec.channels == "bgr" else chw
