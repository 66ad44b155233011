"""Quality of BatchNorm adaptation on real data, run through the service (HTTP, real worker).

Data: scikit-learn's bundled digits (1,797 8x8 images, no download), split as ``bnadapt demo``
splits them (service/local/demo.py: a permutation with seed 0, 1,200 to train, 597 to test).

1. Train: the built-in ``digits_cnn`` (width 16) registered with fresh weights (seed 0) and
   trained by a ``train`` job on the 1,200 training digits with the demo's params (15 epochs of
   SGD, lr 0.05, momentum 0.9, batch 32, 10% held out for validation, seed 0).
2. Test sets: the 597 test digits clean, under each shift of bench/adaptation/_quality_shifts.py
   (contrast, brightness, scale, Gaussian noise, Gaussian blur at 3 severities each, and
   inversion), under each shift's per-image variant (every image its own level, up to severity
   3; inversion of half the images) and under mixtures of two conditions (each image one or the
   other), each uploaded once as a labelled dataset.
3. Source: an ``evaluate`` job of the trained model on every test set.
4. Adapt: for every test set, estimator and number of target samples ``n`` in 16, 64, 256 and
   all 597, an ``adapt`` job on the first ``n`` digits of that test set (the test order is a
   random permutation, so these are a random sample, the same digits for every condition):
   ``batch_size = min(n, 64)`` and ``max_batches = ceil(n / batch_size)``; all 597 run as 10
   batches, the last of 21. Estimators: ``precise``, ``precise`` with ``layerwise: true`` (one
   pass per BatchNorm layer), ``cumulative``, ``ema`` (one pass with the
   layers' momentum 0.1, the loop users write by hand), ``prior`` (N = 16 over ``precise``,
   Schneider et al.'s setting) and ``entropy`` (TENT: Adam, lr 1e-3, 50 steps cycling over the
   ``n`` samples' batches, so that the running statistics, blended with momentum 0.1, keep
   0.9^50 < 1% of the source ones; one pass would leave 35% to 90% of them, since this
   service evaluates with running statistics, not with TENT's test-batch statistics), and
   ``auto`` (holds 1/4 of the n samples out, chooses among the source statistics, ``precise``
   and three ``prior`` mixes on them, workers/estimators/auto.py) and ``auto`` with
   ``allow_backward`` (the same plus ``entropy`` with the settings above).
5. Evaluate: an ``evaluate`` job of every adapted model on the whole test set of its condition
   (all 597 digits), so every accuracy is measured on the same full set. As a cross-check, each
   evaluate result must equal the adapt job's own ``metrics_after`` (the same computation on
   the same dataset, in the adapt job's batch size, which it measures in), and each source
   result the adapt jobs' ``metrics_before``.

All jobs are submitted at once and then polled; the worker runs them one after the other.
Run from the repository root: ``.venv/bin/python -m bench.adaptation.quality`` (about 5 minutes on
2 cores) prints progress on stderr and the markdown section of bench/RESULTS.md on stdout;
``--quick`` is a smoke run (4 conditions, n in 16 and all, 3 training epochs) whose numbers
mean little; ``--json PATH`` also writes every accuracy and job id.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from api_schemas import JobPublic, JobStatus
from api_schemas.reports import Metrics
from bench.adaptation._quality_report import (
    AUTO_GAIN_SHARE,
    AUTO_LOSS_POINTS,
    NOISE_GAIN_POINTS,
    PRECISE_WITHIN_CLEAN_POINTS,
    Results,
    accuracy_tables,
    auto_choice_table,
    auto_summary,
    auto_verdicts,
    main_table,
    noise_gains,
    target_lines,
    verdicts,
)
from bench.adaptation._quality_shifts import CLEAN, SHIFTS, condition_names, shifted
from bench.recording import Measured, add_record_options, met, write_figures
from bench.service.stack import BenchStack, cpu_seconds
from harness.servers import new_redis_server
from service.client import Client, new_model_id
from service.local.demo import TRAIN_PARAMS, digits_split, train_digits_cnn, write_npz

# The default seed of the noise and the adapt jobs; the split, the model's init and training use 0.
SEED: Final = 0
# "layerwise" is `precise` with `layerwise: true`; "auto_backward" is `auto` with
# `allow_backward: true` (entropy among its candidates).
ESTIMATORS: Final = (
    "precise",
    "layerwise",
    "cumulative",
    "ema",
    "prior",
    "entropy",
    "auto",
    "auto_backward",
)
FIXED: Final = ESTIMATORS[:6]
AUTOS: Final = ESTIMATORS[6:]
BATCH_SIZE: Final = 64
PRIOR_STRENGTH: Final = 16.0
ENTROPY_STEPS: Final = 50
ENTROPY_LR: Final = 1e-3
LABELS: Final = {
    "precise": "precise",
    "layerwise": "precise layerwise",
    "cumulative": "cumulative",
    "ema": "ema",
    "prior": f"prior N={PRIOR_STRENGTH:g}",
    "entropy": f"entropy {ENTROPY_STEPS} steps",
    "auto": "auto",
    "auto_backward": "auto + entropy",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    conditions: tuple[str, ...]
    sample_counts: tuple[int | None, ...]  # None: the whole test set
    epochs: int
    estimators: tuple[str, ...] = ESTIMATORS
    # Evaluate every adapted model in its own job and compare with the adapt job's metrics;
    # without, accuracies are the adapt jobs' own `metrics_after` (the same computation).
    cross_check: bool = True
    seed: int = SEED  # of the noise and of the adapt jobs (their holdout draws)


FULL: Final = Plan(tuple(condition_names(mixed=True)), (16, 64, 256, None), TRAIN_PARAMS["epochs"])
QUICK: Final = Plan(
    (CLEAN, "contrast-3", "gaussian_noise-3", "invert-1", "scale-h3", "clean+invert-1"),
    (16, None),
    3,
)
# The auto estimator against the fixed estimators that can be the best (cumulative and
# layerwise equal precise to a tenth of a point, ema is below it), adapted on all the test
# digits: a sixth of the jobs of FULL, for a loaded machine.
AUTO: Final = Plan(
    FULL.conditions,
    (None,),
    FULL.epochs,
    ("precise", "prior", "entropy", "auto", "auto_backward"),
    cross_check=False,
)


def adapt_params(estimator: str, n: int | None, seed: int = SEED) -> dict[str, Any]:
    """The adapt job's params for ``n`` target samples (the first ``n`` of the dataset)."""
    batch = BATCH_SIZE if n is None else min(n, BATCH_SIZE)
    name = {"layerwise": "precise", "auto_backward": "auto"}.get(estimator, estimator)
    params: dict[str, Any] = {"estimator": name, "batch_size": batch, "seed": seed}
    if n is not None:
        params["max_batches"] = math.ceil(n / batch)
    if estimator == "layerwise":
        params["layerwise"] = True
    if estimator == "prior":
        params |= {"prior_strength": PRIOR_STRENGTH, "prior_base": "precise"}
    if estimator in ("entropy", "auto_backward"):
        params |= {"steps": ENTROPY_STEPS, "lr": ENTROPY_LR, "optimizer": "adam"}
    if estimator == "auto_backward":
        params["allow_backward"] = True
    return params


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait_all(client: Client, jobs: list[JobPublic], what: str) -> list[JobPublic]:
    """Polls each job in submission order (the order the worker runs them) until it ends."""
    done: list[JobPublic] = []
    for index, job in enumerate(jobs, 1):
        done.append(client.wait(job.id))
        if index % 50 == 0 or index == len(jobs):
            log(f"{what}: {index}/{len(jobs)} ended")
    return done


