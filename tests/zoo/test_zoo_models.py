"""The zoo in process (fast): the catalog, the blocks rule per family, each normalization
layer's behaviour, and checkpointed training bitwise equal to plain training per family."""

from __future__ import annotations

import copy
import json

import pytest

torchvision = pytest.importorskip("torchvision")
timm = pytest.importorskip("timm")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from api_schemas import ArchitecturePublic  # noqa: E402
from tests.zoo.families import FAMILIES, IMAGE_SIZE, NUM_CLASSES, Family  # noqa: E402
from workers.errors import ArchitectureError  # noqa: E402
from workers.estimators.base import select_affine_norms, select_batchnorm  # noqa: E402
from workers.estimators.entropy import entropy_adapt  # noqa: E402
from workers.models.architectures import (  # noqa: E402
    batchnorm_layers,
    build_model,
    registry,
    state_spec,
)
from workers.models.modules import named_modules  # noqa: E402
from workers.models.policy import checkpoint_model, find_blocks  # noqa: E402
from workers.processes.inspector import catalog  # noqa: E402
from workers.running.reporting import frozen_norm_names  # noqa: E402

pytestmark = pytest.mark.zoo


def build(family: Family, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(family.architecture, family.all_kwargs())


# --- The catalog ---------------------------------------------------------------------------


def test_catalog_has_every_classification_model_of_both_libraries() -> None:
    models = torchvision.models
    names = {a.name for a in catalog()}
    assert {f"torchvision.{n}" for n in models.list_models(module=models)} <= names
    assert {f"timm.{n}" for n in timm.list_models()} <= names
    # Bounded: what the inspector publishes and the API passes on, about 1 MB for ~1,450.
    published = "[" + ",".join(a.model_dump_json() for a in catalog()) + "]"
    assert len(published) < 2_000_000
    entries = [ArchitecturePublic.model_validate(e) for e in json.loads(published)]
    timm_resnet = next(e for e in entries if e.name == "timm.resnet18")
    assert [p.name for p in timm_resnet.params] == [
        "num_classes",
        "in_chans",
        "drop_rate",
        "drop_path_rate",
    ]
    vit = next(e for e in entries if e.name == "timm.vit_tiny_patch16_224")
    assert "img_size" in [p.name for p in vit.params] and vit.input_shape == [3, 224, 224]


def test_zoo_kwargs_are_checked_and_reach_the_model() -> None:
    model = build_model("timm.resnet18", {"num_classes": 3, "in_chans": 1})
    assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 3)
    spec = state_spec("timm.vit_tiny_patch16_224", {"img_size": 32, "num_classes": 2})
    assert spec["pos_embed"][0] == (1, 5, 192)  # 4 patches and the class token
    with pytest.raises(ArchitectureError, match="above the maximum 1"):
        build_model("timm.resnet18", {"drop_path_rate": 1.5})
    with pytest.raises(ArchitectureError, match=r"unknown kwargs \['depth'\]"):
        build_model("timm.resnet18", {"depth": 3})
    # A kwarg the catalog offers that this model's class does not take: a 422's message, not
    # a TypeError (the inspector would answer 500).
    with pytest.raises(ArchitectureError, match="leave that kwarg at its default"):
        build_model("torchvision.vit_b_16", {"image_size": 30})  # not a multiple of 16
    # torchvision's RegNet reads tensor values while building: state_spec builds it on the CPU.
    assert "fc.weight" in state_spec("torchvision.regnet_y_400mf", {"num_classes": 2})


def test_unknown_name_lists_the_closest() -> None:
    with pytest.raises(ArchitectureError, match=r"close: timm\.resnet18"):
        build_model("timm.resnet1", {})


# --- The blocks rule ----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.architecture)
def test_blocks_rule_finds_each_familys_blocks(family: Family) -> None:
    model = build(family)
    blocks, rule = find_blocks(model, registry()[family.architecture])
    assert rule == "block_types"
    assert blocks and {type(b).__name__ for b in blocks} <= {
        family.block_class,
        "DepthwiseSeparableConv",  # timm's efficientnets open with one
    }


