"""Dataset files: recognized by their content (service/formats/sniff.py), checked, then read with
numpy. Weights files: service/formats/weights.py. Image datasets: service/formats/images.py.

A dataset holds ``x`` of shape (N, *sample_shape) and an optional ``y`` with one entry per
sample, in an ``.npz`` (never unpickled) or a ``.safetensors`` file. The rules:

- ``x`` is float32 or uint8, N >= 1, at least one non-empty dimension per sample, finite.
- ``y`` has N entries. Integer ``y`` holds class labels: 1-D, each in 0..max_classes-1, read as
  int64 (any integer dtype is accepted: widening is lossless). Float16/float32 ``y`` holds
  regression targets, finite, read as float32.
- Lossy conversions are refused, not done silently: float64 data must be converted by the user,
  who then knows what the service trains on.
- Arrays are stored in C order (row-major), so that a batch of samples is one run of bytes.

# NOTE [ Reading datasets in bounded memory ]
A dataset may be far larger than the memory of the API or of a worker (the limits are in
service/settings.py, one set for both). Nothing here holds a whole array:

- Sizes, counts and dtypes are checked from the file headers before any data is read
  (:func:`locate_arrays`), so a hostile file (a header with a million entries, an npz member
  that inflates) costs little.
- Registration (:func:`describe_arrays`) checks the values block by block with plain reads into
  one buffer of at most ``_BLOCK_BYTES``: the API's memory does not grow with the file (a
  memory map would not do here: its pages count in the process's resident memory).
- Workers (:func:`open_arrays`) memory-map ``x`` where its bytes lie uncompressed in the file
  (safetensors, stored npz members): a batch is read, and converted, when it is used. Only a
  compressed npz member is read whole; ``y`` (one label per sample) is read whole.

One concept, a dataset file, from its headers to its batches; its NOTE blocks map it.
"""

import json
import math
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError, safe_open

from api_schemas.datasets import ArrayFormat, LabelKind, SampleDtype
from service.errors import ArrayFileError, ArrayLimitError
from service.formats.sniff import check_safetensors_header, safetensors_specs, sniff, what_it_is
from service.settings import DEFAULT_MAX_CLASSES, DEFAULT_MAX_DATASET_ELEMENTS

__all__ = [
    "DEFAULT_MAX_CLASSES",
    "DEFAULT_MAX_ELEMENTS",
    "ArrayFacts",
    "LoadedArrays",
    "describe_arrays",
    "locate_arrays",
    "open_arrays",
    "read_arrays",
    "sniff_format",
]

DEFAULT_MAX_ELEMENTS: Final = DEFAULT_MAX_DATASET_ELEMENTS
_MAX_ARRAYS_HEADER_BYTES: Final = 1 << 20  # two tensors and some metadata
_BLOCK_BYTES: Final = 8 << 20  # one read while checking values (NOTE [ Reading datasets ... ])
_ZIP_LOCAL_HEADER: Final = 30  # bytes before a local file header's name and extra field
_ZIP_ENCRYPTED: Final = 0x1

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
    """A dataset opened for reading. ``x`` may be a read-only memory map in the file's byte
    order: convert it a batch at a time (workers/passes/data.py). ``y`` is in memory, in its
    canonical dtype."""

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


