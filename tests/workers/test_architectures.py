"""The architecture registry, kwargs checks, model inspection and the checkpoint policy."""

from __future__ import annotations

import logging
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from bnadapt.checkpoint import CheckpointWrapper
from workers.errors import ArchitectureError, PolicyError
from workers.models import architectures as arch_mod
from workers.models.architectures import (
    Architecture,
    ConvBlock,
    MLPBlock,
    ResidualBlock,
    batchnorm_layers,
    build_model,
    describe,
    input_fits,
    parameter_count,
    registry,
    resolve_kwargs,
    state_spec,
)
from workers.models.modules import named_modules
from workers.models.policy import apply_checkpoint_policy, checkpoint_model, find_blocks


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    registry.cache_clear()
    yield
    registry.cache_clear()


def sample_input(name: str, kwargs: dict[str, object], batch: int = 4) -> torch.Tensor:
    shape = registry()[name].input_shape(resolve_kwargs(name, kwargs))
    return torch.rand(batch, *(8 if d is None else d for d in shape))


@pytest.mark.parametrize(
    ("name", "kwargs", "num_classes"),
    [
        ("digits_cnn", {}, 10),
        ("digits_cnn", {"width": 4, "num_classes": 3}, 3),
        ("resnet", {}, 10),
        ("resnet", {"in_channels": 1, "depth": 1, "width": 4, "num_classes": 2}, 2),
        ("resnet", {"depth": 7, "width": 4}, 10),
        ("mlp", {}, 10),
        ("mlp", {"in_features": 5, "hidden": 7, "depth": 3, "num_classes": 1}, 1),
    ],
)
def test_builtins_build_and_run(name: str, kwargs: dict[str, object], num_classes: int) -> None:
    torch.manual_seed(0)
    model = build_model(name, kwargs)
    out = model(sample_input(name, kwargs))
    assert out.shape == (4, num_classes)
    assert batchnorm_layers(model), "every built-in has BatchNorm"


def test_resnet_stages_and_any_input_size() -> None:
    model = build_model("resnet", {"depth": 4, "width": 8})
    blocks = [m for m in model.modules() if isinstance(m, ResidualBlock)]
    assert [b.conv2.out_channels for b in blocks] == [8, 8, 16, 32]
    assert registry()["resnet"].input_shape(resolve_kwargs("resnet", {})) == (3, None, None)
    for size in (5, 8, 13):
        assert model(torch.rand(2, 3, size, size)).shape == (2, 10)


def test_describe_matches_the_catalog_shape() -> None:
    entry = describe(registry()["resnet"])
    assert set(entry) == {"name", "description", "params", "input_shape"}
    assert entry["input_shape"] == [3, None, None]
    assert entry["params"][0] == {
        "name": "in_channels",
        "type": "int",
        "default": 3,
        "description": "Channels of the input images.",
        "minimum": 1,
        "maximum": 64,
    }
    assert describe(registry()["digits_cnn"])["input_shape"] == [1, 8, 8]
    assert describe(registry()["mlp"])["input_shape"] == [64]


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("nope", {}, "unknown architecture 'nope'; known: digits_cnn, mlp, resnet"),
        ("mlp", {"widht": 3}, "unknown kwargs ['widht']"),
        ("mlp", {"depth": True}, "'depth' must be a finite int, got True"),
        ("mlp", {"depth": "3"}, "'depth' must be a finite int, got '3'"),
        ("mlp", {"depth": 2.0}, "'depth' must be a finite int, got 2.0"),
        ("mlp", {"depth": 0}, "'depth' is 0, below the minimum 1"),
        ("resnet", {"depth": 65}, "'depth' is 65, above the maximum 64"),
    ],
)
def test_bad_kwargs_are_refused(name: str, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ArchitectureError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_model(name, kwargs)


def test_state_spec_matches_a_real_model_without_allocating() -> None:
    kwargs = {"depth": 3, "width": 8}
    spec = state_spec("resnet", kwargs)
    real = build_model("resnet", kwargs).state_dict()
    assert list(spec) == list(real)
    for key, value in real.items():
        assert spec[key] == (tuple(value.shape), str(value.dtype).removeprefix("torch."))
    assert spec["stem.bn.num_batches_tracked"] == ((), "int64")
    assert spec["head.weight"] == ((10, 32), "float32")


def test_input_fits() -> None:
    assert input_fits((1, 8, 8), (1, 8, 8))
    assert input_fits((3, None, None), (3, 17, 5))
    assert not input_fits((3, None, None), (1, 17, 5))
    assert not input_fits((64,), (8, 8))
    assert not input_fits((1, 8, 8), (1, 8))


def test_inspection_ignores_checkpoint_wrappers() -> None:
    model = build_model("digits_cnn", {"width": 4})
    plain_layers = batchnorm_layers(model)
    assert plain_layers == [
        {
            "name": "block1.bn",
            "kind": "BatchNorm2d",
            "num_features": 4,
            "momentum": 0.1,
            "track_running_stats": True,
        },
        {
            "name": "block2.bn",
            "kind": "BatchNorm2d",
            "num_features": 8,
            "momentum": 0.1,
            "track_running_stats": True,
        },
    ]
    names = [name for name, _ in named_modules(model)]
    # conv 1*4*9 + bn 2*4 + conv 4*8*9 + bn 2*8 + head 8*4*4*10 + 10
    assert parameter_count(model) == 36 + 8 + 288 + 16 + 1280 + 10
    apply_checkpoint_policy(model, registry()["digits_cnn"], "blocks", [], [], False)
    assert isinstance(model.block1, CheckpointWrapper)
    assert batchnorm_layers(model) == plain_layers
    assert [name for name, _ in named_modules(model)] == names
    assert parameter_count(model) == 36 + 8 + 288 + 16 + 1280 + 10


# --- Entry points and torchvision -----------------------------------------------------------

PLUGIN = """
    from torch import nn
    from workers.models.architectures import Architecture, ParamSpec

    def _factory(scale: float = 1.0, bias: bool = True, act: str = "relu") -> nn.Module:
        return nn.Linear(2, 2, bias=bias)

    TINY = Architecture(
        name="tiny",
        description="A test plugin.",
        factory=_factory,
        params=(
            ParamSpec("scale", "float", 1.0, "A float.", minimum=0.0, maximum=2.0),
            ParamSpec("bias", "bool", True, "A bool."),
            ParamSpec("act", "str", "relu", "A string."),
        ),
        input_shape=lambda kw: (2,),
    )

    def make_other() -> Architecture:
        return Architecture("other", "Made by a callable.", _factory, (), lambda kw: (2,))

    SHADOW = Architecture("mlp", "Shadows a built-in.", _factory, (), lambda kw: (2,))

    NOT_AN_ARCHITECTURE = 42
"""


def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry_points: str) -> None:
    """A real installed distribution on sys.path, found through importlib.metadata."""
    (tmp_path / "bnadapt_test_plugin.py").write_text(textwrap.dedent(PLUGIN))
    dist = tmp_path / "bnadapt_test_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bnadapt-test-plugin\n")
    (dist / "entry_points.txt").write_text(f"[bnadapt.architectures]\n{entry_points}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bnadapt_test_plugin", raising=False)


