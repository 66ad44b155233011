"""Cost of bnadapt's checkpoint wrapper against torch.utils.checkpoint, on a ResNet with BatchNorm.

The model: a stem, 8 residual blocks (4 of 32 channels at 32x32, 4 of 64 channels at 16x16) and
a linear head over 10 classes; a batch is 32 RGB images of 32x32. Every residual block is
checkpointed. Four measurements, each a ratio against a baseline measured in the same run:

1. Train step (forward, cross-entropy, backward, SGD step): bnadapt's checkpoint wrapper over
   torch's non-reentrant checkpoint on the same blocks of one model. Every block sits behind
   both (``Switched``: the same block object is the child of a ``CheckpointWrapper`` and of a
   module that calls torch's checkpoint), so the two variants run the very same parameters,
   buffers, optimizer and memory, and differ in the checkpoint code only; steps are timed
   alternately, one of each, in alternating order after a warm-up. The result is the median
   of the paired ratios, with the quartiles as the spread and a distribution-free 95 %
   confidence interval of the median (order statistics of the binomial). Target <= 1.01.
   ``control`` times torch's checkpoint against itself the same way: how far from 1.000 the
   method itself lands, and how wide its interval is, on the machine of the day.
1b. Compiled train step: the same two models, each under ``torch.compile`` (inductor, whole
   model), timed the same way after compiling. Target <= 1.02.
2. Peak memory of train steps, one fresh process per variant: ``none`` (no checkpointing),
   ``torch`` and ``bnadapt``. On CPU it is the peak RSS (``ru_maxrss``) after a few steps, less
   the peak RSS after the warm-up, so that torch's own libraries do not dominate; on CUDA it is
   ``torch.cuda.max_memory_allocated`` less the memory allocated after the warm-up. The warm-up
   is a train step on one image, which loads every library the steps use (torch's checkpoint
   imports ~800 modules on its first call with grad enabled), then a no-grad forward of the
   full batch. The memory runs use a larger batch, so the saved activations stand out on CPU.
   Target bnadapt / torch <= 1.01; bnadapt / none shows the saving.
3. No-grad adaptation step (``model.train()``, a forward under ``torch.no_grad()``, which
   updates BatchNorm's running statistics): the wrapped model over the unwrapped one, timed
   like 1. Target <= 1.02.
4. ``launch`` (not in the default set): the train step of 1. on a batch of 2 images of 8x8,
   where every operator is so small that the step is bound by the per-call cost of Python and
   of torch's dispatch, not by arithmetic, as an eager CUDA step of a small model is bound by
   the CPU that launches its kernels. It shows the wrapper's fixed cost per block call (the
   median paired difference over the 8 blocks), which a GPU step pays in full; no target.

Run from the repository root: ``python -m bench.checkpoint.wrapper`` prints a markdown table;
``--quick`` is a smoke run of a few steps, whose numbers mean nothing. torch runs on 1 thread
unless ``--threads`` says otherwise (see DEFAULT_THREADS). ``--measure train adapt`` runs only
those measurements (of train, compiled, adapt, memory), ``--pairs N`` sets every timing's
number of pairs. Each timing also gives the paired ratio of the process's CPU time per step
(``time.process_time``): it moves less with a neighbour's load than wall time, though with 2
threads it includes OpenMP's spinning at its barriers. ``--profile`` instead profiles a few
eager train steps of each variant (torch.profiler) and prints where their CPU time differs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from bench import REPO
from bench.checkpoint._resnet import CLASSES, IMAGE_SIZE, Block, ResNet
from bench.recording import Measured, add_record_options, met, spread, threads_text, write_figures
from bnadapt.checkpoint import apply_checkpointing, checkpoint_wrapper

# One of the 2 cores of the machine the results were taken on, fixed for every run: it is
# shared, and with 2 intra-op threads any other runnable process stalls OpenMP's barrier, so
# steps took either ~0.6 s or 2-5 s. With 1 the other core absorbs the neighbours.
DEFAULT_THREADS = 1
BATCH = 32
SEED = 0

TRAIN_TARGET = 1.01
COMPILED_TARGET = 1.02
ADAPT_TARGET = 1.02
MEMORY_TARGET = 1.01
COMPILE_BACKEND = "inductor"

VARIANTS = ("none", "torch", "bnadapt")
MEASUREMENTS = ("train", "control", "compiled", "adapt", "memory", "launch")
DEFAULT_MEASUREMENTS = ("train", "compiled", "adapt", "memory")

# glibc keeps freed blocks above its (self-raising) mmap threshold in the heap, so the peak RSS
# of a run that frees and reallocates activations, as recomputation does, would count heap
# retention. A fixed threshold returns every tensor's pages to the OS when it is freed, so the
# peak RSS follows the live tensors. Other C libraries ignore the variable.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
RSS_UNIT_BYTES = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
MIB = 2**20
# The launch-bound batch of measurement 4: 2 images of 8x8.
LAUNCH_BATCH = 2
LAUNCH_IMAGE_SIZE = 8


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long each measurement runs."""

    train_pairs: int  # paired ratios of train steps
    compiled_pairs: int  # paired ratios of compiled train steps
    adapt_pairs: int  # paired ratios of adaptation steps, cheaper and with a tighter target
    launch_pairs: int  # paired ratios of launch-bound train steps, ~25x cheaper than train's
    warmup_steps: int  # untimed steps of each variant before a timing
    memory_batch: int
    memory_steps: int


