"""The guarantee under torch.compile (NOTE [ Under torch.compile ] in bnadapt/checkpoint.py):
compiled models holding wrapped blocks, compiled whole or block by block, give the outputs,
gradients and state of the same model compiled unwrapped -- bitwise on the eager and aot_eager
backends, and on inductor within the difference that compiling the unwrapped model itself
makes -- with num_batches_tracked exact everywhere, and with no graph break added.

Dropout is off in the backend comparison: under backend="eager" torch runs its checkpoint op
with preserve_rng_state=False (inductor functionalizes the RNG instead), so any checkpoint,
torch's own included, recomputes a different dropout mask there. test_dropout_on_aot_eager
covers dropout where torch replays it."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
from torch import nn
from torch.func import functional_call

from bnadapt.checkpoint import apply_checkpointing, checkpoint, checkpoint_wrapper
from tests.checkpoint.checkpoint_harness import assert_same, unwrapped_name
from tests.checkpoint.test_checkpoint import Block, Net, images, nested

# inductor compiles C++ for each case (a minute and more, cold): the whole suite runs it, the
# quick tier keeps the two backends that trace the same graphs without compiling them.
# AOT autograd and inductor trace and compile for seconds a test: the slow tier runs them.
AOT_EAGER = pytest.param("aot_eager", marks=pytest.mark.slow)
BACKENDS = ["eager", AOT_EAGER, pytest.param("inductor", marks=pytest.mark.slow)]


def fresh(dropout: float = 0.0, device: str = "cpu") -> Net:
    torch.manual_seed(0)
    return Net(depth=2, dropout=dropout).to(device)


Prepare = Callable[[Net, bool, str], nn.Module]


def whole(model: Net, wrap: bool, backend: str) -> nn.Module:
    """The model compiled as one graph; with wrap, its blocks checkpointed first."""
    if wrap:
        apply_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return torch.compile(model, backend=backend, fullgraph=True)  # type: ignore[return-value]


def compiled_blocks_wrapped(model: Net, wrap: bool, backend: str) -> nn.Module:
    """Each block compiled on its own, then (with wrap) wrapped: an eager wrapper around
    compiled code."""
    for i, block in enumerate(model.blocks):
        compiled: nn.Module = torch.compile(block, backend=backend)  # type: ignore[assignment]
        model.blocks[i] = checkpoint_wrapper(compiled) if wrap else compiled
    return model


def wrapped_blocks_compiled(model: Net, wrap: bool, backend: str) -> nn.Module:
    """Each block (with wrap) wrapped, then compiled on its own, wrapper included."""
    for i, block in enumerate(model.blocks):
        inner = checkpoint_wrapper(block) if wrap else block
        model.blocks[i] = torch.compile(inner, backend=backend, fullgraph=True)  # type: ignore[assignment]
    return model


PREPARES = [
    pytest.param(whole, id="whole"),
    pytest.param(compiled_blocks_wrapped, id="compiled_blocks_wrapped"),
    pytest.param(wrapped_blocks_compiled, id="wrapped_blocks_compiled"),
]


def steps(model: nn.Module, state_of: nn.Module, xs: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Two SGD train steps, an eval-mode forward and backward with grad on, and a no-grad
    train-mode pass (BN adaptation); everything they produce."""
    optimizer = torch.optim.SGD(state_of.parameters(), lr=0.1)
    outs = []
    state_of.train()
    for x in xs[:2]:
        optimizer.zero_grad()
        out = model(x)
        out.square().mean().backward()
        optimizer.step()
        outs.append(out.detach())
    state_of.eval()
    out = model(xs[2])
    out.sum().backward()
    outs.append(out.detach())
    state_of.train()
    with torch.no_grad():
        outs.append(model(xs[3]))
    return {
        "outs": outs,
        "input_grads": [x.grad for x in xs],
        "grads": {unwrapped_name(n): p.grad for n, p in state_of.named_parameters()},
        "state": dict(state_of.state_dict()),
    }


def run_steps(prepare: Prepare, wrap: bool, backend: str, device: str = "cpu") -> dict[str, Any]:
    torch._dynamo.reset()
    model = fresh(device=device)
    compiled = prepare(model, wrap, backend) if backend != "none" else model
    xs = [x.to(device).requires_grad_() for x in images(4)]
    torch.manual_seed(1)
    return steps(compiled, model, xs)