@pytest.mark.parametrize(
    ("architecture", "rule"),
    [
        ("torchvision.vgg11_bn", "none"),  # a Sequential of bare layers: nothing to wrap
        ("torchvision.swin_t", "block_types"),
        ("timm.mixer_s16_224", "repeated"),  # no class named: the structural rule
        ("timm.inception_v3", "none"),
    ],
)
def test_blocks_rule_on_other_families(architecture: str, rule: str) -> None:
    with torch.device("meta"):
        model = build_model(architecture, {"num_classes": 2})
    outcome = checkpoint_model(model, registry()[architecture], "blocks", [], [], False)
    assert outcome.blocks_rule == rule
    assert (outcome.note is not None) == (rule == "none")
    assert bool(outcome.wrapped) == (rule != "none")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.architecture)
def test_checkpointed_training_equals_plain_bitwise(family: Family) -> None:
    """Two SGD steps in train mode (dropout and stochastic depth drawn) with the family's
    blocks wrapped give the same outputs, gradients and state as without, bit for bit."""
    plain = build(family)
    wrapped = copy.deepcopy(plain)
    outcome = checkpoint_model(wrapped, registry()[family.architecture], "blocks", [], [], False)
    assert outcome.wrapped
    torch.manual_seed(1)
    x = torch.randn(4, 3, IMAGE_SIZE, IMAGE_SIZE)
    y = torch.randint(0, NUM_CLASSES, (4,))
    for model in (plain, wrapped):
        model.train()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, wrapped)]
    for step in range(2):
        outputs = []
        for model, opt in zip((plain, wrapped), opts, strict=True):
            torch.manual_seed(100 + step)
            out = model(x)
            nn.functional.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()
            outputs.append(out.detach())
        assert torch.equal(outputs[0], outputs[1]), f"step {step}"
    a, b = plain.state_dict(), wrapped.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


# --- Normalization layers -----------------------------------------------------------------


def test_every_batchnorm_kind_is_selected_frozen_ones_are_reported() -> None:
    from timm.layers import BatchNormAct2d
    from timm.layers.norm_act import FrozenBatchNormAct2d
    from torchvision.ops.misc import FrozenBatchNorm2d

    model = nn.Sequential(
        nn.BatchNorm1d(3),
        nn.BatchNorm2d(3),
        nn.BatchNorm3d(3),
        nn.SyncBatchNorm(3),
        BatchNormAct2d(3),
        FrozenBatchNorm2d(3),
        FrozenBatchNormAct2d(3),
        nn.LayerNorm(3),
        nn.GroupNorm(1, 3),
    )
    assert select_batchnorm(model, ["*"], []) == ["0", "1", "2", "3", "4"]
    assert [layer["name"] for layer in batchnorm_layers(model)] == ["0", "1", "2", "3", "4"]
    assert frozen_norm_names(model) == ["5", "6"]
    assert select_affine_norms(model, ["*"], []) == ["7", "8"]


def test_timm_resnet_with_frozen_batchnorm_is_reported_frozen() -> None:
    from timm.layers import freeze_batch_norm_2d

    model = freeze_batch_norm_2d(build_model("timm.resnet18", {"num_classes": 2}))
    frozen = frozen_norm_names(model)
    assert frozen and "bn1" in frozen
    assert batchnorm_layers(model) == [], "a frozen model keeps no running statistics"


def test_entropy_trains_layernorm_affine_of_a_vit() -> None:
    """A model with LayerNorm only (ViT): entropy trains their weight and bias and nothing
    else; with affine_layers empty there is nothing to train."""
    torch.manual_seed(0)
    model = build_model("timm.vit_tiny_patch16_224", {"img_size": 32, "num_classes": 3})
    norms = select_affine_norms(model, ["*"], [])
    assert norms and select_batchnorm(model, ["*"], [], required=False) == []
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [torch.randn(4, 3, 32, 32) for _ in range(2)]
    entropy_adapt(model, batches, layers=[], affine_layers=norms, lr=1e-2)
    after = model.state_dict()
    trained = {f"{n}.{p}" for n in norms for p in ("weight", "bias")}
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= trained
    kinds = {type(m).__name__ for n, m in named_modules(model) if n in norms}
    assert kinds == {"LayerNorm"}
