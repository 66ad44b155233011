"""Exceptions raised by the service package.

Exception tree::

    BnadaptError
    ├── StoreError
    │   ├── StoreTooLargeError   an object went over the size limit while being written
    │   └── ObjectNotFoundError  no object with that sha256
    ├── ArrayFileError           a dataset file is unreadable or breaks the dataset rules
    │   └── ArrayLimitError      it would take more memory to read than the limits allow
    ├── InvalidPageTokenError    a page token this service did not hand out
    ├── QuotaExceededError       a tenant is at one of its quotas
    (service/records/tenancy/quotas.py) ├── WeightsFileError         a weights file is not an
    acceptable safetensors file └── EmbeddedServerError      the private Redis-compatible server
        (service/local/embedded.py) ├── ServerBinaryNotFoundError  no server binary to run
        ├── DataDirInUseError          another server holds the data directory
        └── ServerStartError           the server exited, or did not answer in time

Messages are meant for the user: they say what is wrong, with the values involved, and what to do.
"""

__all__ = [
    "ArrayFileError",
    "ArrayLimitError",
    "BnadaptError",
    "DataDirInUseError",
    "EmbeddedServerError",
    "InvalidPageTokenError",
    "ObjectNotFoundError",
    "QuotaExceededError",
    "ServerBinaryNotFoundError",
    "ServerStartError",
    "StoreDigestMismatchError",
    "StoreError",
    "StoreTooLargeError",
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


class InvalidPageTokenError(BnadaptError):
    """A page token that this service did not hand out."""


class QuotaExceededError(BnadaptError):
    """A tenant is at one of its quotas (NOTE [ Tenant quotas ] in
    service/records/tenancy/quotas.py): the message names the limit, its value and what to do;
    ``retry_after_s`` is when trying again may succeed."""

    def __init__(self, message: str, quota: str, limit: float, retry_after_s: int) -> None:
        super().__init__(message)
        self.quota = quota
        self.limit = limit
        self.retry_after_s = retry_after_s


class EmbeddedServerError(BnadaptError):
    """The private Redis-compatible server could not be found, started or locked."""


class ServerBinaryNotFoundError(EmbeddedServerError):
    """No redis-server or valkey-server binary to run."""


class DataDirInUseError(EmbeddedServerError):
    """Another server holds the data directory's lock."""


class ServerStartError(EmbeddedServerError):
    """The server exited during start-up or did not answer PING in time."""
