"""Exceptions raised by the service package.

Exception tree::

    BnadaptError
    ├── StoreError
    │   ├── StoreTooLargeError     an object went over the size limit while being written
    │   ├── StoreDigestMismatchError  the bytes written did not hash to the announced digest
    │   └── ObjectNotFoundError    no object with that sha256
    ├── ArrayFileError             a dataset file is unreadable or breaks the dataset rules
    │   └── ArrayLimitError        it would take more memory to read than the limits allow
    ├── RefusedError               a request the service refuses, with the status to answer
    │   ├── NotFoundError          404: nothing the tenant may see is there
    │   │   └── ResourceNotFoundError  no model, dataset or job of the tenant with that id
    │   ├── ConflictError          409: the state of a resource or another request is in the way
    │   ├── TooLargeError          413: past a size limit
    │   ├── InvalidRequestError    422: well-formed, but not what the service can do
    │   │   └── InvalidPageTokenError  a page token this service did not hand out
    │   └── QuotaExceededError     429: a tenant is at one of its quotas
    │                              (service/records/tenancy/quotas.py)
    ├── WeightsFileError           a weights file is not an acceptable safetensors file
    └── EmbeddedServerError        the private Redis-compatible server (service/local/embedded.py)
        ├── ServerBinaryNotFoundError  no server binary to run
        ├── DataDirInUseError          another server holds the data directory
        └── ServerStartError           the server exited, or did not answer in time

Messages are meant for the user: they say what is wrong, with the values involved, and what to do.

A :class:`RefusedError` carries what the API answers as plain data: its ``status``, its
``detail`` (the message), the validation ``errors`` and ``retry_after_s`` where there are any.
The layer under the routes (service/jobs/, service/datasets/, service/records/) raises them
without knowing HTTP; service/api/problems.py makes every one an RFC 9457 problem, the one place
errors become HTTP (its ``ApiError`` is what the HTTP layer itself refuses, with HTTP headers
of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from api_schemas import ProblemItem

__all__ = [
    "ArrayFileError",
    "ArrayLimitError",
    "BnadaptError",
    "ConflictError",
    "DataDirInUseError",
    "EmbeddedServerError",
    "InvalidPageTokenError",
    "InvalidRequestError",
    "NotFoundError",
    "ObjectNotFoundError",
    "QuotaExceededError",
    "RefusedError",
    "ResourceNotFoundError",
    "ServerBinaryNotFoundError",
    "ServerStartError",
    "StoreDigestMismatchError",
    "StoreError",
    "StoreTooLargeError",
    "TooLargeError",
    "WeightsFileError",
]


class BnadaptError(Exception):
    """Root of every error this package raises on purpose."""


class StoreError(BnadaptError):
    """The artifact store could not do what was asked."""


class StoreTooLargeError(StoreError):
    """An object went over the size limit while being written; nothing was stored."""


class StoreDigestMismatchError(StoreError):
    """The bytes written did not hash to the digest announced for them; nothing was stored."""


class ObjectNotFoundError(StoreError):
    """No object with that sha256 is in the store."""


class ArrayFileError(BnadaptError):
    """A dataset file is unreadable or breaks the dataset rules."""


class ArrayLimitError(ArrayFileError):
    """A dataset file would inflate past a limit when read (a compressed npz, say)."""


class WeightsFileError(BnadaptError):
    """A weights file is not an acceptable safetensors file."""


class RefusedError(BnadaptError):
    """A request the service refuses. ``status`` is the HTTP status the API answers with (each
    subclass fixes its own), ``detail`` the message; ``errors`` lists validation failures and
    ``retry_after_s`` says when trying again may succeed, where there are any."""

    status: int = 400

    def __init__(
        self,
        detail: str,
        *,
        errors: Sequence[ProblemItem] | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = list(errors) if errors is not None else None
        self.retry_after_s = retry_after_s


class NotFoundError(RefusedError):
    """Nothing the tenant may see is there (another tenant's reads the same as none)."""

    status = 404


class ResourceNotFoundError(NotFoundError):
    """The one refusal of a model, dataset or job (``kind``) that is missing or belongs to
    another tenant."""

    def __init__(self, kind: str, resource_id: str) -> None:
        super().__init__(
            f"{kind} {resource_id!r} not found; list yours with GET /v1/{kind}s to see the ids"
        )
        self.kind = kind
        self.resource_id = resource_id


class ConflictError(RefusedError):
    """The state of a resource, or another request in progress, stands in the way."""

    status = 409


class TooLargeError(RefusedError):
    """What was sent is past a size limit; the message names the setting."""

    status = 413


class InvalidRequestError(RefusedError):
    """A well-formed request the service cannot carry out as written (a job that does not fit
    its model or dataset, a dataset that breaks a rule); the message says what to change."""

    status = 422


class InvalidPageTokenError(InvalidRequestError):
    """A page token that this service did not hand out."""


class QuotaExceededError(RefusedError):
    """A tenant is at one of its quotas (NOTE [ Tenant quotas ] in
    service/records/tenancy/quotas.py): the message names the limit, its value and what to do;
    ``retry_after_s`` is when trying again may succeed."""

    status = 429

    def __init__(self, message: str, quota: str, limit: float, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.quota = quota
        self.limit = limit


class EmbeddedServerError(BnadaptError):
    """The private Redis-compatible server could not be found, started or locked."""


class ServerBinaryNotFoundError(EmbeddedServerError):
    """No redis-server or valkey-server binary to run."""


class DataDirInUseError(EmbeddedServerError):
    """Another server holds the data directory's lock."""


class ServerStartError(EmbeddedServerError):
    """The server exited during start-up or did not answer PING in time."""
