"""Dataset files: recognized by their content (service/formats/sniff.py), checked, then read with
numpy. Weights files: service/formats/weights.py.

A dataset holds ``x`` of shape (N, *sample_shape) and an optional ``y`` with one entry per
sample, in an ``.npz`` (never unpickled) or a ``.safetensors`` file. The rules:

- ``x`` is float32 or uint8, N >= 1, at least one non-empty dimension per sample, finite.
- ``y`` has N entries. Integer ``y`` holds class labels: 1-D, each in 0..max_classes-1, read as
  int64 (any integer dtype is accepted: widening is lossless). Float16/float32 ``y`` holds
  regression targets, finite, read as float32.
- Lossy conversions are refused, not done silently: float64 data must be converted by the user,
  who then knows what the service trains on.

Sizes and counts are checked from the file headers before any data is read, so a hostile file
(a compressed npz that inflates, a header with a million entries) costs little: see NOTE
[ Compressed npz members ].
"""

import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError, safe_open

from api_schemas.datasets import ArrayFormat, LabelKind, SampleDtype
from service.errors import ArrayFileError, ArrayLimitError
from service.formats.sniff import check_safetensors_header, safetensors_specs, sniff, what_it_is

__all__ = [
    "DEFAULT_MAX_CLASSES",
    "DEFAULT_MAX_ELEMENTS",
    "ArrayFacts",
    "LoadedArrays",
    "describe_arrays",
    "read_arrays",
    "sniff_format",
]

DEFAULT_MAX_ELEMENTS: Final = 1 << 30  # x and y together: 4 GiB as float32
DEFAULT_MAX_CLASSES: Final = 100_000
_MAX_ARRAYS_HEADER_BYTES: Final = 1 << 20  # two tensors and some metadata
# An npz member this small may inflate any number of times (NOTE [ Compressed npz members ]).
_RATIO_FREE_BYTES: Final = 64 << 20

_HOW_TO_SAVE: Final = (
    "save the arrays with numpy.savez(path, x=x, y=y) or "
    "safetensors.numpy.save_file({'x': x, 'y': y}, path)"
)
_ARRAY_NAMES: Final = ("x", "y")
_X_DTYPES: Final = ("float32", "uint8")
_TARGET_DTYPES: Final = ("float16", "float32")
# safetensors' dtype codes under numpy's names (the float8 codes have none and stay codes).
_SAFETENSORS_DTYPES: Final = {
    "BOOL": "bool",
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}
_INT_DTYPES: Final = frozenset(v for k, v in _SAFETENSORS_DTYPES.items() if k[0] in "IU")


@dataclass(frozen=True)
class LoadedArrays:
    """A validated dataset, in native byte order."""

    x: npt.NDArray[Any]  # (N, *sample_shape) float32 or uint8
    y: npt.NDArray[Any] | None  # (N,) int64 class labels, or (N, ...) float32 targets

    @property
    def label_kind(self) -> LabelKind | None:
        if self.y is None:
            return None
        return "class" if self.y.dtype == np.int64 else "target"

    @property
    def num_classes(self) -> int | None:
        """Largest class label + 1; None without class labels."""
        if self.y is None or self.label_kind != "class":
            return None
        return int(self.y.max()) + 1


@dataclass(frozen=True)
class ArrayFacts:
    """What a dataset upload is described by (the file-derived part of ``DatasetPublic``)."""

    format: ArrayFormat
    num_samples: int
    sample_shape: tuple[int, ...]
    dtype: SampleDtype
    has_labels: bool
    label_kind: LabelKind | None
    num_classes: int | None


@dataclass(frozen=True)
class _Spec:
    shape: tuple[int, ...]
    dtype: str  # numpy's name where numpy has one


def sniff_format(path: Path) -> ArrayFormat:
    """The format of a dataset file, from its first bytes (never from its name).

    Raises ``ArrayFileError`` for anything but a zip (npz) or safetensors file.
    """
    kind, head = sniff(path)
    if kind == "zip":
        return "npz"
    if kind == "safetensors":
        return "safetensors"
    raise ArrayFileError(
        f"this is {what_it_is(kind, head)}, not an .npz or .safetensors dataset: {_HOW_TO_SAVE}"
    )


