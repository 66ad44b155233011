"""Registering a stored dataset file: every upload path (``POST /v1/datasets``, resumable
``/v1/uploads``, direct uploads and imports to an S3 store) ends here, so a dataset is checked
by the same rules however its bytes arrived."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from api_schemas import DatasetPublic, Preprocessing, new_id, utc_now
from service.datasets.preprocessing import preprocessed_shape
from service.errors import (
    ArrayFileError,
    ArrayLimitError,
    InvalidRequestError,
    TooLargeError,
)
from service.formats.arrays import describe_arrays
from service.formats.images import describe_tar
from service.formats.sniff import sniff
from service.public_text import scrub_internals
from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store

__all__ = ["DATASET_BYTES_SETTING", "register_dataset"]

# The setting that bounds a dataset file's size, named in the 413 of every upload path.
DATASET_BYTES_SETTING: Final = "BNADAPT_MAX_DATASET_BYTES"


def register_dataset(
    tenant: str,
    records: Records,
    store: Store,
    settings: Settings,
    sha256: str,
    size: int,
    name: str,
    preprocessing: Preprocessing | None = None,
) -> DatasetPublic:
    """Checks a stored dataset file (arrays, or a tar of images with its ``preprocessing``)
    against every rule, in bounded memory, and registers it; 422 (413 past a limit) naming
    what to fix, and nothing registered, when it breaks one. Blocking: call it from a worker
    thread."""
    records.check_stored_bytes(tenant, size, settings.tenant_max_stored_bytes, sha256)
    path = store.local_path(sha256)
    try:
        if sniff(path)[0] == "tar":
            return _register(
                tenant,
                records,
                settings,
                sha256,
                size,
                name,
                _describe_images(path, preprocessing, settings),
            )
        facts = describe_arrays(
            path,
            max_elements=settings.max_dataset_elements,
            max_classes=settings.max_classes,
            max_ratio=settings.max_npz_ratio,
        )
    except ArrayLimitError as exc:
        raise TooLargeError(scrub_internals(str(exc))) from exc
    except ArrayFileError as exc:  # may quote a reader's message, which may name the file
        raise InvalidRequestError(scrub_internals(str(exc))) from exc
    shape = list(facts.sample_shape)
    image = facts.dtype == "uint8" and len(shape) == 3  # (C, H, W)
    if preprocessing is not None:
        shape = preprocessed_shape(facts.dtype, shape, preprocessing)
    dataset = DatasetPublic(
        id=new_id("ds"),
        name=name,
        num_samples=facts.num_samples,
        sample_shape=shape,
        dtype=facts.dtype,
        has_labels=facts.has_labels,
        label_kind=facts.label_kind,
        num_classes=facts.num_classes,
        sha256=sha256,
        size_bytes=size,
        format=facts.format,
        preprocessing=preprocessing,
        image_size=list(facts.sample_shape[1:]) if image else None,
        created_at=utc_now(),
    )
    return _register(tenant, records, settings, sha256, size, name, dataset)


def _describe_images(
    path: Path, preprocessing: Preprocessing | None, settings: Settings
) -> DatasetPublic:
    spec = preprocessing or Preprocessing()
    facts = describe_tar(
        path,
        spec,
        max_pixels=settings.max_image_pixels,
        max_classes=settings.max_classes,
        max_elements=settings.max_dataset_elements,
    )
    return DatasetPublic(
        id=new_id("ds"),
        name="dataset",  # replaced by _register
        num_samples=facts.num_samples,
        sample_shape=list(facts.sample_shape),
        dtype="uint8",
        has_labels=facts.has_labels,
        label_kind="class" if facts.has_labels else None,
        num_classes=facts.num_classes,
        sha256="0" * 64,  # replaced by _register
        size_bytes=0,
        format="tar",
        preprocessing=spec,
        image_size=None if facts.image_size is None else list(facts.image_size),
        created_at=utc_now(),
    )


def _register(
    tenant: str,
    records: Records,
    settings: Settings,
    sha256: str,
    size: int,
    name: str,
    dataset: DatasetPublic,
) -> DatasetPublic:
    dataset = dataset.model_copy(update={"name": name, "sha256": sha256, "size_bytes": size})
    # Checked again with the record's write: a registration racing this one may have taken
    # the room (QuotaExceededError, 429; the stored file is then collected unused).
    records.put_dataset(tenant, dataset, settings.tenant_max_stored_bytes)
    return dataset