@dataclass(frozen=True)
class ArrayLocation:
    """Where one array's bytes are: C-ordered data of ``dtype`` and ``shape`` at ``offset`` of
    the file, or (``offset`` None) in the compressed npz member ``member``."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    offset: int | None
    member: str | None = None


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


def _check_specs(specs: dict[str, _Spec], max_elements: int | None) -> None:
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
    if max_elements is not None and elements > max_elements:
        raise ArrayFileError(
            f"x and y hold {elements} numbers, more than the limit of {max_elements} "
            "(BNADAPT_MAX_DATASET_ELEMENTS, shared by the API and the workers); split the "
            "dataset into smaller files, or raise the limit"
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


def _npy_header(file: IO[bytes], member: str) -> tuple[_Spec, np.dtype[Any], bool]:
    """The spec, numpy dtype and Fortran-order flag of the .npy data ``file`` starts with;
    leaves ``file`` at the first data byte."""
    try:
        version = np.lib.format.read_magic(file)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(file)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(file)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except ValueError as exc:
        raise ArrayFileError(
            f"{member} in the npz is not a readable .npy array ({exc}); {_HOW_TO_SAVE}"
        ) from exc
    name = "object" if dtype.hasobject else dtype.name if dtype.fields is None else str(dtype)
    return _Spec(tuple(shape), name), dtype, bool(fortran)


# An npz member this small may inflate any number of times (NOTE [ Compressed npz members ]).
_RATIO_FREE_BYTES: Final = 64 << 20

# NOTE [ Compressed npz members ]
# A compressed member is read whole by a job (a memory map needs its bytes as they lie in the
# file), so what it uncompresses to is memory a worker spends: with ``max_ratio`` (the API, on
# uploads) a member over ``_RATIO_FREE_BYTES`` must uncompress to at most ``max_ratio`` times
# its compressed size (a 1 MiB member of deflated zeros may declare 1.4 GB). Its declared size
# must also fit what the zip says it holds (else it is truncated or lying). Small label arrays
# of one class compress 1000 times, hence the free size. Workers read files the API already
# checked and pass no ratio, so raising the setting needs no change on them.


def _check_ratio(info: zipfile.ZipInfo, max_ratio: float | None) -> None:
    """See NOTE [ Compressed npz members ]."""
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


def _locate_npz(
    path: Path, max_elements: int | None, max_ratio: float | None = None
) -> dict[str, ArrayLocation]:
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
            specs, headers = {}, {}
            for key, info in zip(keys, archive.infolist(), strict=True):
                if info.flag_bits & _ZIP_ENCRYPTED:
                    raise NotImplementedError(f"{info.filename} is encrypted")
                with archive.open(info) as file:
                    specs[key], dtype, fortran = _npy_header(file, info.filename)
                    header_bytes = file.tell()
                headers[key] = (info, dtype, fortran, header_bytes)
                _check_ratio(info, max_ratio)
            _check_specs(specs, max_elements)
            size = path.stat().st_size
            located = {}
            for key, (info, dtype, fortran, header_bytes) in headers.items():
                shape = specs[key].shape
                if fortran and len(shape) > 1:
                    raise ArrayFileError(
                        f"{key} is stored in Fortran (column-major) order, so a batch of "
                        f"samples is not one run of bytes; save numpy.ascontiguousarray({key})"
                    )
                data_bytes = math.prod(shape) * dtype.itemsize
                if header_bytes + data_bytes > info.file_size:
                    raise ArrayFileError(
                        f"the npz could not be read: {info.filename} promises {data_bytes} bytes "
                        f"of data but holds only {info.file_size - header_bytes}; the file is "
                        f"truncated or damaged: {_HOW_TO_SAVE}"
                    )
                offset = None
                if info.compress_type == zipfile.ZIP_STORED:
                    offset = _member_data_offset(path, info) + header_bytes
                    if offset + data_bytes > size:
                        raise EOFError(f"{info.filename} ends past the end of the file")
                located[key] = ArrayLocation(shape, dtype, offset, info.filename)
            return located
    except ValueError as exc:
        raise ArrayFileError(f"the npz could not be read: {exc}; {_HOW_TO_SAVE}") from exc
    except (zipfile.BadZipFile, EOFError, NotImplementedError, RuntimeError) as exc:
        # A corrupt or truncated zip (bad CRC), unsupported compression, encrypted members.
        raise ArrayFileError(
            f"the npz (zip) file is damaged or uses unsupported features ({exc}); upload it "
            f"again or {_HOW_TO_SAVE}"
        ) from exc


def _member_data_offset(path: Path, info: zipfile.ZipInfo) -> int:
    """Where a member's bytes start: after its local header, whose name and extra field may
    differ in length from the central directory's copy."""
    with path.open("rb") as file:
        file.seek(info.header_offset)
        local = file.read(_ZIP_LOCAL_HEADER)
    if len(local) < _ZIP_LOCAL_HEADER or not local.startswith(b"PK\x03\x04"):
        raise zipfile.BadZipFile(f"bad local header of {info.filename}")
    name_bytes = int.from_bytes(local[26:28], "little")
    extra_bytes = int.from_bytes(local[28:30], "little")
    return info.header_offset + _ZIP_LOCAL_HEADER + name_bytes + extra_bytes


