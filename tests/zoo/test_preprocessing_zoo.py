"""The preprocessing spec against the libraries' own evaluation transforms, on real JPEGs:
``decode_image`` (what a job decodes) within 1/255 per pixel of torchvision's and timm's
transforms, and the spec each architecture resolves to (``"preprocessing": "model"``).
Runs in the zoo environment (torchvision and timm); skipped without them."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from api_schemas.datasets import Preprocessing
from harness.photos import JPEGS
from service.formats.images import decode_image

torch = pytest.importorskip("torch")
transforms = pytest.importorskip("torchvision.transforms")
torchvision = pytest.importorskip("torchvision")
timm = pytest.importorskip("timm")
timm_data = pytest.importorskip("timm.data")
Image = pytest.importorskip("PIL.Image")

pytestmark = pytest.mark.zoo

ONE_LEVEL = 1 / 255 + 1e-6
MAX_PIXELS = 1 << 26


def ours(data: bytes, spec: Preprocessing) -> torch.Tensor:
    """What a job makes of the image: decode_image, then scale and normalise as the worker
    does (workers/passes/images.py)."""
    pixels = torch.from_numpy(decode_image(data, "photo", spec, MAX_PIXELS).copy())
    x = pixels.float() / 255
    if spec.mean is not None and spec.std is not None:
        mean = torch.tensor(spec.mean).view(-1, 1, 1)
        std = torch.tensor(spec.std).view(-1, 1, 1)
        x = (x - mean) / std
    return x


def assert_within_one_level(
    data: bytes, spec: Preprocessing, theirs: torch.Tensor, std: list[float]
) -> None:
    got = ours(data, spec)
    assert got.shape == theirs.shape
    # Compared in pixel units: (normalised difference) * std is the difference in [0, 1].
    scale = torch.tensor(std).view(-1, 1, 1)
    worst = float(((got - theirs).abs() * scale).max())
    assert worst <= ONE_LEVEL, f"largest difference {worst * 255:.3f} / 255"


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


@pytest.mark.parametrize("size", sorted(JPEGS))
@pytest.mark.parametrize("interpolation", ["nearest", "bilinear", "bicubic", "lanczos"])
def test_resize_shorter_and_crop_match_torchvision(
    size: tuple[int, int], interpolation: str
) -> None:
    mode = transforms.InterpolationMode(interpolation)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    theirs = transforms.Compose(
        [
            transforms.Resize(256, interpolation=mode, antialias=True),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(mean, std),
        ]
    )(pil(JPEGS[size]))
    spec = Preprocessing(
        resize_shorter=256,
        center_crop=[224, 224],
        interpolation=interpolation,
        mean=mean,
        std=std,
    )
    assert_within_one_level(JPEGS[size], spec, theirs, std)


@pytest.mark.parametrize("size", sorted(JPEGS))
def test_tensor_path_of_torchvision_agrees_within_one_level(size: tuple[int, int]) -> None:
    """torchvision's tensor resize (antialias=True), as its weights' transforms run on
    decoded tensors: Pillow's filter and torch's agree within a level too."""
    weights = torchvision.models.get_model_weights("resnet18").DEFAULT
    image = torchvision.transforms.functional.pil_to_tensor(pil(JPEGS[size]))
    theirs = weights.transforms()(image)
    spec = Preprocessing(
        resize_shorter=256,
        center_crop=[224, 224],
        mean=[0.485, 0.456, 0.406],
        std=[0.229, 0.224, 0.225],
    )
    got = ours(JPEGS[size], spec)
    scale = torch.tensor(spec.std).view(-1, 1, 1)
    assert float(((got - theirs).abs() * scale).max()) <= ONE_LEVEL


@pytest.mark.parametrize("size", sorted(JPEGS))
@pytest.mark.parametrize(("name", "crop_pct"), [("resnet50", 0.95), ("efficientnet_b0", 0.875)])
def test_crop_pct_matches_timm(size: tuple[int, int], name: str, crop_pct: float) -> None:
    config = timm_data.resolve_data_config(
        {}, model=timm.create_model(name, pretrained=False, num_classes=10)
    )
    config["crop_pct"] = crop_pct
    theirs = timm_data.create_transform(**config)(pil(JPEGS[size]))
    height, width = config["input_size"][1:]
    spec = Preprocessing(
        crop_pct=crop_pct,
        center_crop=[height, width],
        interpolation=config["interpolation"],
        mean=list(config["mean"]),
        std=list(config["std"]),
    )
    assert_within_one_level(JPEGS[size], spec, theirs, list(config["std"]))


def test_decode_from_a_written_file(tmp_path: Path) -> None:
    """The bytes a tar member holds are the file's bytes: decoding one read back is the same."""
    path = tmp_path / "photo.jpg"
    path.write_bytes(JPEGS[(500, 375)])
    spec = Preprocessing(resize_shorter=64, center_crop=[56, 56], interpolation="bicubic")
    assert np.array_equal(
        decode_image(path.read_bytes(), "photo", spec, MAX_PIXELS),
        decode_image(JPEGS[(500, 375)], "photo", spec, MAX_PIXELS),
    )