def _check_names(names: list[str]) -> None:
    """Refuses anything but x and an optional y, before any array header is read."""
    if len(set(names)) != len(names) or not set(names) <= set(_ARRAY_NAMES) or "x" not in names:
        listed = sorted(names)[:10] + (["..."] if len(names) > 10 else [])
        raise ArrayFileError(
            f"the file holds the arrays {listed}, but a dataset holds exactly 'x' and "
            f"optionally 'y': {_HOW_TO_SAVE}"
        )


def _check_specs(specs: dict[str, _Spec], max_elements: int) -> None:
    """Applies the dataset rules that the headers alone decide."""
    x = specs["x"]
    if x.dtype == "object":
        raise ArrayFileError(
            "x is an object array (dtype=object), which can only be stored as a pickle; "
            "make it numeric with numpy.asarray(x, dtype=numpy.float32) before saving"
        )
    if x.dtype not in _X_DTYPES:
        raise ArrayFileError(
            f"x has dtype {x.dtype}, but x must be float32 or uint8: convert it with "
            "x.astype(numpy.float32) before saving"
        )
    if len(x.shape) < 2:
        raise ArrayFileError(
            f"x has shape {x.shape}, but it needs the shape (num_samples, *sample_shape) with "
            "at least one dimension per sample: for one feature per sample use x.reshape(-1, 1)"
        )
    if x.shape[0] == 0:
        raise ArrayFileError(f"x has no samples (shape {x.shape}); upload at least one sample")
    if 0 in x.shape[1:]:
        raise ArrayFileError(f"x has shape {x.shape}: every sample is empty")
    elements = math.prod(x.shape) + (math.prod(specs["y"].shape) if "y" in specs else 0)
    if elements > max_elements:
        raise ArrayFileError(
            f"x and y hold {elements} numbers, more than the limit of {max_elements}; split "
            "the dataset into smaller files"
        )
    if "y" in specs:
        _check_label_spec(specs["y"], num_samples=x.shape[0])


def _check_label_spec(y: _Spec, num_samples: int) -> None:
    if y.dtype == "float64":
        raise ArrayFileError(
            "y has dtype float64: store regression targets as float32 "
            "(y.astype(numpy.float32)) or class labels as int64 (y.astype(numpy.int64))"
        )
    if y.dtype not in _INT_DTYPES and y.dtype not in _TARGET_DTYPES:
        raise ArrayFileError(
            f"y has dtype {y.dtype}, but y must hold integer class labels (int64) or float32 "
            "regression targets: convert it with y.astype(numpy.int64) or "
            "y.astype(numpy.float32)"
        )
    if not y.shape or y.shape[0] != num_samples:
        entries = y.shape[0] if y.shape else "no"
        raise ArrayFileError(
            f"y has {entries} entries (shape {y.shape}) but x has {num_samples} samples; "
            "give exactly one label per sample"
        )
    if y.dtype in _INT_DTYPES and len(y.shape) != 1:
        raise ArrayFileError(
            f"y holds integer class labels with shape {y.shape}, but class labels need the "
            "shape (num_samples,): use y.reshape(-1)"
        )


def _npy_spec(file: IO[bytes], member: str) -> _Spec:
    try:
        version = np.lib.format.read_magic(file)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(file)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(file)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except ValueError as exc:
        raise ArrayFileError(
            f"{member} in the npz is not a readable .npy array ({exc}); {_HOW_TO_SAVE}"
        ) from exc
    name = "object" if dtype.hasobject else dtype.name if dtype.fields is None else str(dtype)
    return _Spec(tuple(shape), name)


