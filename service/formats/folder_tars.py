"""A folder of images in a bucket as an image tar (NOTE [ Image datasets ] in
service/formats/images.py), streamed object by object into a writer: what registers an S3
prefix of images without the user building a tar.

# NOTE [ Folders of images in a bucket ]
A local folder's rules (NOTE [ Folders of images ] in service/formats/image_folders.py), where
the client lists the files it leaves out; the API has no one to show such a list to, so here
what a local folder skips is refused, and member names are sample numbers, not keys. The
tar's bytes are written as a local folder's are (service/formats/image_tars.py).
- **Labels as torchvision's ImageFolder gives them.** Folders directly in the folder are the
  classes, numbered in sorted order of their names (Python's string order, which is S3's key
  order); every image anywhere under a class folder has its class. A class folder with no
  image is refused, as ImageFolder refuses it. With no folder at all, the images directly in
  the folder make an unlabelled dataset; images both directly in it and in folders are
  refused (ImageFolder would drop the former without a word).
- **Samples in ImageFolder's order.** Within a class: folder by folder in sorted order of
  their paths (``os.walk``, sorted, as ImageFolder walks), each folder's images in sorted
  order of their names. Sample ``i`` of the tar is the ``i``-th image of that order, named
  ``<i, 9 digits>.<ext>`` with its label in ``<i>.cls``: member names come from no key of the
  source, so nothing in a key can make a member path or a sample key of its own.
- **JPEG and PNG.** Files ending in ``.jpg``, ``.jpeg`` or ``.png`` (any case) are the
  images; a file in another of ImageFolder's image formats (``.bmp``, ``.webp``, ...) is
  refused rather than dropped, which would renumber nothing but lose samples; other files are
  ignored.
- **Bounded memory.** A first pass lists the tree and keeps only its folders (and a count and
  byte total, checked against the dataset limit before anything is copied); a second lists
  each folder again a page at a time and streams each object through the writer in 1 MiB
  reads. The memory is the folders' names, a page of keys and a read buffer, whatever the
  number of images. What changed between the passes is what the tar holds; registration
  checks the tar as any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from service.errors import ArrayFileError, ArrayLimitError, ObjectNotFoundError
from service.formats.image_tars import (
    IMAGE_EXTENSIONS,
    OTHER_IMAGE_EXTENSIONS,
    TAR_END,
    image_extension,
    tar_header,
    tar_member_size,
    tar_padding,
)
from service.store.base import SourceFolders

__all__ = ["FolderPlan", "plan_folder", "write_folder_tar"]

_COPY_CHUNK: Final = 1024 * 1024
_SAMPLE_DIGITS: Final = 9
# A label member's size in the plan: its text is padded to a whole block whatever its
# length (a class number), so one digit counts as many as any.
_LABEL_DIGITS: Final = 1


@dataclass(frozen=True)
class FolderPlan:
    """What the first pass found: the folders to stream, in order, each with its label."""

    folders: list[tuple[str, int | None]]  # (prefix, class), None for an unlabelled dataset
    num_classes: int | None
    num_images: int
    tar_bytes: int  # the size of the tar to write


def _check_key(key: str, root: str) -> None:
    """A key under ``root`` whose segments could be read as another key (NOTE [ Import
    sources ] in service/records/tenancy/import_sources.py)."""
    relative = key[len(root) :]
    if not relative:
        return  # the folder itself (an empty "folder" object some consoles make)
    if any(part in {"", ".", ".."} for part in relative.removesuffix("/").split("/")):
        raise ArrayFileError(
            "a key under the folder has an empty, '.' or '..' segment ('//', '/./', '/../'), "
            "which an S3 client may read as another key; rename it"
        )


class _Tree:
    """The first pass: folders, images and bytes under one folder."""

    def __init__(self, source: SourceFolders, root: str) -> None:
        self.source = source
        self.root = root
        self.images = 0
        self.tar_bytes = 0

    def scan(self, prefix: str, labelled: bool) -> tuple[int, list[str]]:
        """(images directly in ``prefix``, folders directly in it); counts their bytes."""
        images, folders = 0, []
        for page in self.source.pages(prefix):
            folders.extend(page.folders)
            for key, size in page.files:
                _check_key(key, self.root)
                ext = image_extension(key)
                if ext in OTHER_IMAGE_EXTENSIONS:
                    raise ArrayFileError(
                        f"the folder holds .{ext} images; only JPEG (.jpg, .jpeg) and PNG "
                        "(.png) images are read: convert them"
                    )
                if ext in IMAGE_EXTENSIONS:
                    images += 1
                    # Members are named by sample number (``_member_name``), one digit
                    # count for all: the image's and its label's sizes are known now.
                    self.tar_bytes += tar_member_size(_member_name(0, ext), size)
                    if labelled:
                        self.tar_bytes += tar_member_size(_member_name(0, "cls"), _LABEL_DIGITS)
        for folder in folders:
            _check_key(folder, self.root)
        self.images += images
        return images, folders

    def walk(self, top: str) -> tuple[int, list[str]]:
        """(images under ``top``, its folders and those under them in ``os.walk``'s sorted
        order: by path, compared without the trailing ``/``)."""
        found, pending, folders = 0, [top], []
        while pending:
            folder = pending.pop()
            folders.append(folder)
            images, below = self.scan(folder, labelled=True)
            found += images
            pending.extend(below)
        return found, sorted(folders, key=lambda f: f[:-1])


def plan_folder(
    source: SourceFolders, root: str, *, max_classes: int, max_bytes: int | None
) -> FolderPlan:
    """The first pass over the folder ``root`` (NOTE [ Folders of images in a bucket ]):
    ``ArrayFileError`` for a folder that breaks a rule, ``ArrayLimitError`` for more classes or
    bytes than the limits; ``ObjectNotFoundError`` for a folder with nothing in it."""
    tree = _Tree(source, root)
    top_images, classes = tree.scan(root, labelled=False)
    if not top_images and not classes:
        raise ObjectNotFoundError("an empty folder")
    if not classes:
        if tree.images == 0:
            raise ArrayFileError(
                "the folder holds no .jpg, .jpeg or .png image; put the images in it, or in "
                "one folder per class"
            )
        plan = FolderPlan([(root, None)], None, tree.images, tree.tar_bytes + len(TAR_END))
    else:
        if top_images:
            raise ArrayFileError(
                "the folder holds images both directly and in folders; put every image in its "
                "class's folder (a labelled dataset), or all directly in the folder (an "
                "unlabelled one)"
            )
        if len(classes) > max_classes:
            raise ArrayLimitError(
                f"the folder has {len(classes)} class folders, more than the limit of "
                f"{max_classes} (BNADAPT_MAX_CLASSES)"
            )
        folders: list[tuple[str, int | None]] = []
        for label, top in enumerate(sorted(classes, key=lambda f: f[:-1])):
            images, walked = tree.walk(top)
            if not images:
                raise ArrayFileError(
                    f"class folder {label} (in sorted order, from 0) holds no .jpg, .jpeg or "
                    ".png image; every folder in the folder is a class: remove it or add images"
                )
            folders.extend((folder, label) for folder in walked)
        plan = FolderPlan(folders, len(classes), tree.images, tree.tar_bytes + len(TAR_END))
    if max_bytes is not None and plan.tar_bytes > max_bytes:
        raise ArrayLimitError(
            f"the {plan.num_images} images make a tar of {plan.tar_bytes} bytes, more than the "
            f"dataset limit of {max_bytes} bytes (BNADAPT_MAX_DATASET_BYTES); import a smaller "
            "folder"
        )
    return plan


def _member_name(sample: int, extension: str) -> str:
    return f"{sample:0{_SAMPLE_DIGITS}d}.{extension}"


def _images(source: SourceFolders, plan: FolderPlan) -> Iterator[tuple[str, int | None]]:
    for folder, label in plan.folders:
        for page in source.pages(folder):
            for key, _ in page.files:
                if image_extension(key) in IMAGE_EXTENSIONS:
                    yield key, label


def write_folder_tar(
    source: SourceFolders, plan: FolderPlan, write: Callable[[bytes], None]
) -> int:
    """The second pass: the planned folders' images (and labels) as one tar, through
    ``write``; returns the number of samples. ``ArrayFileError`` if an object changed size
    while it was read, ``ObjectNotFoundError`` if one went missing."""
    count = 0
    for key, label in _images(source, plan):
        with source.open(key) as (size, reader):
            write(tar_header(_member_name(count, image_extension(key)), size))
            copied = 0
            while chunk := reader.read(_COPY_CHUNK):
                copied += len(chunk)
                if copied > size:
                    break
                write(chunk)
        if copied != size:
            raise ArrayFileError(
                "an image changed while it was read; nothing was registered: import again"
            )
        write(tar_padding(size))
        if label is not None:
            text = str(label).encode()
            write(tar_header(_member_name(count, "cls"), len(text)) + text + tar_padding(len(text)))
        count += 1
    if count == 0:
        raise ArrayFileError("the folder's images were removed while it was read")
    write(TAR_END)
    return count