def _locate_safetensors(path: Path, max_elements: int | None) -> dict[str, ArrayLocation]:
    header_bytes = check_safetensors_header(path, _MAX_ARRAYS_HEADER_BYTES, ArrayFileError)
    try:
        with safe_open(str(path), framework="numpy") as opened:
            _check_names([str(key) for key in opened.keys()])  # noqa: SIM118  # no __iter__
            raw = safetensors_specs(opened)
    except SafetensorError as exc:
        raise ArrayFileError(
            f"not a valid safetensors file ({exc}); it may be truncated or corrupt: upload it again"
        ) from exc
    specs = {k: _Spec(shape, _SAFETENSORS_DTYPES.get(d, d)) for k, (shape, d) in raw.items()}
    _check_specs(specs, max_elements)
    # safe_open checked that the offsets lie in the file and that the tensors tile the data.
    with path.open("rb") as file:
        file.seek(8)
        header = json.loads(file.read(header_bytes))
    return {
        key: ArrayLocation(
            spec.shape,
            np.dtype(spec.dtype).newbyteorder("<"),  # safetensors is little-endian
            8 + header_bytes + int(header[key]["data_offsets"][0]),
        )
        for key, spec in specs.items()
    }


def locate_arrays(
    path: Path,
    format: ArrayFormat | None = None,
    *,
    max_elements: int | None = DEFAULT_MAX_ELEMENTS,
    max_ratio: float | None = None,
) -> dict[str, ArrayLocation]:
    """Where ``x`` (and ``y``) lie in a dataset file, with every rule the headers decide checked
    (``max_elements`` None: no element limit; ``max_ratio``: NOTE [ Compressed npz members ],
    ``ArrayLimitError`` past it); no data is read. ``format`` is detected from the
    content when None; when given, the content must agree."""
    found = sniff_format(path)
    if format is not None and format != found:
        raise ArrayFileError(
            f"the file was declared {format} but its content is {found}; declare the format "
            "that matches the content, or none"
        )
    if found == "npz":
        return _locate_npz(path, max_elements, max_ratio)
    return _locate_safetensors(path, max_elements)


