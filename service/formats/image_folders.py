"""A folder of images as the tar of images a dataset is (service/formats/images.py), streamed:
the tar's bytes are made as the files are read, for an upload to send part by part, with no
copy of the folder on disk or in memory.

# NOTE [ Folders of images ]
- **Labels as torchvision's ImageFolder gives them.** A folder with subfolders is labelled:
  each subfolder is a class, numbered in the order of ``sorted(entry.name ...)`` over the
  folder's subdirectories (ImageFolder's ``find_classes``), and holds its images at any depth,
  walked in sorted order. A model trained with ImageFolder on the same tree therefore has the
  same class numbers. Files at the top of a labelled folder belong to no class and are left
  out (ImageFolder leaves them out too). A folder without subfolders is unlabelled.
- **Images are .jpg, .jpeg and .png** (any case), the formats a dataset holds; other files are
  left out and listed in :attr:`FolderPlan.skipped`, so the caller can say so. A class folder
  with no image is refused, as ImageFolder refuses it.
- **Sample keys** are the image's path below the folder without its extension, with every dot
  made an underscore (a tar's sample key ends at the first dot of the file name): the key an
  error about the sample names leads back to the file. Two files that would share a key get
  ``~2``, ``~3``, ... on the later ones.
- **Streamed.** :func:`tar_stream` yields each member's header, then the file in chunks as it
  is read, then the padding; the file's size is taken when the plan is made, and a file that
  changes size while it is sent stops the stream with an error rather than send a tar whose
  headers lie.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from service.errors import BnadaptError
from service.formats.image_tars import (
    IMAGE_EXTENSIONS,
    TAR_END,
    image_extension,
    tar_header,
    tar_member_size,
    tar_padding,
)

__all__ = [
    "FolderError",
    "FolderImage",
    "FolderPlan",
    "plan_folder",
    "tar_size",
    "tar_stream",
]

_CHUNK: Final = 1 << 20


class FolderError(BnadaptError):
    """A folder that cannot be sent as a dataset; the message says what to change."""


@dataclass(frozen=True)
class FolderImage:
    path: Path
    key: str
    extension: str  # lower case, without the dot
    size: int  # bytes, when the plan was made
    label: int | None


@dataclass(frozen=True)
class FolderPlan:
    """What the tar of a folder will hold, in order."""

    images: list[FolderImage]
    classes: list[str]  # class names by label; empty for an unlabelled folder
    skipped: list[Path] = field(default_factory=list)  # files that are no image


def _walk(folder: Path) -> Iterator[Path]:
    """Files below ``folder`` in ImageFolder's order: ``sorted(os.walk(...))``, then the file
    names of each directory sorted (links to folders followed, as ImageFolder does)."""
    for root, _, names in sorted(os.walk(folder, followlinks=True)):
        for name in sorted(names):
            yield Path(root, name)


def plan_folder(folder: Path) -> FolderPlan:
    """The images of ``folder`` (NOTE [ Folders of images ]); ``FolderError`` for a folder
    that is missing, holds no image, or has an empty class."""
    if not folder.is_dir():
        raise FolderError(f"{folder} is not a folder; give a folder of images (or a tar file)")
    classes = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
    images: list[FolderImage] = []
    skipped: list[Path] = []
    keys: set[str] = set()

    def add(path: Path, label: int | None) -> bool:
        extension = image_extension(path.name)
        if extension not in IMAGE_EXTENSIONS or not path.is_file():
            skipped.append(path)
            return False
        base = path.relative_to(folder).with_suffix("").as_posix().replace(".", "_")
        key, n = base, 1
        while key in keys:
            n += 1
            key = f"{base}~{n}"
        keys.add(key)
        images.append(FolderImage(path, key, extension, path.stat().st_size, label))
        return True

    if classes:
        skipped.extend(sorted(p for p in folder.iterdir() if not p.is_dir()))
        for label, name in enumerate(classes):
            found = [add(path, label) for path in _walk(folder / name)]
            if not any(found):
                raise FolderError(
                    f"the class folder {folder / name} holds no .jpg, .jpeg or .png image; "
                    "every subfolder is a class (as in torchvision's ImageFolder): add its "
                    "images, or remove it"
                )
    else:
        for path in sorted(folder.iterdir()):
            add(path, None)
    if not images:
        raise FolderError(f"{folder} holds no .jpg, .jpeg or .png image")
    return FolderPlan(images, classes, skipped)


def tar_size(plan: FolderPlan) -> int:
    """The bytes :func:`tar_stream` yields for ``plan`` (while no file changes)."""
    total = len(TAR_END)
    for image in plan.images:
        total += tar_member_size(f"{image.key}.{image.extension}", image.size)
        if image.label is not None:
            total += tar_member_size(f"{image.key}.cls", len(str(image.label)))
    return total


def tar_stream(plan: FolderPlan) -> Iterator[bytes]:
    """The tar of ``plan``'s images (and labels as ``key.cls``), in chunks of at most 1 MiB
    as the files are read."""
    for image in plan.images:
        yield tar_header(f"{image.key}.{image.extension}", image.size)
        sent = 0
        with image.path.open("rb") as file:
            while chunk := file.read(min(_CHUNK, image.size - sent + 1)):
                sent += len(chunk)
                if sent > image.size:
                    break
                yield chunk
        if sent != image.size:
            raise FolderError(
                f"{image.path} changed while it was sent ({image.size} bytes when the upload "
                "started, now another size); send the folder again once it no longer changes"
            )
        yield tar_padding(image.size)
        if image.label is not None:
            label = str(image.label).encode()
            yield tar_header(f"{image.key}.cls", len(label)) + label + tar_padding(len(label))
    yield TAR_END