@pytest.mark.parametrize(
    "name", ["resnet18", "efficientnet_b0", "inception_v3", "vit_b_16", "regnet_y_400mf"]
)
def test_torchvision_architectures_resolve_their_weights_transform(name: str) -> None:
    from workers.models.eval_preprocessing import evaluation_preprocessing

    transform = torchvision.models.get_model_weights(name).DEFAULT.transforms()
    spec = evaluation_preprocessing(f"torchvision.{name}", {})
    assert spec is not None
    assert spec.resize_shorter == transform.resize_size[0]
    assert spec.center_crop == [transform.crop_size[0]] * 2
    assert spec.interpolation == transform.interpolation.value
    assert (spec.mean, spec.std) == (list(transform.mean), list(transform.std))


@pytest.mark.parametrize("name", ["resnet50", "vit_tiny_patch16_224", "convnext_atto"])
def test_timm_architectures_resolve_their_data_config(name: str) -> None:
    from workers.models.eval_preprocessing import evaluation_preprocessing

    spec = evaluation_preprocessing(f"timm.{name}", {"num_classes": 10})
    config = timm_data.resolve_data_config({}, model=timm.create_model(name, num_classes=10))
    assert spec is not None
    assert spec.crop_pct == config["crop_pct"]
    assert spec.center_crop == list(config["input_size"][1:])
    assert spec.interpolation == config["interpolation"]
    assert evaluation_preprocessing(f"timm.{name}", {"in_chans": 1}) is None


def test_a_folder_is_numbered_as_imagefolder_numbers_it(tmp_path: Path) -> None:
    from service.formats.image_folders import plan_folder

    for i, (label, name) in enumerate(
        [("zebra", "b.2.jpg"), ("Apple", "a.JPG"), ("mango", "z/x.png"), ("Apple", "c.jpeg")]
    ):
        path = tmp_path / label / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(JPEGS[(500, 375)] if i % 2 else JPEGS[(333, 500)])
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "h.jpg").write_bytes(JPEGS[(500, 375)])
    folder = torchvision.datasets.ImageFolder(str(tmp_path))
    plan = plan_folder(tmp_path)
    assert plan.classes == folder.classes
    assert [(str(i.path), i.label) for i in plan.images] == folder.samples