def metrics_of(client: Client, job: JobPublic, when: str) -> Metrics | None:
    if job.status is not JobStatus.SUCCEEDED:
        return None
    report = client.report(job.id)
    return report.metrics_before if when == "before" else report.metrics_after


def auto_choice(client: Client, job: JobPublic) -> str:
    """What an auto job kept, from its report: ``source``, ``precise``, ``prior w=...``."""
    found = client.report(job.id).auto
    if found is None:
        return "no choice reported"
    kept = found.candidates[found.chosen_index]
    return kept.name + ("" if kept.source_weight is None else f" w={kept.source_weight:g}")


@contextlib.contextmanager
def service(root: Path) -> Iterator[BenchStack]:
    redis = new_redis_server(root / "redis")
    stack = BenchStack(root / "stack", redis)
    try:
        stack.start_worker()
        stack.start_api()
        yield stack
    finally:
        stack.stop()
        redis.stop()


def run(plan: Plan, root: Path) -> tuple[Results, dict[str, Any]]:
    split = digits_split()
    num_test = len(split.x_test)
    files = root / "files"
    files.mkdir(parents=True)
    train_file = write_npz(files / "train.npz", split.x_train, split.y_train)
    test_files = {
        c: write_npz(files / f"{c}.npz", shifted(split.x_test, c, plan.seed), split.y_test)
        for c in plan.conditions
    }
    counts = [num_test if n is None else n for n in plan.sample_counts]
    with service(root) as stack:
        client = Client(stack.url, stack.records().create_api_key("quality").key)
        started = time.monotonic()
        log("training the digits CNN through the service")
        with contextlib.redirect_stdout(sys.stderr):  # the demo's progress lines
            source_id = train_digits_cnn(client, train_file, plan.epochs)
        trained_s = time.monotonic() - started
        datasets = {c: client.add_dataset(f, c).id for c, f in test_files.items()}

        keys = [(c, e, n) for c in plan.conditions for e in plan.estimators for n in counts]
        params = {
            key: adapt_params(key[1], None if key[2] == num_test else key[2], plan.seed)
            for key in keys
        }
        # Evaluations in the adapt jobs' batch size, which they measure in: like with like.
        source_jobs = [
            client.submit("evaluate", source_id, datasets[c], {"batch_size": BATCH_SIZE})
            for c in datasets
        ]
        adapt_jobs = [
            client.submit("adapt", source_id, datasets[c], params[c, e, n]) for c, e, n in keys
        ]
        log(f"submitted {len(source_jobs)} source evaluations and {len(adapt_jobs)} adapt jobs")
        sources = wait_all(client, source_jobs, "source evaluations")
        adapted = wait_all(client, adapt_jobs, "adapt jobs")
        ok = [(key, job) for key, job in zip(keys, adapted, strict=True) if job.result is not None]
        eval_jobs = [
            client.submit(
                "evaluate",
                new_model_id(job),
                datasets[key[0]],
                {"batch_size": params[key]["batch_size"]},
            )
            for key, job in (ok if plan.cross_check else [])
        ]
        log(f"submitted {len(eval_jobs)} evaluations of adapted models")
        evaluated = wait_all(client, eval_jobs, "evaluations")
        worker_cpu_s = cpu_seconds(stack.worker_pids())
        elapsed_s = time.monotonic() - started

        failures = [
            f"{job.kind} {job.id}: {job.status.value} {job.error}"
            for job in (*sources, *adapted, *evaluated)
            if job.status is not JobStatus.SUCCEEDED
        ]
        source: dict[str, float] = {}
        for condition, job in zip(datasets, sources, strict=True):
            found = metrics_of(client, job, "before")
            if found is not None and found.accuracy is not None:
                source[condition] = found.accuracy
        accuracy: dict[tuple[str, str, int], float] = {}
        choices: dict[tuple[str, str, int], str] = {}
        mismatches: list[str] = []
        for index, (key, adapt_job) in enumerate(ok):
            if key[1] in AUTOS:
                choices[key] = auto_choice(client, adapt_job)
            if not plan.cross_check:
                found = metrics_of(client, adapt_job, "after")
                if found is not None and found.accuracy is not None:
                    accuracy[key] = found.accuracy
                continue
            eval_job = evaluated[index]
            found = metrics_of(client, eval_job, "before")
            if found is None or found.accuracy is None:
                continue
            accuracy[key] = found.accuracy
            if key[2] != num_test:
                continue  # the adapt job measured itself on its n digits only: nothing to compare
            if metrics_of(client, adapt_job, "after") != found:
                mismatches.append(f"{key}: evaluate {eval_job.id} != adapt {adapt_job.id} after")
            before = metrics_of(client, adapt_job, "before")
            if before is None or before.accuracy != source.get(key[0]):
                mismatches.append(f"{key}: source evaluation != adapt {adapt_job.id} before")

    results = Results(
        conditions=list(plan.conditions),
        estimators=list(plan.estimators),
        sample_counts=counts,
        num_test=num_test,
        source=source,
        adapted=accuracy,
        failures=failures,
        choices=choices,
    )
    facts = {
        "jobs": 1 + len(sources) + len(adapted) + len(evaluated),
        "train_s": trained_s,
        "elapsed_s": elapsed_s,
        "worker_cpu_s": worker_cpu_s,
        "mismatches": mismatches,
        "cross_check": plan.cross_check,
        "seed": plan.seed,
        "source_model": source_id,
    }
    return results, facts


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=95, break_on_hyphens=False, break_long_words=False)