FULL = Plan(
    train_pairs=100,
    compiled_pairs=100,
    adapt_pairs=120,
    launch_pairs=1000,
    warmup_steps=3,
    memory_batch=128,
    memory_steps=2,
)
QUICK = Plan(
    train_pairs=3,
    compiled_pairs=3,
    adapt_pairs=3,
    launch_pairs=3,
    warmup_steps=1,
    memory_batch=BATCH,
    memory_steps=1,
)


class TorchCheckpointed(nn.Module):
    """The baseline: a block run through torch's own non-reentrant checkpoint."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch_checkpoint(self.block, x, use_reentrant=False)
        return out


class Switched(nn.Module):
    """One block behind both checkpoints (``theirs``: torch's, unless another wrapper is
    given); ``use`` says which one runs."""

    def __init__(
        self, block: nn.Module, theirs: Callable[[nn.Module], nn.Module] = TorchCheckpointed
    ) -> None:
        super().__init__()
        self.ours = checkpoint_wrapper(block)
        self.theirs = theirs(block)
        self.use = "bnadapt"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = (self.ours if self.use == "bnadapt" else self.theirs)(x)
        return out


def switched_steps(
    model: ResNet,
    x: torch.Tensor,
    y: torch.Tensor,
    theirs: Callable[[nn.Module], nn.Module] = TorchCheckpointed,
) -> dict[str, Callable[[], None]]:
    """Train steps of one copy of ``model`` whose blocks are :class:`Switched`, by variant
    (``bnadapt``, ``torch``: ``theirs``): each step first points every block at its variant."""
    model = copy.deepcopy(model)
    switches = []
    for i, block in enumerate(model.blocks):
        switches.append(Switched(block, theirs))
        model.blocks[i] = switches[-1]
    step = train_step(model, x, y)

    def step_of(variant: str) -> Callable[[], None]:
        def run() -> None:
            for switch in switches:
                switch.use = variant
            step()

        return run

    return {variant: step_of(variant) for variant in ("bnadapt", "torch")}


def make_variant(model: ResNet, variant: str) -> ResNet:
    """A copy of ``model`` with its blocks checkpointed as ``variant`` says."""
    model = copy.deepcopy(model)
    if variant == "bnadapt":
        apply_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    elif variant == "torch":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = TorchCheckpointed(block)
    return model


def make_batch(
    size: int, device: torch.device, image_size: int = IMAGE_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, 3, image_size, image_size, device=device)
    y = torch.randint(0, CLASSES, (size,), device=device)
    return x, y


def train_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, compiled: bool = False
) -> Callable[[], None]:
    """One forward, backward and SGD step of ``model`` on ``(x, y)``, with its own optimizer;
    ``compiled``: the forward (and so the backward) through ``torch.compile``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    forward: Callable[[torch.Tensor], torch.Tensor] = model
    if compiled:
        forward = torch.compile(model, backend=COMPILE_BACKEND)  # type: ignore[assignment]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(forward(x), y).backward()
        optimizer.step()

    return step


def adaptation_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """One BN adaptation pass: a train-mode forward without grad."""
    model.train()

    def step() -> None:
        with torch.no_grad():
            model(x)

    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass(frozen=True)