def flat(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in flat(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in flat(v)]
    return []


def max_difference(a: Any, b: Any) -> float:
    return max(
        (x.double() - y.double()).abs().max().item()
        for x, y in zip(flat(a), flat(b), strict=True)
        if x.is_floating_point()
    )


def assert_counts_exact(result: dict[str, Any], batches: int) -> None:
    counts = {int(v) for k, v in result["state"].items() if k.endswith("num_batches_tracked")}
    assert counts == {batches}, counts


@pytest.mark.parametrize("prepare", PREPARES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_matches_compiled_unwrapped(prepare: Prepare, backend: str) -> None:
    plain = run_steps(prepare, wrap=False, backend=backend)
    wrapped = run_steps(prepare, wrap=True, backend=backend)
    # 2 train steps and 1 no-grad pass in train mode; the eval pass counts nothing.
    assert_counts_exact(plain, 3)
    assert_counts_exact(wrapped, 3)
    if backend == "inductor":
        tolerance = max_difference(run_steps(prepare, wrap=False, backend="none"), plain)
        assert max_difference(plain, wrapped) <= tolerance
    else:
        assert_same(plain, wrapped)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_issue_reproduction(backend: str, train: bool) -> None:
    # Raised InternalTorchDynamoError (checkpoint not implemented for a context_fn) whenever
    # grad mode was on.
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    m.train(train)
    out = torch.compile(m, backend=backend, fullgraph=True)(torch.randn(4, 2))
    out.sum().backward()
    assert int(m[1].num_batches_tracked) == (1 if train else 0)


def nested_wrappers(model: Net, wrap: bool, backend: str) -> nn.Module:
    """Wrappers in wrappers (tests/checkpoint/test_checkpoint.py's nested), compiled whole."""
    return torch.compile(nested(model) if wrap else model, backend=backend, fullgraph=True)  # type: ignore[return-value]


@pytest.mark.parametrize(
    "prepare", [pytest.param(whole, id="whole"), pytest.param(nested_wrappers, id="nested")]
)
@pytest.mark.parametrize("backend", ["eager", AOT_EAGER])
def test_several_forwards_one_backward(prepare: Prepare, backend: str) -> None:
    # The buffers change between a call and its recomputation; torch's own checkpoint fails
    # here under aot_eager and inductor (NOTE [ Under torch.compile ]).
    results = []
    for wrap in (False, True):
        torch._dynamo.reset()
        model = fresh()
        compiled = prepare(model, wrap, backend)
        model.train()
        xs = images(3, grad=True)
        total = sum(compiled(x).square().mean() for x in xs)
        assert isinstance(total, torch.Tensor)
        total.backward()
        grads = {unwrapped_name(n): p.grad for n, p in model.named_parameters()}
        results.append((total.detach(), [x.grad for x in xs], grads, dict(model.state_dict())))
    assert_same(results[0], results[1])
    assert_counts_exact({"state": results[1][3]}, 3)


def graph_breaks(prepare: Prepare, wrap: bool) -> int:
    torch._dynamo.utils.counters.clear()
    run_steps(prepare, wrap, backend="eager")
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@pytest.mark.parametrize(
    "prepare",
    [
        pytest.param(whole, id="whole"),
        pytest.param(compiled_blocks_wrapped, id="compiled_blocks_wrapped"),
    ],
)
def test_no_graph_break_added(prepare: Prepare) -> None:
    assert graph_breaks(prepare, wrap=True) == graph_breaks(prepare, wrap=False) == 0


def test_explain_whole_model_is_one_graph() -> None:
    model = apply_checkpointing(fresh(), check_fn=lambda m: isinstance(m, Block))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(images(1, grad=True)[0])
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


@pytest.mark.slow
def test_dropout_on_aot_eager() -> None:
    results = []
    for wrap in (False, True):
        torch._dynamo.reset()
        model = fresh(dropout=0.5)
        compiled = whole(model, wrap, "aot_eager")
        torch.manual_seed(1)
        result = steps(compiled, model, [x.requires_grad_() for x in images(4)])
        results.append((result, torch.rand(3)))  # the random stream after the steps too
    assert_same(results[0], results[1])


@pytest.mark.parametrize("backend", ["eager", AOT_EAGER])
def test_functional_call_under_compile(backend: str) -> None:
    results = []
    for wrap in (False, True):
        torch._dynamo.reset()
        model = fresh()
        if wrap:
            apply_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        values = {n: (p.detach() * 2).requires_grad_() for n, p in model.named_parameters()}

        def call(values: dict[str, torch.Tensor], x: torch.Tensor, model: nn.Module = model) -> Any:
            return functional_call(model, values, (x,))

        compiled = torch.compile(call, backend=backend, fullgraph=True)
        outs = []
        for x in images(2, grad=True):
            out = compiled(values, x)
            out.square().mean().backward()
            outs.append(out.detach())
        grads = {unwrapped_name(n): v.grad for n, v in values.items()}
        results.append((outs, grads, dict(model.state_dict())))
    assert_same(results[0], results[1])


class ThroughFunction(nn.Module):
    """Runs its blocks through checkpoint() of a plain function (no root module)."""

    def __init__(self, net: Net, wrap: bool) -> None:
        super().__init__()
        self.net = net
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.net.stem(x))
        if self.wrap:
            return checkpoint(lambda t: self.net.blocks(t), h)  # type: ignore[no-any-return]
        return self.net.blocks(h)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_plain_function_under_aot_eager() -> None:
    # A plain function gets torch's checkpoint op as is; AOT's joint graph updates the buffers
    # once (under backend="eager" torch's own op fails; see the module docstring).
    results = []
    for wrap in (False, True):
        torch._dynamo.reset()
        model = ThroughFunction(fresh(), wrap)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        torch.manual_seed(1)
        results.append(steps(compiled, model, [x.requires_grad_() for x in images(4)]))
    assert_same(results[0], results[1])
    assert_counts_exact(results[1], 3)


def test_offload_under_compile_runs_eagerly_where_it_breaks() -> None:
    # Dynamo cannot trace saved-tensor hooks: with offload_to_cpu the wrapper's hooks break the
    # graph, and that part runs eagerly, exact as ever.
    results = []
    for wrap in (False, True):
        torch._dynamo.reset()
        model = fresh()
        if wrap:
            apply_checkpointing(model, check_fn=lambda m: isinstance(m, Block), offload_to_cpu=True)
        compiled = torch.compile(model, backend="aot_eager")
        torch.manual_seed(1)
        results.append(steps(compiled, model, [x.requires_grad_() for x in images(4)]))
    assert_same(results[0], results[1])


def test_wrapped_copy_of_compiled_model_state() -> None:
    # state_dict keys of a compiled wrapped model are those of the compiled unwrapped one.
    plain = torch.compile(fresh(), backend="eager")
    wrapped = whole(fresh(), True, "eager")
    assert list(plain.state_dict()) == list(wrapped.state_dict())
    assert list(copy.deepcopy(fresh()).state_dict()) == [
        k.removeprefix("_orig_mod.") for k in wrapped.state_dict()
    ]