def markdown(results: Results, facts: dict[str, Any], command: str) -> str:
    import torch

    found = verdicts(results, CLEAN)
    autos = [a for a in AUTOS if a in results.estimators]
    fixed = [e for e in FIXED if e in results.estimators]
    found_auto = auto_verdicts(results, CLEAN, autos, fixed)
    n = results.num_test
    lines = [
        "## Quality (digits): auto, per-image and mixed shifts",
        "",
        _wrap(
            f"`{command}` (protocol in its docstring, shifts in "
            "bench/adaptation/_quality_shifts.py). "
            f"{datetime.date.today().isoformat()}; {platform.machine()} Linux, "
            f"{os.cpu_count()} cores, torch {torch.__version__}; one worker. {facts['jobs']} "
            f"jobs through the service (1 train job, {facts['train_s']:.0f} s) in "
            f"{facts['elapsed_s'] / 60:.1f} minutes, worker CPU {facts['worker_cpu_s']:.0f} s. "
            f"Seeds: split 0, model init 0, training 0, noise {facts['seed']}, adapt jobs "
            f"{facts['seed']}. "
            f"Accuracy in % of the {n} test digits (one digit is {100 / n:.2f} points), always "
            f"measured on the whole test set of the condition; adapt jobs in batches of "
            f"{BATCH_SIZE} (fewer for n = 16), `ema` one pass, `prior` N = "
            f"{PRIOR_STRENGTH:g} over `precise`, `entropy` {ENTROPY_STEPS} Adam steps with lr "
            f"{ENTROPY_LR:g}."
        ),
        "",
        _wrap(
            "Conditions (formulas in bench/adaptation/_quality_shifts.py; brightness and noise "
            "clipped to [0, 1]): "
            + "; ".join(
                f"{shift.name}-1..{len(shift.levels)}: {shift.symbol} = "
                + ", ".join(f"{level:g}" for level in shift.levels)
                for shift in SHIFTS
                if shift.symbol
            )
            + "; invert-1: 1 - x. Per-image variants `<shift>-h3`: each image its own level, "
            "uniform between no shift and severity 3; `invert-h1`: each image inverted with "
            "probability 1/2. Mixtures `<a>+<b>`: each image under `a` or `b`, 1/2 each."
        ),
        "",
        _wrap(
            (
                f"Cross-checks: {len(facts['mismatches'])} mismatches between the evaluate jobs "
                "and the adapt jobs' own metrics before and after (the jobs on all the test "
                "digits; the others measured themselves on their n digits only); "
                if facts["cross_check"]
                else "Accuracies after adaptation are the adapt jobs' own `metrics_after` (no "
                "separate evaluation jobs); "
            )
            + (f"{len(results.failures)} jobs failed." if results.failures else "no job failed.")
        ),
        "",
        *(
            [f"### Adapted on all {n} shifted test digits", "", *main_table(results, LABELS), ""]
            if n in results.sample_counts
            else []
        ),
        "### By number of target samples n (the first n test digits)",
        "",
        *accuracy_tables(results, LABELS),
        "### Targets",
        "",
        _wrap(
            "The issue's targets, each checked at every severity: (1) after `precise` on all "
            "shifted test digits, accuracy on contrast, brightness and scale within 3 points of "
            "clean accuracy; (2) on Gaussian noise, `precise` gains at least 5 points over the "
            "source model; (3) on clean data no estimator loses more than 1 point (at any n)."
        ),
        "",
        *target_lines(found),
        "",
        "### The auto estimator",
        "",
        _wrap(
            "What each auto job kept (`prior w=` the source's weight). Targets, each checked "
            "at every n over all conditions above: auto loses at most 0.5 point against the "
            "source model in every condition; its mean gain over the source across the "
            "shifted conditions is at least 90% of the best fixed estimator's (among "
            + ", ".join(f"`{LABELS[e]}`" for e in fixed)
            + "); on clean data it moves accuracy by at most 0.2 point."
        ),
        "",
        *auto_choice_table(results, autos, LABELS),
        "",
        *target_lines(found_auto),
        "",
    ]
    for failure in results.failures:
        lines.append(f"- failed: {failure}")
    for mismatch in facts["mismatches"]:
        lines.append(f"- mismatch: {mismatch}")
    return "\n".join(lines)