class PairedTiming:
    """Wall-clock and process CPU seconds per step of a measured variant and of its baseline,
    timed in adjacent pairs."""

    measured_s: list[float]
    baseline_s: list[float]
    measured_cpu_s: list[float]
    baseline_cpu_s: list[float]

    def ratio_quartiles(self, cpu: bool = False) -> tuple[float, float, float]:
        """Lower quartile, median and upper quartile of the paired ratios (of CPU time with
        ``cpu``)."""
        measured, baseline = (
            (self.measured_cpu_s, self.baseline_cpu_s)
            if cpu
            else (self.measured_s, self.baseline_s)
        )
        ratios = [m / b for m, b in zip(measured, baseline, strict=True)]
        if len(ratios) == 1:
            return ratios[0], ratios[0], ratios[0]
        low, median, high = statistics.quantiles(ratios, n=4, method="inclusive")
        return low, median, high

    def median_interval(self) -> tuple[float, float]:
        """A distribution-free 95 % confidence interval of the median wall-clock ratio: the
        order statistics at n/2 -+ 1.96 sqrt(n)/2 (the normal approximation of the binomial
        count of ratios below the median), clamped to the sample."""
        ratios = sorted(m / b for m, b in zip(self.measured_s, self.baseline_s, strict=True))
        n = len(ratios)
        half_width = 1.96 * math.sqrt(n) / 2
        low = max(math.floor(n / 2 - half_width), 0)
        high = min(math.ceil(n / 2 + half_width), n - 1)
        return ratios[low], ratios[high]


