"""Bounded model builds, in turns between tenants, on the running stack: a real
Redis-compatible server, the API under uvicorn and a worker whose inspector builds each model in
a process held to BNADAPT_INSPECT_MEMORY_BYTES (NOTE [ Bounded builds ] in
workers/models/sizing.py, NOTE [ Inspection turns ] in workers/processes/inspector.py).

Architectures that misbehave on purpose come from an installed plugin (the
``bnadapt.architectures`` entry points, as a third party's would): one that allocates real
memory whatever the default device (what no estimate on the meta device sees), one whose
process is killed while it builds, one that takes its time. Orders are read from the order
in which the answers came back, never from the test's clock."""

from __future__ import annotations

import os
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest

from harness.servers import wait_for
from harness.stack import REPO, Client, Stack, running_stack
from service.records import keys
from workers.models.sizing import BuildLimits, ModelSize, measure

pytestmark = pytest.mark.slow

CAP_BYTES: Final = 768 * 1024 * 1024
# Long enough for the order test's queue of slow builds, short enough for the overrun test.
TIMEOUT_S: Final = 40

PLUGIN: Final = """
    import os
    import signal
    import time

    import torch
    from torch import nn
    from workers.models.architectures import Architecture
    from workers.models.spec import int_param


    def _tiny() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


    def memory_hog(mib: int = 1) -> nn.Module:
        # On the CPU whatever the default device: the meta build allocates it too.
        hoard = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device="cpu")
        del hoard
        return _tiny()


    def killed_build(signum: int = 9) -> nn.Module:
        os.kill(os.getpid(), signum)
        return _tiny()


    def slow_build(seconds: int = 1) -> nn.Module:
        time.sleep(seconds)
        return _tiny()


    def _arch(name, factory, param):
        return Architecture(name, "A test plugin.", factory, (param,), lambda kw: (4,))


    HOG = _arch("memory_hog", memory_hog, int_param("mib", 1, "MiB to allocate.", 1 << 20))
    KILLED = _arch("killed_build", killed_build, int_param("signum", 9, "Signal.", 64))
    SLOW = _arch("slow_build", slow_build, int_param("seconds", 1, "Sleep.", 3600))
"""


def install_plugin(where: Path) -> None:
    """A real installed distribution in ``where``, found through importlib.metadata."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "bnadapt_bounds_plugin.py").write_text(textwrap.dedent(PLUGIN))
    dist = where / "bnadapt_bounds_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bnadapt-bounds-plugin\n")
    (dist / "entry_points.txt").write_text(
        "[bnadapt.architectures]\n"
        "hog = bnadapt_bounds_plugin:HOG\n"
        "killed = bnadapt_bounds_plugin:KILLED\n"
        "slow = bnadapt_bounds_plugin:SLOW\n"
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    plugin = tmp_path_factory.mktemp("plugin")
    install_plugin(plugin)
    env = {
        "PYTHONPATH": f"{REPO}{os.pathsep}{plugin}",
        "BNADAPT_INSPECT_MEMORY_BYTES": str(CAP_BYTES),
        "BNADAPT_INSPECT_TIMEOUT_S": str(TIMEOUT_S),
        "BNADAPT_WORKER_THREADS": "1",
    }
    with running_stack(tmp_path_factory.mktemp("stack"), env) as stack:
        yield stack


def measured(name: str, kwargs: dict[str, Any]) -> ModelSize:
    size = measure(name, kwargs)
    assert size is not None
    return size


def detail(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return str(response.json()["detail"])


def still_serves(client: Client) -> None:
    answer = client.add_model("digits_cnn", {"width": 4})
    assert answer.status_code == 201, answer.text


def mlp_weights_bytes(hidden: int, in_features: int = 1_000_000, depth: int = 64) -> int:
    """The state_dict of ``mlp``: float32 linear weights, BatchNorm weight, bias, running mean
    and variance, an int64 batch count per block, and the head's weight and bias."""
    linear = in_features * hidden + (depth - 1) * hidden * hidden
    floats = linear + depth * 4 * hidden + 10 * hidden + 10
    return 4 * floats + 8 * depth


def test_a_huge_mlp_is_refused_before_it_is_built(stack: Stack) -> None:
    client = stack.client("bounds-huge")
    huge = {"in_features": 1_000_000, "hidden": 65_536, "depth": 64}
    text = detail(client.add_model("mlp", huge), 422)
    # 1e6 * 65536 + 63 * 65536^2 weights, 64 * 65536 * 2 BatchNorm affines, the head.
    assert "336,127,983,626 parameters" in text, text
    assert "BNADAPT_MAX_WEIGHTS_BYTES" in text and "2.0 GiB" in text, text
    assert "at most 536,870,912 float32 parameters" in text, text
    assert "use hidden <= " in text, text
    fits = int(text.split("hidden <= ")[1].split()[0])
    # What it names is the largest hidden whose weights fit, the other kwargs as given.
    assert mlp_weights_bytes(fits) <= 2 * 1024**3 < mlp_weights_bytes(fits + 1), text
    assert "allocat" not in text.lower(), text
    still_serves(client)