def test_entry_points_are_loaded_and_broken_ones_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    install_plugin(
        tmp_path,
        monkeypatch,
        "tiny = bnadapt_test_plugin:TINY\n"
        "other = bnadapt_test_plugin:make_other\n"
        "wrong = bnadapt_test_plugin:NOT_AN_ARCHITECTURE\n"
        "missing = bnadapt_test_plugin_gone:THING\n"
        "shadow = bnadapt_test_plugin:SHADOW\n",
    )
    with caplog.at_level(logging.WARNING, logger=arch_mod.__name__):
        known = registry()
    assert {"digits_cnn", "resnet", "mlp", "tiny", "other"} <= set(known)
    assert "wrong" not in known and "missing" not in known
    assert known["mlp"].description.startswith("Multi-layer perceptron"), "built-ins win"
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    assert "'wrong'" in warnings and "'missing'" in warnings
    assert "ignoring a second architecture named 'mlp'" in warnings

    model = build_model("tiny", {"scale": 2, "bias": False, "act": "gelu"})
    assert isinstance(model, nn.Linear) and model.bias is None
    assert resolve_kwargs("tiny", {"scale": 1})["scale"] == 1.0
    for bad, message in [
        ({"scale": float("nan")}, "must be a finite float"),
        ({"scale": 2.5}, "above the maximum 2"),
        ({"bias": 1}, "must be a finite bool"),
        ({"act": 3}, "must be a finite str"),
    ]:
        with pytest.raises(ArchitectureError, match=message):
            build_model("tiny", bad)


def test_torchvision_absent_or_broken_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import raises ImportError
    assert not [name for name in registry() if name.startswith("torchvision.")]


def test_torchvision_models_are_registered_when_it_imports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class BasicBlock(nn.Module):
        pass

    class Bottleneck(nn.Module):
        pass

    def get_model(
        name: str, weights: None, num_classes: int = 1000, image_size: int = 224
    ) -> nn.Module:
        return nn.Linear(3, num_classes)

    models = types.SimpleNamespace(
        list_models=lambda module: ["resnet18", "vit_b_16"],
        get_model=get_model,
        resnet=types.SimpleNamespace(BasicBlock=BasicBlock, Bottleneck=Bottleneck),
    )
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(models=models))
    known = registry()
    # Every torchvision model gets the block classes the installed version has (the stand-in
    # has two); the blocks rule finds those its model holds.
    assert known["torchvision.resnet18"].block_types == (BasicBlock, Bottleneck)
    assert known["torchvision.vit_b_16"].block_types == (BasicBlock, Bottleneck)
    assert build_model("torchvision.resnet18", {"num_classes": 7}).out_features == 7
    assert describe(known["torchvision.resnet18"])["input_shape"] == [3, None, None]
    # A ViT's image size is fixed by its kwargs.
    assert describe(known["torchvision.vit_b_16"])["input_shape"] == [3, 224, 224]
    vit = resolve_kwargs("torchvision.vit_b_16", {"image_size": 64})
    assert known["torchvision.vit_b_16"].input_shape(vit) == (3, 64, 64)