# NOTE [ Compressed npz members ]
# Reading a member allocates what its .npy header declares (shape x itemsize), whatever the
# member's size in the zip: a 1 MiB member of deflated zeros declaring 1.4 GB made the API
# allocate 1.4 GB. Before any data is read, each member must declare no more bytes than the
# zip says it uncompresses to (else it is truncated or lying), and with ``max_ratio`` (the API,
# on uploads) a member over ``_RATIO_FREE_BYTES`` must uncompress to at most ``max_ratio``
# times its compressed size. zipfile stops a member's output at its declared uncompressed
# size, so the memory a read takes is bounded by ``max_ratio`` times the upload's size (or
# ``_RATIO_FREE_BYTES`` per member: small label arrays of one class compress 1000 times).
# Workers read files the API already checked and pass no ratio, so raising the setting needs no
# change on them.


def _check_member_size(
    info: zipfile.ZipInfo, spec: _Spec, max_ratio: float | None, header_bytes: int
) -> None:
    """See NOTE [ Compressed npz members ]."""
    declared = math.prod(spec.shape) * np.dtype(spec.dtype).itemsize
    if declared > info.file_size - header_bytes:
        raise ArrayFileError(
            f"{info.filename} in the npz declares {declared} bytes of data (shape "
            f"{spec.shape}, {spec.dtype}) but holds only {info.file_size - header_bytes}; the "
            f"file is truncated or damaged: {_HOW_TO_SAVE}"
        )
    if max_ratio is None or info.file_size <= _RATIO_FREE_BYTES:
        return
    ratio = info.file_size / max(info.compress_size, 1)
    if ratio > max_ratio:
        raise ArrayLimitError(
            f"{info.filename} in the npz uncompresses to {info.file_size} bytes, {ratio:.0f} "
            f"times its compressed size of {info.compress_size} bytes; the limit is "
            f"{max_ratio:g} times (setting BNADAPT_MAX_NPZ_RATIO), so that a small upload "
            "cannot take gigabytes of memory to read. Save the arrays uncompressed with "
            "numpy.savez (the upload size limit then applies), or ask the operator to raise "
            "BNADAPT_MAX_NPZ_RATIO"
        )


def _read_npz(
    path: Path, max_elements: int, max_ratio: float | None = None
) -> dict[str, npt.NDArray[Any]]:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            if any(name.endswith("data.pkl") for name in names):
                raise ArrayFileError(
                    "this is a PyTorch file (torch.save: a pickle inside a zip); loading it "
                    f"can run code, so it is refused: {_HOW_TO_SAVE}, e.g. x=tensor.numpy()"
                )
            # np.savez stores array `a` as the member `a.npy`. A member without the suffix is
            # still only ever parsed as .npy, so accepting it is harmless.
            keys = [name.removesuffix(".npy") for name in names]
            _check_names(keys)
            arrays = dict(zip(keys, names, strict=True))
            specs = {}
            header_bytes = {}
            for key, member in arrays.items():
                with archive.open(member) as file:
                    specs[key] = _npy_spec(file, member)
                    header_bytes[key] = file.tell()
            _check_specs(specs, max_elements)
            for key, member in arrays.items():
                _check_member_size(
                    archive.getinfo(member), specs[key], max_ratio, header_bytes[key]
                )
            loaded = {}
            for key, member in arrays.items():
                with archive.open(member) as file:
                    loaded[key] = np.lib.format.read_array(file, allow_pickle=False)
            return loaded
    except ValueError as exc:
        # np.lib.format refuses object arrays (allow_pickle=False) and short data with it.
        raise ArrayFileError(f"the npz could not be read: {exc}; {_HOW_TO_SAVE}") from exc
    except (zipfile.BadZipFile, EOFError, NotImplementedError, RuntimeError) as exc:
        # A corrupt or truncated zip (bad CRC), unsupported compression, encrypted members.
        raise ArrayFileError(
            f"the npz (zip) file is damaged or uses unsupported features ({exc}); upload it "
            f"again or {_HOW_TO_SAVE}"
        ) from exc