def _blocks(path: Path, where: ArrayLocation, max_bytes: int) -> Iterator[npt.NDArray[Any]]:
    """The array's rows, a block of at most ``max_bytes`` (at least one row) at a time, read
    into one reused buffer: a block is valid until the next one is asked for. A compressed or
    stored npz member is read through zipfile, which checks its CRC at the end."""
    row_shape = where.shape[1:]
    row_bytes = max(math.prod(row_shape) * where.dtype.itemsize, 1)
    rows = max(max_bytes // row_bytes, 1)
    buffer = bytearray(rows * row_bytes)
    archive = None
    try:
        if where.member is not None:
            archive = zipfile.ZipFile(path)
            file: IO[bytes] = archive.open(where.member)
            _npy_header(file, where.member)
        else:
            file = path.open("rb")
            assert where.offset is not None
            file.seek(where.offset)
        with file:
            left = where.shape[0]
            while left:
                count = min(rows, left)
                view = memoryview(buffer)[: count * row_bytes]
                got = 0
                while got < len(view):
                    n = file.readinto(view[got:])  # type: ignore[attr-defined]
                    if not n:
                        raise EOFError(f"the data of the array ends after {got} bytes")
                    got += n
                yield np.frombuffer(view, dtype=where.dtype).reshape(count, *row_shape)
                left -= count
            if where.member is not None:
                file.read()  # to the member's end: zipfile checks the CRC there
    finally:
        if archive is not None:
            archive.close()


def _check_values(path: Path, located: dict[str, ArrayLocation], max_classes: int) -> int | None:
    """Applies the dataset rules that need the data, a block at a time; returns the number of
    classes (largest label + 1) for class labels, else None."""
    try:
        if located["x"].dtype.kind == "f":
            _check_finite(path, located["x"], "x")
        if "y" not in located:
            return None
        y = located["y"]
        if y.dtype.kind == "f":
            _check_finite(path, y, "y")
            return None
        return _check_class_labels(path, y, max_classes)
    except (EOFError, zipfile.BadZipFile) as exc:
        raise ArrayFileError(
            f"the dataset file is damaged or truncated ({exc}); upload it again or {_HOW_TO_SAVE}"
        ) from exc


def _check_class_labels(path: Path, where: ArrayLocation, max_classes: int) -> int:
    negative, smallest, largest = 0, 0, 0
    for block in _blocks(path, where, _BLOCK_BYTES):
        negative += int(np.count_nonzero(block < 0))
        smallest = min(smallest, int(block.min()))
        largest = max(largest, int(block.max()))
    if negative:
        raise ArrayFileError(
            f"y contains {negative} negative class labels (smallest {smallest}); class "
            "labels must be 0..num_classes-1: remap them, e.g. with "
            "numpy.unique(y, return_inverse=True)[1]"
        )
    if largest >= max_classes:
        raise ArrayFileError(
            f"y's largest class label is {largest}, so a model would need {largest + 1} "
            f"outputs; at most {max_classes} classes are allowed (BNADAPT_MAX_CLASSES): remap "
            "the labels with numpy.unique(y, return_inverse=True)[1], or store regression "
            "targets as float32"
        )
    return largest + 1


def _check_finite(path: Path, where: ArrayLocation, name: str) -> None:
    bad, first, seen = 0, -1, 0
    for block in _blocks(path, where, _BLOCK_BYTES):
        finite = np.isfinite(block)
        found = block.size - int(np.count_nonzero(finite))
        if found and first < 0:
            first = seen + int(np.argmin(finite.reshape(len(block), -1).all(axis=1)))
        bad += found
        seen += len(block)
    if bad:
        raise ArrayFileError(
            f"{name} contains {bad} non-finite values (NaN or Inf), the first in sample {first}; "
            "replace them before uploading, e.g. with numpy.nan_to_num"
        )


def describe_arrays(
    path: Path,
    format: ArrayFormat | None = None,
    *,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    max_classes: int = DEFAULT_MAX_CLASSES,
    max_ratio: float | None = None,
) -> ArrayFacts:
    """Checks a dataset file against every rule, in bounded memory (NOTE [ Reading datasets in
    bounded memory ]), and returns its facts; raises ``ArrayFileError`` naming what to fix.
    ``format`` is detected from the content when None; when given, the content must agree."""
    found = format or sniff_format(path)
    located = locate_arrays(path, found, max_elements=max_elements, max_ratio=max_ratio)
    num_classes = _check_values(path, located, max_classes)
    x = located["x"]
    label_kind: LabelKind | None = None
    if "y" in located:
        label_kind = "target" if located["y"].dtype.kind == "f" else "class"
    return ArrayFacts(
        format=found,
        num_samples=int(x.shape[0]),
        sample_shape=tuple(int(d) for d in x.shape[1:]),
        dtype="float32" if x.dtype.kind == "f" else "uint8",
        has_labels="y" in located,
        label_kind=label_kind,
        num_classes=num_classes,
    )


def _open_array(path: Path, where: ArrayLocation) -> npt.NDArray[Any]:
    if where.offset is not None:
        if math.prod(where.shape) == 0:
            return np.empty(where.shape, where.dtype)
        return np.memmap(path, where.dtype, "r", where.offset, where.shape)
    assert where.member is not None
    with zipfile.ZipFile(path) as archive, archive.open(where.member) as file:
        _npy_header(file, where.member)
        return _read_member(file, where)


def _read_member(file: IO[bytes], where: ArrayLocation) -> npt.NDArray[Any]:
    """A compressed npz member's data, read whole (a compressed stream cannot be mapped)."""
    data = np.empty(where.shape, where.dtype)
    view = data.reshape(-1).view(np.uint8).data  # a memoryview of the array's bytes
    got = 0
    while got < len(view):
        n = file.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise ArrayFileError(
                f"{where.member} ends after {got} of {len(view)} data bytes; upload it again"
            )
        got += n
    return data


def open_arrays(path: Path, format: ArrayFormat | None = None) -> LoadedArrays:
    """Opens a registered dataset for a worker: ``x`` memory-mapped where it can be (NOTE
    [ Reading datasets in bounded memory ]), ``y`` read whole in its canonical dtype. The
    values were checked at registration (:func:`describe_arrays`); the headers are checked
    again, with no element limit: a worker's memory does not grow with the dataset."""
    located = locate_arrays(path, format, max_elements=None)
    x = _open_array(path, located["x"])
    if "y" not in located:
        return LoadedArrays(x, None)
    y = _open_array(path, located["y"])
    canonical = np.int64 if y.dtype.kind in "iu" else np.float32
    return LoadedArrays(x, np.array(y, dtype=canonical))


def read_arrays(
    path: Path,
    format: ArrayFormat | None = None,
    *,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    max_classes: int = DEFAULT_MAX_CLASSES,
) -> LoadedArrays:
    """Checks a dataset file (:func:`describe_arrays`) and opens it (:func:`open_arrays`);
    raises ``ArrayFileError`` naming what to fix."""
    found = format or sniff_format(path)
    describe_arrays(path, found, max_elements=max_elements, max_classes=max_classes)
    return open_arrays(path, found)