def precise_figure(results: Results) -> Measured:
    """`precise` on all the shifted test digits: how many severities of contrast, brightness
    and scale end within the target of clean accuracy, and its gain on each noise severity."""
    within = [v for v in verdicts(results, CLEAN) if v.target.startswith("precise within")]
    gains = list(noise_gains(results).values())
    noise = " / ".join("failed" if gain is None else f"{gain:+.1f}" for gain in gains)
    holds = all(v.holds for v in within) and all(
        gain is not None and gain >= NOISE_GAIN_POINTS for gain in gains
    )
    points = f"{PRECISE_WITHIN_CLEAN_POINTS:g}"
    return Measured(
        "quality-precise",
        f"`precise` on {results.num_test} shifted digits: within {points} points of clean; "
        "noise gain",
        f"{sum(v.holds for v in within)} of {len(within)} severities within {points}; "
        f"noise {noise}",
        met(f"within {points} / >= {NOISE_GAIN_POINTS:g} points", holds),
    )


def auto_figure(results: Results, seed: int) -> Measured:
    """`auto` over every condition and n: its worst change against the source model and its
    mean gain's share of the best fixed estimator's."""
    fixed = [e for e in FIXED if e in results.estimators]
    summary = auto_summary(results, CLEAN, "auto", fixed)
    worst, shares = summary.worst_change, summary.shares
    share_text = "failed" if shares is None else f"{100 * shares[0]:.0f}-{100 * shares[1]:.0f} %"
    holds = (
        worst is not None
        and worst >= -AUTO_LOSS_POINTS
        and shares is not None
        and shares[0] >= AUTO_GAIN_SHARE
    )
    return Measured(
        "quality-auto",
        f"`auto`, {len(results.conditions)} conditions, seed {seed}: worst loss / gain as share "
        "of the best fixed estimator's",
        f"{'failed' if worst is None else f'{worst:+.1f}'} points / {share_text}",
        met(f">= {-AUTO_LOSS_POINTS:g} / >= {AUTO_GAIN_SHARE:.0%}", holds),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run; numbers mean little")
    parser.add_argument(
        "--auto",
        action="store_true",
        help="auto against precise, prior and entropy only, on all the test digits, no "
        "separate evaluation jobs",
    )
    parser.add_argument(
        "--samples",
        type=int,
        nargs="+",
        help="with --auto: these numbers of target samples instead of all the test digits "
        "(each adapted model then evaluated on the whole test set)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=SEED,
        help="seed of the noise and of the adapt jobs' holdout draws (default 0); the model "
        "and its training keep seed 0",
    )
    parser.add_argument("--json", type=Path, help="also write every accuracy and job count here")
    add_record_options(parser)
    args = parser.parse_args()
    plan = QUICK if args.quick else AUTO if args.auto else FULL
    command = ".venv/bin/python -m bench.adaptation.quality" + (
        " --quick" if args.quick else " --auto" if args.auto else ""
    )
    if args.samples:
        if not args.auto:
            parser.error("--samples goes with --auto")
        # Accuracy on the whole shifted set, as the source's: an adapt job on the first n
        # digits measures itself on those n only, so every adapted model gets an evaluate job.
        plan = dataclasses.replace(plan, sample_counts=tuple(args.samples), cross_check=True)
        command += " --samples " + " ".join(map(str, args.samples))
    if args.seed != SEED:
        plan = dataclasses.replace(plan, seed=args.seed)
        command += f" --seed {args.seed}"
    with tempfile.TemporaryDirectory(prefix="bnadapt-quality-") as tmp:
        results, facts = run(plan, Path(tmp))
    if args.json is not None:
        data = dataclasses.asdict(results)
        data["adapted"] = [[*key, acc] for key, acc in results.adapted.items()]
        data["choices"] = [[*key, kept] for key, kept in results.choices.items()]
        args.json.write_text(json.dumps({"results": data, "facts": facts}, indent=2))
    print(markdown(results, facts, command))
    # --auto's plan runs the auto estimator against the fixed ones that can be the best; the
    # full plan holds every estimator on all the test digits, which `precise`'s targets need.
    found = [auto_figure(results, plan.seed) if args.auto else precise_figure(results)]
    write_figures("bench.adaptation.quality", args, found)


if __name__ == "__main__":
    main()