def test_a_model_past_the_inspection_memory_is_refused_with_what_fits(stack: Stack) -> None:
    client = stack.client("bounds-memory")
    # 120M parameters (480 MB of weights, within the weights limit) held three times, and
    # the probe's activations: past the 768 MiB an inspection may use here.
    text = detail(client.add_model("resnet", {"width": 256, "depth": 16}), 422)
    assert "119,857,418 parameters" in text, text
    assert "768.0 MiB one inspection may use" in text, text
    assert "BNADAPT_INSPECT_MEMORY_BYTES" in text, text
    assert "use depth <= " in text and "width <= " in text, text
    # What it names is the largest width that fits, the depth as given (measured here on the
    # meta device, as the inspector does).
    width = int(text.split("width <= ")[1].split()[0])
    limits = BuildLimits(2 * 1024**3, CAP_BYTES)
    assert limits.fits(measured("resnet", {"width": width, "depth": 16})), text
    assert not limits.fits(measured("resnet", {"width": width + 1, "depth": 16})), text
    still_serves(client)


def test_a_build_past_its_process_cap_is_answered_clearly(stack: Stack) -> None:
    client = stack.client("bounds-cap")
    text = detail(client.add_model("memory_hog", {"mib": 2048}), 422)
    assert "ran out of the memory one inspection may use (768.0 MiB" in text, text
    assert "allocat" not in text.lower() and "DefaultCPUAllocator" not in text, text
    still_serves(client)


def test_a_killed_build_is_answered_and_the_inspector_keeps_serving(stack: Stack) -> None:
    client = stack.client("bounds-killed")
    text = detail(client.add_model("killed_build", {"signum": 9}), 503)
    assert "ended (SIGKILL) before it answered" in text, text
    assert "started again: retry" in text, text
    still_serves(client)


def test_a_build_past_the_wait_is_stopped_and_answered(stack: Stack) -> None:
    client = stack.client("bounds-slow")
    text = detail(client.add_model("slow_build", {"seconds": 3 * TIMEOUT_S}), 422)
    assert "took longer than" in text and "BNADAPT_INSPECT_TIMEOUT_S" in text, text
    still_serves(client)


def waiting_requests(stack: Stack) -> int:
    """Inspection requests waiting for an inspector, in any list."""
    redis = stack.records().client
    return sum(
        int(redis.llen(key))
        for key in redis.scan_iter(match=f"{keys.PREFIX}:inspect:requests*")
        if redis.type(key) in (b"list", "list")
    )


def test_one_tenant_s_registration_waits_for_none_of_another_s_builds(stack: Stack) -> None:
    """A has one build in flight (its turn allows no more) and three waiting; B's registration
    is built in the inspector's second lane (BNADAPT_INSPECT_BUILDERS, 2 by default) while
    A's build still runs: none of A's answers comes between B's request and B's answer. With
    one lane it would wait for the build in flight (at most one); first in, first out, for all
    four."""
    a, b = stack.client("bounds-a"), stack.client("bounds-b")
    answers: list[str] = []
    lock = threading.Lock()

    def register(client: Client, name: str, kwargs: dict[str, Any], seed: int) -> None:
        response = client.add_model(name, kwargs, seed=seed)
        with lock:
            answers.append(f"{name}:{seed}:{response.status_code}")

    a_threads = []
    for seed in range(4):
        thread = threading.Thread(target=register, args=(a, "slow_build", {"seconds": 3}, seed))
        thread.start()
        a_threads.append(thread)
    try:
        # A's first build in flight, the other three waiting behind it.
        wait_for(
            lambda: waiting_requests(stack) == 3 and not answers,
            timeout_s=60,
            what="A's first build to be taken and three to wait",
        )
        with lock:
            answered_before = len(answers)
        register(b, "digits_cnn", {"width": 4}, 0)
    finally:
        for thread in a_threads:
            thread.join(timeout=4 * TIMEOUT_S)
    assert sorted(answers) == sorted(
        [f"slow_build:{s}:201" for s in range(4)] + ["digits_cnn:0:201"]
    ), answers
    # A's builds answered after B's request was queued and before B's answer: none.
    ahead = answers.index("digits_cnn:0:201") - answered_before
    assert ahead == 0, answers
