"""Exceptions raised by the service package.

Exception tree::

    BnadaptError
    ├── StoreError
    │   ├── StoreTooLargeError   an object went over the size limit while being written
    │   └── ObjectNotFoundError  no object with that sha256
    ├── ArrayFileError           a dataset file is unreadable or breaks the dataset rules
    ├── InvalidPageTokenError    a page token this service did not hand out
    └── WeightsFileError         a weights file is not an acceptable safetensors file

Messages are meant for the user: they say what is wrong, with the values involved, and what to do.
"""

__all__ = [
    "ArrayFileError",
    "BnadaptError",
    "InvalidPageTokenError",
    "ObjectNotFoundError",
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


class ObjectNotFoundError(StoreError):
    """No object with that sha256 is in the store."""


class ArrayFileError(BnadaptError):
    """A dataset file is unreadable or breaks the dataset rules."""


class WeightsFileError(BnadaptError):
    """A weights file is not an acceptable safetensors file."""


class InvalidPageTokenError(BnadaptError):
    """A page token that this service did not hand out."""