def test_torchvision_densenet_layout_and_prefix_load(api: Any, tmp_path: Path) -> None:
    """torchvision's DenseNet checkpoints in their published layout (``norm.1``), saved from
    DataParallel (``module.``): renamed to the model's keys, stored canonical."""
    import safetensors.torch

    from workers.models.weight_keys import _DENSENET

    torch.manual_seed(0)
    state = torchvision.models.densenet121(weights=None).state_dict()
    published = {
        "module."
        + re.sub(r"(denselayer\d+\.(?:norm|conv))([12])\.(?!num_batches)", r"\1.\2.", k): v
        for k, v in state.items()
    }
    renamed = [k for k in published if _DENSENET.match(k.removeprefix("module."))]
    assert renamed  # the layout differs from the model's
    client = api.client("densenet-layout")
    response = client.add_model("torchvision.densenet121", {}, safetensors.torch.save(published))
    assert response.status_code == 201, response.text[:2000]
    model = response.json()
    assert model["renamed_keys"]["stripped_prefixes"] == ["module."]
    assert model["renamed_keys"]["layout"].startswith("torchvision densenet")
    assert model["renamed_keys"]["count"] == len(state)
    assert model["preprocessing"]["resize_shorter"] == 256
    stored = safetensors.torch.load(client.http.get(f"/v1/models/{model['id']}/weights").content)
    assert sorted(stored) == sorted(state)
    assert all(torch.equal(stored[k], state[k]) for k in state)


def test_timm_conversion_of_an_original_convnext_checkpoint() -> None:
    """timm's own conversion (its ``checkpoint_filter_fn``) of the ConvNeXt repository's key
    layout, behind a ``module.`` prefix."""
    from workers.models.weight_keys import timm_conversion

    torch.manual_seed(0)
    state = timm.create_model("convnext_atto", num_classes=10).state_dict()

    def original(key: str) -> str:  # timm's names back to the ConvNeXt repository's
        key = re.sub(r"^stem\.", "downsample_layers.0.", key)
        key = re.sub(r"stages\.(\d+)\.downsample\.(\d+)", r"downsample_layers.\1.\2", key)
        key = re.sub(r"stages\.(\d+)\.blocks\.(\d+)", r"stages.\1.\2", key)
        key = key.replace("conv_dw", "dwconv").replace("mlp.fc", "pwconv")
        return key.replace("head.norm", "norm").replace("head.fc", "head")

    uploaded = {"module." + original(k): v for k, v in state.items()}
    assert set(uploaded).isdisjoint(state)
    converted = timm_conversion(uploaded, "timm.convnext_atto", {"num_classes": 10})
    assert converted is not None
    tensors, renaming = converted
    assert sorted(tensors) == sorted(state)
    assert all(torch.equal(tensors[k], state[k]) for k in state)
    assert renaming.stripped_prefixes == ["module."]
    assert renaming.layout is not None and "convnext" in renaming.layout


def test_a_job_runs_with_the_models_own_transform(shared_stack: Any, tmp_path: Path) -> None:
    """Over HTTP with a real worker: a torchvision model's record holds its weights'
    transform, an adapt job with "preprocessing": "model" on a folder of JPEGs of two sizes
    runs with it, and its report records the resolved spec."""
    from service.client import Client, new_model_id

    for i, size in enumerate([(500, 375), (333, 500), (500, 375), (333, 500)]):
        (tmp_path / "photos").mkdir(exist_ok=True)
        (tmp_path / "photos" / f"{i}.jpg").write_bytes(JPEGS[size])
    tenant = shared_stack.client("zoo-model-spec")
    client = Client(shared_stack.url, tenant.http.headers["Authorization"].removeprefix("Bearer "))
    model = client.add_model("torchvision.resnet18", {"num_classes": 10})
    assert model.preprocessing is not None
    assert (model.preprocessing.resize_shorter, model.preprocessing.center_crop) == (
        256,
        [224, 224],
    )
    dataset = client.upload_folder(
        tmp_path / "photos", preprocessing={"resize_shorter": 64, "center_crop": [56, 56]}
    )
    params = {"preprocessing": "model", "batch_size": 2, "checkpoint": {"preset": "none"}}
    job = client.submit("adapt", model.id, dataset.id, params)
    assert job.params.preprocessing == "model"
    ended = client.wait(job.id, timeout_s=300)
    assert ended.status.value == "succeeded", ended.error
    report = client.report(job.id)
    assert report.preprocessing == model.preprocessing
    assert report.samples == 4
    # The adapted model keeps its architecture's transform.
    adapted = client.request("GET", f"/v1/models/{new_model_id(ended)}").json()
    assert adapted["preprocessing"] == model.preprocessing.model_dump(mode="json")
