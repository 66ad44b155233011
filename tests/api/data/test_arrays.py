"""Dataset and weights files, written for real and read back: what passes, what is refused."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from service.errors import ArrayFileError, ArrayLimitError, BnadaptError, WeightsFileError
from service.formats.arrays import ArrayFacts, describe_arrays, read_arrays, sniff_format
from service.formats.weights import WeightSpec, read_weights_header

RNG = np.random.default_rng(0)
X = RNG.standard_normal((12, 1, 4, 4)).astype(np.float32)
Y = np.arange(12, dtype=np.int64) % 3


def save_npz(path: Path, **arrays: Any) -> Path:
    with path.open("wb") as file:  # a file object: np.savez would append ".npz" to other names
        np.savez(file, **arrays)
    return path


def save_safetensors(path: Path, **arrays: Any) -> Path:
    safetensors.numpy.save_file(arrays, str(path))
    return path


def test_no_torch_import() -> None:
    code = (
        "import sys, service.formats.arrays, service.store.local, service.errors\n"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])


def test_npz_with_class_labels(tmp_path: Path) -> None:
    path = save_npz(tmp_path / "d.npz", x=X, y=Y)
    arrays = read_arrays(path, "npz")
    np.testing.assert_array_equal(arrays.x, X)
    assert arrays.y is not None
    np.testing.assert_array_equal(arrays.y, Y)
    assert arrays.label_kind == "class"
    assert arrays.num_classes == 3
    assert describe_arrays(path) == ArrayFacts(
        format="npz",
        num_samples=12,
        sample_shape=(1, 4, 4),
        dtype="float32",
        has_labels=True,
        label_kind="class",
        num_classes=3,
    )


def test_compressed_npz_uint8_without_labels(tmp_path: Path) -> None:
    images = RNG.integers(0, 256, size=(5, 3, 2, 2), dtype=np.uint8)
    path = tmp_path / "d.npz"
    np.savez_compressed(path, x=images)
    arrays = read_arrays(path)
    np.testing.assert_array_equal(arrays.x, images)
    assert arrays.y is None
    assert arrays.label_kind is None
    assert arrays.num_classes is None
    facts = describe_arrays(path)
    assert (facts.dtype, facts.has_labels, facts.num_classes) == ("uint8", False, None)


def test_safetensors_with_targets(tmp_path: Path) -> None:
    targets = RNG.standard_normal((12, 2)).astype(np.float32)
    path = save_safetensors(tmp_path / "d.safetensors", x=X, y=targets)
    assert sniff_format(path) == "safetensors"
    arrays = read_arrays(path, "safetensors")
    assert arrays.y is not None
    np.testing.assert_array_equal(arrays.y, targets)
    facts = describe_arrays(path)
    assert (facts.format, facts.label_kind, facts.num_classes) == ("safetensors", "target", None)


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int16, np.uint16, np.uint64, ">i4"])
def test_integer_labels_widen_to_int64(tmp_path: Path, dtype: Any) -> None:
    arrays = read_arrays(save_npz(tmp_path / "d.npz", x=X, y=Y.astype(dtype)))
    assert arrays.y is not None
    assert arrays.y.dtype == np.dtype(np.int64)
    np.testing.assert_array_equal(arrays.y, Y)


def test_float16_targets_widen_to_float32(tmp_path: Path) -> None:
    targets = np.linspace(-1, 1, 12, dtype=np.float16)
    arrays = read_arrays(save_safetensors(tmp_path / "d.safetensors", x=X, y=targets))
    assert arrays.y is not None
    assert arrays.y.dtype == np.dtype(np.float32)
    np.testing.assert_array_equal(arrays.y, targets.astype(np.float32))


def test_big_endian_is_read_as_stored(tmp_path: Path) -> None:
    # x stays in the file's byte order (memory-mapped); workers convert each batch.
    arrays = read_arrays(save_npz(tmp_path / "d.npz", x=X.astype(">f4")))
    np.testing.assert_array_equal(arrays.x, X)


def test_format_must_match_content(tmp_path: Path) -> None:
    path = save_npz(tmp_path / "d.safetensors", x=X)
    assert sniff_format(path) == "npz"  # the name does not matter
    with pytest.raises(ArrayFileError, match="declared safetensors but its content is npz"):
        read_arrays(path, "safetensors")


# Refused files: each message names the problem, the values and what to do.


def test_pickle_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.pkl"
    path.write_bytes(pickle.dumps({"x": X, "y": Y}, protocol=pickle.HIGHEST_PROTOCOL))
    with pytest.raises(ArrayFileError, match=r"Python pickle .* can run code.*numpy\.savez"):
        read_arrays(path)


def test_torch_save_refused(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "d.pt"
    torch.save({"x": torch.from_numpy(X), "y": torch.from_numpy(Y)}, path)
    with pytest.raises(ArrayFileError, match=r"PyTorch file \(torch\.save.*numpy\.savez"):
        read_arrays(path)
    legacy = tmp_path / "legacy.pt"
    torch.save({"x": torch.from_numpy(X)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(ArrayFileError, match="pickle"):
        read_arrays(legacy)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty file"),
        (b"x,y\n1.0,2\n", r"unknown type \(it starts with b'x,y\\n1.0,2'\)"),
        (b"PK\x05\x06" + b"\0" * 18, "unknown type"),
    ],
)
def test_not_a_dataset(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "d.bin"
    path.write_bytes(content)
    with pytest.raises(ArrayFileError, match=message):
        sniff_format(path)


def test_single_npy_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    np.save(path, X)
    with pytest.raises(ArrayFileError, match=r"single numpy \.npy array.*numpy\.savez"):
        read_arrays(path)


def test_object_array_npz(tmp_path: Path) -> None:
    ragged = np.array([np.zeros(2), np.zeros(3)], dtype=object)
    path = tmp_path / "d.npz"
    np.savez(path, x=ragged)  # np.savez pickles object arrays
    with pytest.raises(ArrayFileError, match=r"x is an object array .* numpy\.asarray"):
        read_arrays(path)
    np.savez(path, x=X, y=np.array([None] * 12, dtype=object))
    with pytest.raises(ArrayFileError, match="y has dtype object"):
        read_arrays(path)


def test_non_finite_x(tmp_path: Path) -> None:
    bad = X.copy()
    bad[4, 0, 1, 1] = np.nan
    bad[7, 0, 0, 0] = np.inf
    bad[7, 0, 0, 1] = -np.inf
    with pytest.raises(
        ArrayFileError,
        match=r"x contains 3 non-finite values \(NaN or Inf\), the first in sample 4",
    ):
        read_arrays(save_npz(tmp_path / "d.npz", x=bad))


def test_non_finite_targets(tmp_path: Path) -> None:
    targets = np.zeros(12, dtype=np.float32)
    targets[-1] = np.nan
    with pytest.raises(ArrayFileError, match=r"y contains 1 non-finite values.*sample 11"):
        read_arrays(save_safetensors(tmp_path / "d.safetensors", x=X, y=targets))


def test_negative_labels(tmp_path: Path) -> None:
    with pytest.raises(ArrayFileError, match=r"4 negative class labels \(smallest -1\)"):
        read_arrays(save_npz(tmp_path / "d.npz", x=X, y=Y - 1))


def test_too_many_classes(tmp_path: Path) -> None:
    labels = Y.copy()
    labels[0] = 1000
    path = save_npz(tmp_path / "d.npz", x=X, y=labels)
    with pytest.raises(ArrayFileError, match=r"largest class label is 1000.*at most 100 classes"):
        read_arrays(path, max_classes=100)
    assert read_arrays(path, max_classes=1001).num_classes == 1001


def test_length_mismatch(tmp_path: Path) -> None:
    with pytest.raises(ArrayFileError, match=r"y has 11 entries .* x has 12 samples"):
        read_arrays(save_npz(tmp_path / "d.npz", x=X, y=Y[:11]))


def test_class_labels_must_be_1d(tmp_path: Path) -> None:
    with pytest.raises(ArrayFileError, match=r"shape \(12, 1\).*y\.reshape\(-1\)"):
        read_arrays(save_npz(tmp_path / "d.npz", x=X, y=Y.reshape(-1, 1)))


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (np.zeros((0, 3), np.float32), r"x has no samples \(shape \(0, 3\)\)"),
        (np.zeros((4, 0), np.float32), "every sample is empty"),
        (np.zeros(5, np.float32), r"x has shape \(5,\).*x\.reshape\(-1, 1\)"),
        (np.float32(1.0), r"x has shape \(\)"),
        (X.astype(np.float64), r"x has dtype float64.*x\.astype\(numpy\.float32\)"),
        (X.astype(np.int64), "x has dtype int64"),
    ],
)
def test_bad_x(tmp_path: Path, x: Any, message: str) -> None:
    with pytest.raises(ArrayFileError, match=message):
        read_arrays(save_npz(tmp_path / "d.npz", x=x))


@pytest.mark.parametrize(
    ("y", "message"),
    [
        (Y.astype(np.float64), r"y has dtype float64.*y\.astype\(numpy\.float32\)"),
        (Y.astype(bool), "y has dtype bool"),
        (np.array(["a"] * 12), "y has dtype str"),
    ],
)
def test_bad_y_dtype(tmp_path: Path, y: Any, message: str) -> None:
    with pytest.raises(ArrayFileError, match=message):
        read_arrays(save_npz(tmp_path / "d.npz", x=X, y=y))


def test_bfloat16_x_refused(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    path = tmp_path / "d.safetensors"
    save_file({"x": torch.zeros(4, 3, dtype=torch.bfloat16)}, str(path))
    with pytest.raises(ArrayFileError, match="x has dtype bfloat16"):
        read_arrays(path)


@pytest.mark.parametrize(
    "arrays",
    [{"x": X, "z": Y}, {"y": Y}, {"x": X, "y": Y, "x2": X}],
)
def test_only_x_and_y(tmp_path: Path, arrays: dict[str, Any]) -> None:
    names = str(sorted(arrays)).replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ArrayFileError, match=f"holds the arrays {names}"):
        read_arrays(save_npz(tmp_path / "d.npz", **arrays))
    with pytest.raises(ArrayFileError, match=f"holds the arrays {names}"):
        read_arrays(save_safetensors(tmp_path / "d.safetensors", **arrays))


def test_many_npz_members_listed_briefly(tmp_path: Path) -> None:
    path = save_npz(tmp_path / "d.npz", x=X, **{f"a{i:02}": Y for i in range(30)})
    with pytest.raises(ArrayFileError, match=r"'a09', '\.\.\.'\]"):
        read_arrays(path)


def test_element_limit_checked_from_headers(tmp_path: Path) -> None:
    # 4 MB of zeros compress to a few KB: the limit must hold before inflating.
    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, x=np.zeros((1000, 1000), np.float32))
    assert path.stat().st_size < 100_000
    with pytest.raises(ArrayFileError, match="hold 1000000 numbers, more than the limit of 999999"):
        read_arrays(path, max_elements=999_999)
    assert read_arrays(path, max_elements=1_000_000).x.shape == (1000, 1000)


def test_truncated_npz(tmp_path: Path) -> None:
    data = save_npz(tmp_path / "d.npz", x=X, y=Y).read_bytes()
    truncated = tmp_path / "t.npz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArrayFileError, match="damaged"):
        read_arrays(truncated)


def test_corrupt_npz_member(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", b"not an npy header at all")
    with pytest.raises(ArrayFileError, match=r"x\.npy in the npz is not a readable \.npy"):
        read_arrays(path)


def test_short_npz_member_data(tmp_path: Path) -> None:
    # A valid header that promises more data than the member holds.
    member = tmp_path / "x.npy"
    np.save(member, X)
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", member.read_bytes()[:-10])
    # Refused from the sizes in the headers, before an array is allocated.
    with pytest.raises(ArrayFileError, match=r"holds only .* truncated or damaged"):
        read_arrays(path)


def test_npz_member_that_inflates_past_the_ratio(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez_compressed(path, x=np.zeros((17_000, 1000), np.float32))  # 68 MB of zeros
    with pytest.raises(ArrayLimitError, match=r"the limit is 100 times \(setting BNADAPT_MAX"):
        describe_arrays(path, max_ratio=100)
    assert describe_arrays(path, max_ratio=2000).num_samples == 17_000
    assert read_arrays(path).x.shape == (17_000, 1000)  # workers: the API checked it


def test_truncated_safetensors(tmp_path: Path) -> None:
    data = save_safetensors(tmp_path / "d.safetensors", x=X, y=Y).read_bytes()
    short_data = tmp_path / "a.safetensors"
    short_data.write_bytes(data[:-4])
    with pytest.raises(ArrayFileError, match=r"not a valid safetensors file.*truncated"):
        read_arrays(short_data)
    short_header = tmp_path / "b.safetensors"
    short_header.write_bytes(data[:40])
    with pytest.raises(ArrayFileError, match=r"truncated safetensors file: its header declares"):
        read_arrays(short_header)


def test_oversized_safetensors_header(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    safetensors.numpy.save_file({"x": X}, str(path), metadata={"notes": "n" * 2_000_000})
    with pytest.raises(ArrayFileError, match=r"header is .* bytes, more than the limit"):
        read_arrays(path)


# Weights headers.


def test_weights_header(tmp_path: Path) -> None:
    path = save_safetensors(
        tmp_path / "w.safetensors",
        **{
            "conv.weight": np.zeros((8, 1, 3, 3), np.float32),
            "bn.num_batches_tracked": np.array(0, np.int64),
        },
    )
    assert read_weights_header(path) == {
        "conv.weight": WeightSpec((8, 1, 3, 3), "F32"),
        "bn.num_batches_tracked": WeightSpec((), "I64"),
    }


def test_weights_header_of_torch_state_dict(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).to(torch.bfloat16)
    path = tmp_path / "w.safetensors"
    save_file(model.state_dict(), str(path))
    header = read_weights_header(path)
    assert header["0.weight"] == WeightSpec((2, 3), "BF16")
    assert header["1.num_batches_tracked"] == WeightSpec((), "I64")
    assert set(header) == set(model.state_dict())


def test_weights_refuse_torch_checkpoints(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    state = torch.nn.Linear(3, 2).state_dict()
    path = tmp_path / "w.pt"
    torch.save(state, path)
    with pytest.raises(WeightsFileError, match=r"zip file.*torch\.save.*safetensors only"):
        read_weights_header(path)
    torch.save(state, path, _use_new_zipfile_serialization=False)
    with pytest.raises(WeightsFileError, match=r"pickle.*safetensors\.torch\.save_file"):
        read_weights_header(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (pickle.dumps({"w": [1.0]}), "Python pickle"),
        (b"", "empty file"),
        (b"\x93NUMPY", "numpy .npy array"),
        (b"GGUF\x03\x00\x00\x00", "unknown type"),
    ],
)
def test_weights_refuse_other_content(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "w.bin"
    path.write_bytes(content)
    with pytest.raises(WeightsFileError, match=message):
        read_weights_header(path)


def test_weights_truncated(tmp_path: Path) -> None:
    data = save_safetensors(tmp_path / "w.safetensors", w=np.zeros((64, 64), np.float32))
    short = tmp_path / "short.safetensors"
    short.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(WeightsFileError, match="not a valid safetensors file"):
        read_weights_header(short)
    short.write_bytes(data.read_bytes()[:30])
    with pytest.raises(WeightsFileError, match="truncated safetensors file"):
        read_weights_header(short)


def test_weights_lying_header(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}})
    raw = header.encode()
    path = tmp_path / "w.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 16)
    with pytest.raises(WeightsFileError, match="not a valid safetensors file"):
        read_weights_header(path)


def test_weights_key_and_header_limits(tmp_path: Path) -> None:
    path = save_safetensors(
        tmp_path / "w.safetensors", **{f"t{i}": np.zeros(1, np.float32) for i in range(3)}
    )
    assert len(read_weights_header(path, max_keys=3)) == 3
    with pytest.raises(WeightsFileError, match="holds 3 tensors, more than the limit of 2"):
        read_weights_header(path, max_keys=2)
    with pytest.raises(WeightsFileError, match="more than the limit of 16"):
        read_weights_header(path, max_header_bytes=16)


def test_errors_share_the_root() -> None:
    assert issubclass(ArrayFileError, BnadaptError)
    assert issubclass(WeightsFileError, BnadaptError)


# Reading in bounded memory (NOTE [ Reading datasets in bounded memory ]).


def test_workers_map_x_and_read_y(tmp_path: Path) -> None:
    from service.formats.arrays import open_arrays

    stored = open_arrays(save_npz(tmp_path / "d.npz", x=X, y=Y.astype(np.int32)))
    mapped = open_arrays(save_safetensors(tmp_path / "d.safetensors", x=X, y=Y))
    for arrays in (stored, mapped):
        assert isinstance(arrays.x, np.memmap)
        np.testing.assert_array_equal(arrays.x, X)
        assert arrays.y is not None and arrays.y.dtype == np.int64
        np.testing.assert_array_equal(arrays.y, Y)
    compressed = tmp_path / "c.npz"
    np.savez_compressed(compressed, x=X)
    whole = open_arrays(compressed)
    assert not isinstance(whole.x, np.memmap)
    np.testing.assert_array_equal(whole.x, X)


def test_values_checked_block_by_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import service.formats.arrays as arrays_module

    monkeypatch.setattr(arrays_module, "_BLOCK_BYTES", 64)  # one sample (64 bytes) a block
    bad = X.copy()
    bad[7, 0, 1, 1] = np.nan
    bad[9, 0, 0, 0] = np.inf
    for path in (
        save_npz(tmp_path / "d.npz", x=bad),
        save_safetensors(tmp_path / "d.safetensors", x=bad),
    ):
        with pytest.raises(ArrayFileError, match=r"x contains 2 non-finite .* sample 7"):
            describe_arrays(path)
    labels = Y.copy()
    labels[11] = 41
    facts = describe_arrays(save_npz(tmp_path / "l.npz", x=X, y=labels))
    assert facts.num_classes == 42


def test_fortran_order_refused(tmp_path: Path) -> None:
    path = save_npz(tmp_path / "d.npz", x=np.asfortranarray(X.reshape(12, 16)))
    with pytest.raises(ArrayFileError, match=r"Fortran .* numpy\.ascontiguousarray\(x\)"):
        describe_arrays(path)


def test_truncated_stored_member_data(tmp_path: Path) -> None:
    data = save_npz(tmp_path / "d.npz", x=X).read_bytes()
    cut = tmp_path / "t.npz"
    # The central directory survives, the member's data does not: a lying zip.
    with zipfile.ZipFile(tmp_path / "d.npz") as archive:
        info = archive.getinfo("x.npy")
    broken = bytearray(data)
    broken[info.header_offset + 200 : info.header_offset + 300] = b"\xff" * 100
    cut.write_bytes(bytes(broken))
    with pytest.raises(ArrayFileError, match="damaged"):
        describe_arrays(cut)
