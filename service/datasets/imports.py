"""``POST /v1/datasets:import``: a dataset from a bucket the tenant was allowed to import from
(NOTE [ Import sources ] in service/records/tenancy/import_sources.py): one object copied
server-side, or a folder of images streamed into the store as a tar (NOTE [ Folders of
images ] in service/formats/folder_tars.py), then registered as any upload is.

Every "no" about the source is one 404 with one text, and no error repeats what was read from
the source: registration's own errors name members, samples and values of the file, so an
import answers its status with a fixed text instead (uploading the same file through
``POST /v1/datasets`` gives the detailed one)."""

from __future__ import annotations

import secrets
import time
from typing import Final

from api_schemas import DatasetPublic
from api_schemas.uploads import DatasetImport, split_s3_source
from service.datasets.registration import DATASET_BYTES_SETTING, register_dataset
from service.errors import (
    ArrayFileError,
    ArrayLimitError,
    InvalidRequestError,
    NotFoundError,
    ObjectNotFoundError,
    StoreError,
    StoreTooLargeError,
    TooLargeError,
)
from service.formats.folder_tars import plan_folder, write_folder_tar
from service.records.sync import Records
from service.records.tenancy.quotas import open_upload, release_upload
from service.settings import Settings
from service.store.base import DirectTransfers, Store

__all__ = ["IMPORT_SLOT_S", "NOT_A_SOURCE", "import_dataset"]

# How long an import counts as an open upload at most (it ends sooner: its slot is released
# when it ends, error or not).
IMPORT_SLOT_S: Final = 3600.0
# The one answer to a source that is not allowed, missing, unreadable or the store's own.
NOT_A_SOURCE: Final = (
    "no object at that source the service may read for you: check the source (an object, or a "
    "folder of images ending in '/'), and ask the operator which sources your tenant may import "
    "from (`bnadapt tenants list-imports`)"
)
_NOT_A_DATASET: Final = (
    "the source is not a dataset this service reads (an .npz or .safetensors file of arrays, "
    "or a tar or folder of JPEG and PNG images, with a preprocessing spec that fits them: "
    "docs/datasets.md); nothing was registered. Upload the same file through POST "
    "/v1/datasets to be told which rule it breaks"
)
_OVER_A_LIMIT: Final = (
    f"the source is over a dataset limit ({DATASET_BYTES_SETTING}, BNADAPT_MAX_DATASET_ELEMENTS "
    "or BNADAPT_MAX_IMAGE_PIXELS); nothing was registered: import a smaller dataset, or ask the "
    "operator to raise the limit"
)
_NOT_COPIED: Final = (
    "the source could not be copied into the store; nothing was registered: try again later"
)


def import_dataset(
    tenant: str,
    records: Records,
    store: Store,
    direct: DirectTransfers,
    settings: Settings,
    request: DatasetImport,
) -> DatasetPublic:
    """Checks the source against the tenant's allowed sources, copies it into the store and
    registers it; ``NotFoundError`` (404), ``TooLargeError`` (413) or ``InvalidRequestError``
    (422) otherwise, with nothing registered. Blocking: call it from a worker thread."""
    bucket, key = split_s3_source(request.source)
    if not records.may_import(tenant, bucket, key):
        raise NotFoundError(NOT_A_SOURCE)
    # An import counts as an open upload while it runs (NOTE [ Tenant quotas ]); a slot whose
    # API process died lapses after IMPORT_SLOT_S.
    slot = f"import:{secrets.token_urlsafe(12)}"
    open_upload(
        records.client, tenant, slot, time.time() + IMPORT_SLOT_S, settings.tenant_max_open_uploads
    )
    try:
        return _import(tenant, records, store, direct, settings, request, bucket, key)
    finally:
        release_upload(records.client, tenant, slot)


def _import(
    tenant: str,
    records: Records,
    store: Store,
    direct: DirectTransfers,
    settings: Settings,
    request: DatasetImport,
    bucket: str,
    key: str,
) -> DatasetPublic:
    try:
        if key.endswith("/"):
            sha256, size = _import_folder(store, direct, settings, bucket, key)
        else:
            sha256, size = direct.import_object(request.source, settings.max_dataset_bytes)
    except ObjectNotFoundError as exc:
        raise NotFoundError(NOT_A_SOURCE) from exc
    except StoreTooLargeError as exc:
        raise TooLargeError(_OVER_A_LIMIT) from exc
    # A folder's own rules (service/formats/folder_tars.py): their texts give counts, never a
    # key or a byte of the source.
    except ArrayLimitError as exc:
        raise TooLargeError(str(exc)) from exc
    except ArrayFileError as exc:
        raise InvalidRequestError(str(exc)) from exc
    except StoreError as exc:
        raise InvalidRequestError(_NOT_COPIED) from exc
    name = request.name or key.removesuffix("/").rpartition("/")[2]
    try:
        return register_dataset(
            tenant, records, store, settings, sha256, size, name, request.preprocessing
        )
    except TooLargeError as exc:
        raise TooLargeError(_OVER_A_LIMIT) from exc
    except InvalidRequestError as exc:
        raise InvalidRequestError(_NOT_A_DATASET) from exc


def _import_folder(
    store: Store, direct: DirectTransfers, settings: Settings, bucket: str, prefix: str
) -> tuple[str, int]:
    """The folder's images as a tar in the store: (sha256, size)."""
    source = direct.source_folders(bucket)
    plan = plan_folder(
        source, prefix, max_classes=settings.max_classes, max_bytes=settings.max_dataset_bytes
    )
    with store.writer(max_bytes=settings.max_dataset_bytes) as writer:
        write_folder_tar(source, plan, writer.write)
    return writer.sha256, writer.size