def time_paired(
    measured: Callable[[], None],
    baseline: Callable[[], None],
    pairs: int,
    warmup_steps: int,
    device: torch.device,
) -> PairedTiming:
    """Time one step of each, back to back, ``pairs`` times; which runs first alternates, so
    that neither always runs in the other's wake (caches, clock, a neighbour's load)."""

    def timed(step: Callable[[], None], wall_s: list[float], cpu_s: list[float]) -> None:
        synchronize(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        synchronize(device)
        wall_s.append(time.perf_counter() - start)
        cpu_s.append(time.process_time() - start_cpu)

    for _ in range(warmup_steps):
        measured()
        baseline()
    timing = PairedTiming([], [], [], [])
    ours = (measured, timing.measured_s, timing.measured_cpu_s)
    theirs = (baseline, timing.baseline_s, timing.baseline_cpu_s)
    for pair in range(pairs):
        for args in (ours, theirs) if pair % 2 == 0 else (theirs, ours):
            timed(*args)
    return timing


@dataclasses.dataclass(frozen=True)
class MemoryResult:
    """Memory of one variant's process, in MiB: after the warm-up and at the peak of training."""

    variant: str
    after_warmup_mib: float
    peak_mib: float

    @property
    def delta_mib(self) -> float:
        return self.peak_mib - self.after_warmup_mib


def measure_memory(variant: str, plan: Plan, device: torch.device) -> MemoryResult:
    """Memory of ``plan.memory_steps`` train steps of ``variant``; meant for a fresh process."""
    torch.manual_seed(SEED)
    model = make_variant(ResNet(), variant).to(device)
    step = train_step(model, *make_batch(1, device))
    step()
    x, y = make_batch(plan.memory_batch, device)
    with torch.no_grad():
        model(x)
    synchronize(device)
    if device.type == "cuda":
        after_warmup = torch.cuda.memory_allocated(device) / MIB
        torch.cuda.reset_peak_memory_stats(device)
    else:
        after_warmup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RSS_UNIT_BYTES / MIB

    step = train_step(model, x, y)
    for _ in range(plan.memory_steps):
        step()
    synchronize(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / MIB
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RSS_UNIT_BYTES / MIB
    return MemoryResult(variant, after_warmup, peak)


def memory_in_fresh_process(variant: str, quick: bool, threads: int) -> MemoryResult:
    """Run this bench in a fresh process with ``--variant`` and read the JSON line it prints."""
    command = [sys.executable, "-m", "bench.checkpoint.wrapper", "--variant", variant]
    command += ["--threads", str(threads)]
    if quick:
        command.append("--quick")
    # stderr is not captured: a failing child's traceback shows above the parent's.
    done = subprocess.run(
        command,
        env={**os.environ, **MEMORY_ENV},
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        cwd=REPO,
    )
    return MemoryResult(**json.loads(done.stdout.splitlines()[-1]))


def verdict(ratio: float, target: float) -> str:
    return "yes" if ratio <= target else "**no**"


def interval_verdict(interval: tuple[float, float], target: float | None) -> str:
    """What the median's 95 % interval says of the target: below it, above it, or neither."""
    if target is None:
        return "-"
    if interval[1] <= target:
        return "met"
    if interval[0] > target:
        return "**missed**"
    return "not resolved"


def timing_row(name: str, baseline: str, timing: PairedTiming, target: float | None) -> str:
    low, median, high = timing.ratio_quartiles()
    cpu_low, cpu_median, cpu_high = timing.ratio_quartiles(cpu=True)
    interval = timing.median_interval()
    goal = "-" if target is None else f"<= {target}"
    met = "-" if target is None else verdict(median, target)
    return (
        f"| {name} | {statistics.median(timing.measured_s) * 1e3:.1f} ms "
        f"| {baseline} {statistics.median(timing.baseline_s) * 1e3:.1f} ms "
        f"| **{median:.3f}** ({low:.3f}-{high:.3f}) | {interval[0]:.3f}-{interval[1]:.3f} "
        f"| {goal} | {met} | {interval_verdict(interval, target)} "
        f"| {cpu_median:.3f} ({cpu_low:.3f}-{cpu_high:.3f}) |"
    )


def memory_row(name: str, ours: MemoryResult, baseline: MemoryResult, target: float | None) -> str:
    ratio = ours.delta_mib / baseline.delta_mib
    if target is None:
        goal, met = "(the saving)", "-"
    else:
        goal, met = f"<= {target}", verdict(ratio, target)
    return (
        f"| {name} | {ours.delta_mib:.0f} MiB | {baseline.variant} {baseline.delta_mib:.0f} MiB "
        f"| **{ratio:.3f}** | {goal} | {met} |"
    )


def per_block_call_us(timing: PairedTiming) -> float:
    """The wrapper's fixed cost per block call: the median paired difference of the steps over
    the blocks, in microseconds."""
    differences = [m - b for m, b in zip(timing.measured_s, timing.baseline_s, strict=True)]
    return statistics.median(differences) / len(ResNet().blocks) * 1e6


def report(
    timings: dict[str, PairedTiming],
    memory: dict[str, MemoryResult],
    plan: Plan,
    device: torch.device,
    threads: int,
) -> str:
    """The markdown tables of the measurements that ran (``timings`` by MEASUREMENTS name)."""
    memory_unit = "CUDA allocated" if device.type == "cuda" else "peak RSS"
    lines = [
        f"torch {torch.__version__}, device {device}, torch threads: {threads}, batch {BATCH}; "
        f"timings: median of {plan.train_pairs} (train), {plan.compiled_pairs} (compiled "
        f"train, {COMPILE_BACKEND}), {plan.adapt_pairs} (adaptation) and {plan.launch_pairs} "
        "(launch-bound) "
        f"paired ratios of wall-clock time, quartiles in brackets, after "
        f"{plan.warmup_steps} warm-up steps, and of process CPU time; memory: batch "
        f"{plan.memory_batch}, {plan.memory_steps} train steps, {memory_unit} over that after "
        "the warm-up.",
        "",
        "| measurement | measured | baseline | ratio (quartiles) | 95 % interval of the median "
        "| target | median met | interval says | CPU-time ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows: dict[str, tuple[str, str, float | None]] = {
        "train": ("train step (fwd + bwd + SGD), one model", "torch", TRAIN_TARGET),
        "control": ("control: torch's checkpoint against itself", "torch", None),
        "compiled": ("compiled train step", "torch compiled", COMPILED_TARGET),
        "adapt": ("no-grad adaptation step", "unwrapped", ADAPT_TARGET),
        "launch": (
            f"train step, launch-bound ({LAUNCH_BATCH} images of "
            f"{LAUNCH_IMAGE_SIZE}x{LAUNCH_IMAGE_SIZE})",
            "torch",
            None,
        ),
    }
    for key, timing in timings.items():
        lines.append(timing_row(*rows[key][:2], timing, rows[key][2]))
    if "launch" in timings:
        lines += [
            "",
            f"Launch-bound: the wrapper's fixed cost per block call (median paired difference "
            f"over {len(ResNet().blocks)} blocks): {per_block_call_us(timings['launch']):.0f} us.",
        ]
    if memory:
        lines.append("")
        lines += [
            "| measurement | bnadapt | baseline | ratio | target | met |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            memory_row("train-step memory", memory["bnadapt"], memory["torch"], MEMORY_TARGET),
            memory_row("train-step memory", memory["bnadapt"], memory["none"], None),
            "",
            f"| variant | {memory_unit} after warm-up | peak | delta |",
            "|---|---|---|---|",
        ]
        for result in memory.values():
            lines.append(
                f"| {result.variant} | {result.after_warmup_mib:.0f} MiB "
                f"| {result.peak_mib:.0f} MiB | {result.delta_mib:.0f} MiB |"
            )
    return "\n".join(lines)


def ratio_text(timing: PairedTiming) -> str:
    """The median paired ratio with its quartiles, as the records give it."""
    low, median, high = timing.ratio_quartiles()
    return spread(median, low, high)


def ratio_met(timing: PairedTiming, target: float) -> bool:
    return timing.ratio_quartiles()[1] <= target


def figures(
    timings: dict[str, PairedTiming],
    memory: dict[str, MemoryResult],
    device: torch.device,
    threads: int,
) -> list[Measured]:
    """The records of the measurements that ran: on a GPU the eager train and adaptation steps
    in one figure, on the CPU each its own."""
    found: list[Measured] = []
    count = threads_text(threads)
    at = f"at {count}"
    if device.type == "cuda":
        if "train" in timings and "adapt" in timings:
            train, adapt = timings["train"], timings["adapt"]
            found.append(
                Measured(
                    "checkpoint-gpu-step",
                    "on a GPU: eager train step / no-grad adaptation step, wrapper / torch",
                    f"{ratio_text(train)} / {ratio_text(adapt)}",
                    met(
                        f"<= {TRAIN_TARGET} / {ADAPT_TARGET}",
                        ratio_met(train, TRAIN_TARGET) and ratio_met(adapt, ADAPT_TARGET),
                    ),
                )
            )
        return found
    # (measurement, record, figure, target, what the value adds)
    steps = (
        (
            "train",
            "checkpoint-train-step",
            f"wrapper train step / torch's checkpoint, ResNet 8 blocks, batch {BATCH}",
            TRAIN_TARGET,
            f" {at}",
        ),
        (
            "compiled",
            "checkpoint-compiled-step",
            f"the same train step, both compiled with {COMPILE_BACKEND}",
            COMPILED_TARGET,
            f" {at}",
        ),
        (
            "adapt",
            "checkpoint-adapt-step",
            f"no-grad adaptation step, wrapper / unwrapped, {count}",
            ADAPT_TARGET,
            "",
        ),
    )
    for key, name, figure, target, where in steps:
        if key in timings:
            timing = timings[key]
            goal = met(f"<= {target}", ratio_met(timing, target))
            found.append(Measured(name, figure, ratio_text(timing) + where, goal))
    if "launch" in timings:
        found.append(
            Measured(
                "checkpoint-launch-bound",
                f"launch-bound train step ({LAUNCH_BATCH} images of "
                f"{LAUNCH_IMAGE_SIZE}x{LAUNCH_IMAGE_SIZE}), wrapper / torch's checkpoint",
                f"{ratio_text(timings['launch'])}: "
                f"{per_block_call_us(timings['launch']):.0f} us per block call",
                "none (the fixed cost per call)",
            )
        )
    if memory:
        ours = memory["bnadapt"].delta_mib
        ratio = ours / memory["torch"].delta_mib
        found.append(
            Measured(
                "checkpoint-memory",
                "train-step peak memory, wrapper / torch's checkpoint "
                f"(/ none: {ours / memory['none'].delta_mib:.3f})",
                round(ratio, 3),
                met(f"<= {MEMORY_TARGET}", ratio <= MEMORY_TARGET),
            )
        )
    return found


PROFILE_STEPS = 10


def profile_difference(device: torch.device) -> str:
    """Median self CPU time per step of each operator, bnadapt against torch, over
    PROFILE_STEPS eager train steps of each after a warm-up, profiled one step at a time in
    alternation (as the timings are) so that a neighbour's load falls on both; the largest
    differences first."""
    torch.manual_seed(SEED)
    model = ResNet().to(device)
    x, y = make_batch(BATCH, device)
    steps = {v: train_step(make_variant(model, v), x, y) for v in ("bnadapt", "torch")}
    samples: dict[str, dict[str, list[float]]] = {v: {} for v in steps}
    for step in steps.values():
        step()
        step()
    for _ in range(PROFILE_STEPS):
        for variant, step in steps.items():
            with torch.profiler.profile() as prof:
                step()
            for event in prof.key_averages():
                samples[variant].setdefault(event.key, []).append(event.self_cpu_time_total / 1e3)
    # The median step of each operator (steps without it count 0): a step stalled by a
    # neighbour moves a mean, not a median.
    per_step = {
        variant: {
            key: statistics.median(ms + [0.0] * (PROFILE_STEPS - len(ms)))
            for key, ms in by_key.items()
        }
        for variant, by_key in samples.items()
    }
    ours, theirs = per_step["bnadapt"], per_step["torch"]
    total_ours, total_theirs = sum(ours.values()), sum(theirs.values())
    rows = sorted(
        ((ours.get(k, 0.0) - theirs.get(k, 0.0), k) for k in ours.keys() | theirs.keys()),
        reverse=True,
    )
    lines = [
        f"self CPU time per eager train step (ms): bnadapt {total_ours:.1f}, torch "
        f"{total_theirs:.1f}, difference {total_ours - total_theirs:+.2f}",
        "",
        "| operator | bnadapt ms | torch ms | difference |",
        "|---|---|---|---|",
    ]
    for difference, key in rows[:12]:
        lines.append(
            f"| {key} | {ours.get(key, 0.0):.3f} | {theirs.get(key, 0.0):.3f} | {difference:+.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few steps")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch threads")
    parser.add_argument(
        "--profile", action="store_true", help="profile eager train steps of both variants"
    )
    parser.add_argument(
        "--measure",
        nargs="+",
        choices=MEASUREMENTS,
        default=list(DEFAULT_MEASUREMENTS),
        help="which measurements to run (default: all but control)",
    )
    parser.add_argument(
        "--pairs", type=int, help="pairs for every timing (default: the plan's, 100-120)"
    )
    parser.add_argument(
        "--variant",
        choices=VARIANTS,
        help="internal: measure this variant's train-step memory and print it as JSON",
    )
    add_record_options(parser)
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.pairs is not None:
        plan = dataclasses.replace(
            plan,
            train_pairs=args.pairs,
            compiled_pairs=args.pairs,
            adapt_pairs=args.pairs,
            launch_pairs=args.pairs,
        )
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    if args.variant is not None:
        result = measure_memory(args.variant, plan, device)
        print(json.dumps(dataclasses.asdict(result)))
        return
    if args.profile:
        print(profile_difference(device))
        return

    load_at_start = os.getloadavg()[0]
    measure = set(args.measure)
    # Memory first: a child's ru_maxrss starts at its parent's RSS (Linux keeps it across fork
    # and exec), so the parent must still be no bigger than torch's import when they run.
    memory = {}
    if "memory" in measure:
        memory = {v: memory_in_fresh_process(v, args.quick, args.threads) for v in VARIANTS}
    torch.manual_seed(SEED)
    model = ResNet().to(device)
    x, y = make_batch(BATCH, device)
    timings: dict[str, PairedTiming] = {}
    if "train" in measure:
        steps = switched_steps(model, x, y)
        timings["train"] = time_paired(
            steps["bnadapt"], steps["torch"], plan.train_pairs, plan.warmup_steps, device
        )
    if "control" in measure:
        steps = switched_steps(model, x, y)
        timings["control"] = time_paired(
            steps["torch"], steps["torch"], plan.train_pairs, plan.warmup_steps, device
        )
    if "compiled" in measure:
        timings["compiled"] = time_paired(
            train_step(make_variant(model, "bnadapt"), x, y, compiled=True),
            train_step(make_variant(model, "torch"), x, y, compiled=True),
            plan.compiled_pairs,
            plan.warmup_steps,
            device,
        )
    if "launch" in measure:
        small_x, small_y = make_batch(LAUNCH_BATCH, device, LAUNCH_IMAGE_SIZE)
        steps = switched_steps(model, small_x, small_y)
        timings["launch"] = time_paired(
            steps["bnadapt"], steps["torch"], plan.launch_pairs, plan.warmup_steps, device
        )
    if "adapt" in measure:
        timings["adapt"] = time_paired(
            adaptation_step(make_variant(model, "bnadapt"), x),
            adaptation_step(make_variant(model, "none"), x),
            plan.adapt_pairs,
            plan.warmup_steps,
            device,
        )
    print(report(timings, memory, plan, device, args.threads))
    print(
        f"\n1-minute load average: {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} "
        f"at the end, on {os.cpu_count()} CPUs (other work on the machine widens the quartiles)."
    )
    write_figures("bench.checkpoint.wrapper", args, figures(timings, memory, device, args.threads))


if __name__ == "__main__":
    main()