def _read_safetensors(path: Path, max_elements: int) -> dict[str, npt.NDArray[Any]]:
    check_safetensors_header(path, _MAX_ARRAYS_HEADER_BYTES, ArrayFileError)
    try:
        with safe_open(str(path), framework="numpy") as opened:
            _check_names([str(key) for key in opened.keys()])  # noqa: SIM118  # no __iter__
            raw = safetensors_specs(opened)
            specs = {
                k: _Spec(shape, _SAFETENSORS_DTYPES.get(d, d)) for k, (shape, d) in raw.items()
            }
            _check_specs(specs, max_elements)
            return {key: np.asarray(opened.get_tensor(key)) for key in specs}
    except SafetensorError as exc:
        raise ArrayFileError(
            f"not a valid safetensors file ({exc}); it may be truncated or corrupt: upload it again"
        ) from exc


def _check_values(
    x: npt.NDArray[Any], y: npt.NDArray[Any] | None, max_classes: int
) -> LoadedArrays:
    """Applies the dataset rules that need the data, and converts to the canonical dtypes."""
    x = x.astype(x.dtype.newbyteorder("="), copy=False)
    if x.dtype == np.float32:
        _check_finite(x, "x")
    if y is None:
        return LoadedArrays(x, None)
    if y.dtype.kind in "iu":
        negative = int(np.count_nonzero(y < 0))
        if negative:
            raise ArrayFileError(
                f"y contains {negative} negative class labels (smallest {int(y.min())}); class "
                "labels must be 0..num_classes-1: remap them, e.g. with "
                "numpy.unique(y, return_inverse=True)[1]"
            )
        largest = int(y.max())
        if largest >= max_classes:
            raise ArrayFileError(
                f"y's largest class label is {largest}, so a model would need {largest + 1} "
                f"outputs; at most {max_classes} classes are allowed: remap the labels with "
                "numpy.unique(y, return_inverse=True)[1], or store regression targets as float32"
            )
        return LoadedArrays(x, y.astype(np.int64, copy=False))
    _check_finite(y, "y")
    return LoadedArrays(x, y.astype(np.float32, copy=False))


def _check_finite(array: npt.NDArray[Any], name: str) -> None:
    finite = np.isfinite(array)
    bad = array.size - int(np.count_nonzero(finite))
    if bad:
        first = int(np.argmin(finite.reshape(len(array), -1).all(axis=1)))
        raise ArrayFileError(
            f"{name} contains {bad} non-finite values (NaN or Inf), the first in sample {first}; "
            "replace them before uploading, e.g. with numpy.nan_to_num"
        )


def read_arrays(
    path: Path,
    format: ArrayFormat | None = None,
    *,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    max_classes: int = DEFAULT_MAX_CLASSES,
    max_ratio: float | None = None,
) -> LoadedArrays:
    """Reads and validates a dataset file; raises ``ArrayFileError`` naming what to fix
    (``ArrayLimitError`` for an npz member that inflates more than ``max_ratio`` times: see
    NOTE [ Compressed npz members ]).

    ``format`` is detected from the content when None; when given, the content must agree.
    """
    found = sniff_format(path)
    if format is not None and format != found:
        raise ArrayFileError(
            f"the file was declared {format} but its content is {found}; declare the format "
            "that matches the content, or none"
        )
    arrays = (
        _read_npz(path, max_elements, max_ratio)
        if found == "npz"
        else _read_safetensors(path, max_elements)
    )
    return _check_values(arrays["x"], arrays.get("y"), max_classes)


def describe_arrays(
    path: Path,
    format: ArrayFormat | None = None,
    *,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    max_classes: int = DEFAULT_MAX_CLASSES,
    max_ratio: float | None = None,
) -> ArrayFacts:
    """Reads and validates a dataset file (see :func:`read_arrays`) and returns its facts."""
    found = format or sniff_format(path)
    arrays = read_arrays(
        path, found, max_elements=max_elements, max_classes=max_classes, max_ratio=max_ratio
    )
    return ArrayFacts(
        format=found,
        num_samples=int(arrays.x.shape[0]),
        sample_shape=tuple(int(d) for d in arrays.x.shape[1:]),
        dtype="float32" if arrays.x.dtype == np.float32 else "uint8",
        has_labels=arrays.y is not None,
        label_kind=arrays.label_kind,
        num_classes=arrays.num_classes,
    )