# --- Checkpoint policy ---------------------------------------------------------------------


def wrapped_names(model: nn.Module) -> list[str]:
    return [
        name.replace("._checkpoint_wrapped_module", "")
        for name, m in model.named_modules()
        if isinstance(m, CheckpointWrapper)
    ]


def test_blocks_preset_wraps_the_blocks_and_keeps_state_dict_keys() -> None:
    for name, block in [("resnet", ResidualBlock), ("mlp", MLPBlock), ("digits_cnn", ConvBlock)]:
        model = build_model(name, {})
        keys = list(model.state_dict())
        expected = [n for n, m in model.named_modules() if isinstance(m, block)]
        wrapped = apply_checkpoint_policy(model, registry()[name], "blocks", [], [], True)
        assert wrapped == expected and wrapped
        assert wrapped_names(model) == expected
        assert list(model.state_dict()) == keys
        assert all(m.offload_to_cpu for m in model.modules() if isinstance(m, CheckpointWrapper))
        again = apply_checkpoint_policy(model, registry()[name], "blocks", [], [], False)
        assert again == expected and wrapped_names(model) == expected, "nothing wrapped twice"


def test_patterns_and_types_select_modules() -> None:
    arch = registry()["resnet"]
    model = build_model("resnet", {"depth": 3, "width": 4})
    wrapped = apply_checkpoint_policy(model, arch, "none", ["blocks.0", "stem"], ["Linear"], False)
    assert wrapped == ["stem", "blocks.0", "head"]

    model = build_model("resnet", {"depth": 3, "width": 4})
    wrapped = apply_checkpoint_policy(model, arch, "none", ["blocks.*"], [], False)
    assert wrapped == ["blocks.0", "blocks.1", "blocks.2"], "selected inside selected: outer"

    model = build_model("resnet", {"depth": 3, "width": 4})
    assert apply_checkpoint_policy(model, arch, "none", [], [], False) == []
    assert wrapped_names(model) == []


@pytest.mark.parametrize(
    ("preset", "modules", "types_", "message"),
    [
        ("none", ["blocks.9"], [], "pattern 'blocks.9' matches no module of 'resnet'"),
        ("none", [], ["Conv3d"], r"types \['Conv3d'\] name no module class of 'resnet'"),
        ("sometimes", [], [], "unknown checkpoint preset 'sometimes'"),
    ],
)
def test_policy_errors(preset: str, modules: list[str], types_: list[str], message: str) -> None:
    model = build_model("resnet", {"depth": 2, "width": 4})
    arch = registry()["resnet"]
    with pytest.raises(PolicyError, match=message):
        apply_checkpoint_policy(model, arch, preset, modules, types_, False)
    assert wrapped_names(model) == [], "nothing wrapped when the policy is refused"


def test_blocks_preset_without_blocks_runs_unwrapped_and_says_so() -> None:
    # NOTE [ The blocks rule ]: no block classes and no repeated blocks: nothing is wrapped,
    # nothing is refused, and the outcome's note says why.
    bare = Architecture("bare", "No blocks.", lambda: nn.Linear(2, 2), (), lambda kw: (2,))
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    outcome = checkpoint_model(model, bare, "blocks", [], [], False)
    assert outcome.wrapped == [] and outcome.blocks_rule == "none"
    assert outcome.note is not None and "found no repeated blocks" in outcome.note
    assert wrapped_names(model) == []
    # The policy's own patterns still apply.
    outcome = checkpoint_model(model, bare, "blocks", ["0"], [], False)
    assert outcome.wrapped == ["0"] and outcome.note is not None


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.bn = nn.BatchNorm2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.conv(x))


def test_blocks_structural_rule_wraps_repeated_siblings() -> None:
    # No block classes named: the children of one class repeated in a Sequential or a
    # ModuleList are the blocks; plain containers and lone or parameterless modules are not.
    bare = Architecture("bare", "", lambda: nn.Identity(), (), lambda kw: (2, None, None))
    model = nn.Sequential(
        nn.Conv2d(2, 2, 1),
        nn.Conv2d(2, 2, 1),  # leaves: not blocks
        nn.Sequential(_Stage(), _Stage(), nn.ReLU(), nn.ReLU()),
        nn.ModuleList([_Stage(), _Stage()]),
        nn.Sequential(_Stage()),  # alone in its container
    )
    blocks, rule = find_blocks(model, bare)
    assert rule == "repeated"
    names = {m: n for n, m in model.named_modules()}
    assert sorted(names[b] for b in blocks) == ["2.0", "2.1", "3.0", "3.1"]
    outcome = checkpoint_model(model, bare, "blocks", [], [], False)
    assert outcome.wrapped == ["2.0", "2.1", "3.0", "3.1"] and outcome.note is None
    # The architecture's own classes come first: with them, the structural rule is not used.
    typed = Architecture("typed", "", lambda: nn.Identity(), (), lambda kw: (2,), (_Stage,))
    blocks, rule = find_blocks(nn.Sequential(_Stage(), nn.Sequential(_Stage())), typed)
    assert rule == "block_types" and len(blocks) == 2
