"""The ``auto`` estimator: adaptation that should never hurt, chosen without labels.

BatchNorm adaptation is a bet. On a shift shared by every image it recovers most of the
accuracy; on a shift that differs image to image, or one the source model already copes with,
pooled target statistics can cost accuracy, and a user has no labels to tell which case is
theirs. ``auto`` holds some target samples out (NOTE [ Held-out target samples ] in
workers/passes/predictions.py), estimates candidates on the rest, scores each on the held-out
samples by the rule of NOTE [ Choosing without labels ], and keeps the best, which may be the
source model unchanged. The report says which candidates were tried, their scores and the
choice (``Report.auto``).

Candidates, in order (ties go to the earlier one):

- ``source``: the input statistics, unchanged;
- ``precise``: pooled target statistics (workers/estimators/precise.py), collected once;
- ``prior`` with the source's share :data:`SOURCE_WEIGHTS` of the statistics: the same
  computation as the ``prior`` estimator over ``precise`` with ``prior_strength = w / (1 - w)
  * n`` for ``n`` estimation samples (no further pass: the collected statistics are mixed);
- ``entropy`` (TENT with the job's ``steps``, ``lr`` and ``optimizer``, from the source
  statistics), only when the job sets ``allow_backward``: it needs backward passes.

Sharded (``shards > 1``, NOTE [ Sharded adaptation ] in workers/sharding/compute.py), the
shards collect ``precise`` on their runs of the estimation batches (each shard draws the same
held-out samples from the job's seed and leaves them out), and the merge runs
:func:`run_merged`: the merged statistics in place of the collection, then the same scoring
and choice as :func:`run`. ``entropy`` is sequential: the API refuses ``allow_backward`` with
``shards > 1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Final

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from api_schemas import AdaptParams
from api_schemas.reports import AutoCandidate, AutoChoice, Predictions
from workers.errors import AdaptError
from workers.estimators.base import AdaptStats, EstimatorTask, check_stop, resolve_batchnorm
from workers.estimators.entropy import entropy_adapt
from workers.estimators.layer_statistics import LayerStatistics
from workers.estimators.precise import apply_statistics, collect_statistics
from workers.estimators.prior import mix_with_source
from workers.passes.data import Data, iter_batches, num_batches
from workers.passes.predictions import PredictionSums, TargetSplit, predict, split_target

__all__ = [
    "CRITERION",
    "MARGINAL_GAIN",
    "SCORE_MARGIN",
    "SOURCE_WEIGHTS",
    "TENT_MARGINS",
    "AutoStats",
    "cross_fit_folds",
    "margin_for",
    "run",
    "run_merged",
    "statistics_eligible",
    "tent_replaces",
]

# The source's share of the statistics in the `prior` candidates.
SOURCE_WEIGHTS: Final = (0.75, 0.5, 0.25)
# Below this many held-out samples the scores are cross-fitted (NOTE [ Cross-fitting ]).
CROSS_FIT_BELOW: Final = 64
# The score's noise scale: a candidate must beat the source by SCORE_MARGIN / sqrt(held-out n).
SCORE_MARGIN: Final = 0.1
# ... and lower the mean entropy, or raise the marginal entropy by this much (nats).
MARGINAL_GAIN: Final = 0.25
# entropy (TENT) replaces the choice only when that choice beats the source by this many margins.
TENT_MARGINS: Final = 4
CRITERION: Final = (
    "score = marginal entropy - mean entropy of the held-out predictions; a statistics "
    f"candidate is eligible when its score beats the source's by {SCORE_MARGIN}/sqrt(held-out "
    f"samples) and it lowers the mean entropy or raises the marginal entropy by {MARGINAL_GAIN} "
    "nats; the highest-scoring of the source and the eligible ones is kept; entropy (TENT) "
    f"replaces it when it beats the source by {TENT_MARGINS} margins and TENT's score beats it "
    "by one more"
)

# NOTE [ Choosing without labels ]
#
# The score is the information of the held-out predictions, H(mean softmax) - mean H(softmax)
# (nats): high when each prediction is confident and the predictions spread over the classes.
# Adaptation that fits the target makes predictions more certain; adaptation that fails by
# collapsing many images onto a few confident classes (a semantic shift such as inversion, or
# statistics pooled over images that need different ones) lowers the marginal entropy more
# than the mean entropy, and the score falls. The rule, with margin m = 0.1 / sqrt(held-out n)
# (the score's sampling noise scale: a few held-out samples make it noisy):
#
# - a statistics candidate (precise, the prior mixes) is eligible when its score beats the
#   source's by more than m, and it either lowers the mean entropy or raises the marginal
#   entropy by more than 0.25 nats; the source and the eligible ones compete on score (ties:
#   the earlier one, the source first);
# - entropy (TENT, with allow_backward) replaces that choice only when the choice beats the
#   source by more than 4 m (evidence that the target is a shift BN adaptation fixes) and
#   TENT's score beats the choice's by more than m.
#
# Compared on the quality benchmark's digits (27 conditions: uniform, per-image and mixed
# shifts, and clean; n = 16 to 597 target samples, 1/4 held out) with the rules one might try
# first (bench/history/2026-12-03-choosing-auto-estimator-criterion.md; this rule's results:
# figure `quality-auto` in bench/RESULTS.md):
#
# - lowest mean entropy alone picks TENT on inverted digits, and TENT makes them worse: TENT
#   lowers the very quantity the rule reads, and an inverted digit is confidently misread;
# - highest mean max-probability: as entropy, and it lost accuracy on inversion even without
#   TENT (a prior mix looked more confident);
# - highest score alone: best mean gain, but with 16 samples (4 held out) it picked precise on
#   inversion, where precise loses: with few samples the score is noisy, hence the margin;
# - a lower mean entropy than the source, then the highest score: safe, but it kept the
#   source where the source model is confidently wrong and adapted statistics are right but
#   less certain (contrast with brightness at 64 samples, where precise is far more accurate
#   than the source it kept), hence the second way in, a marginal entropy raised by a quarter nat
#   (predictions that were piled onto one class spread out); and, with TENT a candidate, it
#   chose TENT on mild noise where TENT did worse than the source, hence TENT's gate.
#
# Its blind spot: a target whose true classes are far from balanced, where spreading
# predictions is not a virtue; the source stays a candidate, and a statistics candidate must
# still beat its score.


@dataclass(frozen=True)
class AutoStats(AdaptStats):
    """The kept candidate's :class:`AdaptStats` (``batches`` it ran in train mode: 0 for the
    source), whether its statistics started anew (``reset``), and the report's choice."""

    reset: bool
    choice: AutoChoice


@dataclass(frozen=True)
class _Candidate:
    name: str
    state: list[dict[str, torch.Tensor]]  # per selected layer: its buffers and parameters
    stats: AdaptStats
    reset: bool
    source_weight: float | None = None
    prior_strength: float | None = None


def _layer_state(layers: list[_BatchNorm]) -> list[dict[str, torch.Tensor]]:
    """Copies of the layers' buffers and affine parameters."""
    state = []
    for bn in layers:
        tensors = {k: v.detach().clone() for k, v in bn._buffers.items() if v is not None}
        tensors |= {k: v.detach().clone() for k, v in bn._parameters.items() if v is not None}
        state.append(tensors)
    return state


def _load_layer_state(layers: list[_BatchNorm], state: list[dict[str, torch.Tensor]]) -> None:
    """Writes :func:`_layer_state`'s copies back into the same tensors."""
    with torch.no_grad():
        for bn, tensors in zip(layers, state, strict=True):
            for key, value in tensors.items():
                target = bn._buffers.get(key)
                if target is None:
                    target = bn._parameters[key]
                assert target is not None
                target.copy_(value)


def run(task: EstimatorTask) -> AutoStats:
    """The ``auto`` row of the estimator table; see the module docstring."""
    params = task.params
    split = _split(task)
    views = list(iter_batches(split.estimation, params.batch_size))  # estimation batches (B, ...)
    steps = (params.steps or len(views)) if params.allow_backward else 0
    folds = cross_fit_folds(task, split)
    task.start(
        len(views) + steps + _scored(params) * _held_batches(task, split) + _fold_units(task, folds)
    )
    precise_stats = AdaptStats(batches=len(views), samples=len(split.estimation))
    collect = partial(_collect_views, task, views)
    return _run_candidates(task, split, folds, collect, len(views), precise_stats, views, steps)


def _collect_views(
    task: EstimatorTask, views: list[torch.Tensor], progress: Callable[[int], None]
) -> Mapping[str, LayerStatistics]:
    """``precise``'s statistics of the estimation batches ``views``, one unit of progress a
    batch."""
    return collect_statistics(
        task.model,
        (view.to(task.device) for view in views),
        layers=task.layers,
        progress=progress,
        should_stop=task.hooks.should_stop,
    )


def run_merged(
    task: EstimatorTask, merged: Mapping[str, LayerStatistics], stats: AdaptStats
) -> AutoStats:
    """The merge of a sharded ``auto`` job (the row's ``merged_runner``): ``merged`` are the
    shards' ``precise`` statistics of the estimation samples, ``stats`` what the shards ran.
    The candidates are scored on the held-out samples here, as :func:`run` scores them after
    its own collection: the same choice and, up to the float rounding of merging, the same
    statistics. Without entropy (``allow_backward`` with shards is refused by the API)."""
    params = task.params
    if params.allow_backward:
        raise AdaptError(
            "the auto estimator's entropy candidate (allow_backward) is sequential and cannot "
            "be sharded; submit the job with shards=1, or without allow_backward"
        )
    split = _split(task)
    if stats.samples != len(split.estimation):
        raise AdaptError(
            f"the shards estimated on {stats.samples} samples, but the job holds "
            f"{len(split.estimation)} out of {len(split.held_out)} held out for estimation; "
            "the dataset changed under the job, submit it again"
        )
    folds = cross_fit_folds(task, split)
    # The merge, then the scores (and the folds' own passes, over a few samples).
    units = 1 + _scored(params) * _held_batches(task, split) + _fold_units(task, folds)
    task.hooks.start_phase("merge", units, "batches", float(params.batch_size))
    return _run_candidates(task, split, folds, partial(_merged_at_once, merged), 1, stats, [], 0)


def _merged_at_once(
    merged: Mapping[str, LayerStatistics], progress: Callable[[int], None]
) -> Mapping[str, LayerStatistics]:
    """The shards' statistics, as one unit of progress (the merge)."""
    progress(1)
    return merged


def _split(task: EstimatorTask) -> TargetSplit:
    """The job's estimation and held-out samples (NOTE [ Held-out target samples ])."""
    params = task.params
    return split_target(
        task.x, params.batch_size, params.max_batches, params.effective_holdout(), params.seed
    )


def _scored(params: AdaptParams) -> int:
    """How many candidates are scored: the source, precise, the prior mixes, maybe entropy."""
    return 2 + len(SOURCE_WEIGHTS) + (1 if params.allow_backward else 0)


def _held_batches(task: EstimatorTask, split: TargetSplit) -> int:
    return num_batches(len(split.held_out), task.params.batch_size)


# NOTE [ Cross-fitting ]
#
# With few held-out samples the scores are noise: at 16 target samples, 4 held out, the rule
# kept the source where precise gains much and chose precise on inverted digits, where it
# loses, depending on which 4 were drawn
# (bench/history/2026-12-04-auto-estimator-score-margins-five-seeds.md; with cross-fitting:
# bench/history/2026-12-04-auto-estimator-cross-fitting-five-seeds.md, figure `quality-auto`
# in bench/RESULTS.md). So below CROSS_FIT_BELOW held-out samples every sample is scored:
# the estimation samples are cut into K - 1 further folds (K = round(1 / holdout), 4 by
# default; from the same seeded permutation that drew the held-out ones, so fold 0 is the
# held-out set), and for each such fold every candidate is estimated again on the job's other
# samples and predicts that fold. A candidate's score is over the pooled predictions of its K
# estimates, each on samples it never saw; the kept candidate is still the one estimated on
# the estimation samples (so it is the fixed estimator's result with the same holdout and
# seed, and a sharded job's merge, which runs these few extra passes itself, chooses as one
# worker). Cost: K - 1 passes over fewer than 4 * CROSS_FIT_BELOW samples per candidate (and
# K - 1 more TENT runs with allow_backward), where the job has little data anyway.


def cross_fit_folds(task: EstimatorTask, split: TargetSplit) -> list[tuple[Data, Data]]:
    """The extra folds of NOTE [ Cross-fitting ]: (the samples to estimate on, the fold), in
    the dataset's order; none when enough samples are held out."""
    order = split.order
    if order is None or len(split.held_out) >= CROSS_FIT_BELOW:
        return []
    count = max(round(1 / task.params.effective_holdout()), 2) - 1
    rest = order[len(split.held_out) :]
    folds = []
    for fold in torch.tensor_split(rest, min(count, len(rest))):
        keep = torch.ones(len(order), dtype=torch.bool)
        keep[fold] = False
        others = torch.arange(len(order))[keep]  # sorted
        folds.append((task.x[others], task.x[fold.sort().values]))
    return folds


def _fold_units(task: EstimatorTask, folds: list[tuple[Data, Data]]) -> int:
    """The progress units of the extra folds: each one's pass, scores and TENT steps."""
    params = task.params
    units = 0
    for train, fold in folds:
        train_batches = num_batches(len(train), params.batch_size)
        units += train_batches + _scored(params) * num_batches(len(fold), params.batch_size)
        if params.allow_backward:
            units += params.steps or train_batches
    return units


def _run_candidates(
    task: EstimatorTask,
    split: TargetSplit,
    folds: list[tuple[Data, Data]],
    collect: Callable[[Callable[[int], None]], Mapping[str, LayerStatistics]],
    collect_units: int,
    precise_stats: AdaptStats,
    views: list[torch.Tensor],
    steps: int,
) -> AutoStats:
    """Scores the candidates on ``split.held_out`` (and ``folds``: NOTE [ Cross-fitting ]) and
    keeps the best in the model: the source, precise (``collect`` gives its statistics,
    reporting up to ``collect_units`` of progress), the prior mixes and, with
    ``allow_backward``, entropy for ``steps`` on ``views``."""
    hooks = task.hooks
    trial = _Trial(task, split.held_out)
    trial.add(_Candidate("source", trial.source_state, AdaptStats(0, 0), reset=False))
    # precise, once; the prior candidates mix its statistics with the source ones.
    check_stop(hooks.should_stop, trial.done)
    collected = collect(trial.progress_from_here())
    trial.done += collect_units
    trial.add_statistics(collected, precise_stats)
    if task.params.allow_backward:
        check_stop(hooks.should_stop, trial.done)
        tent = trial.tent_from_source(views, steps)
        trial.add(_Candidate("entropy", _layer_state(trial.selected), tent, reset=False))
    for train, fold in folds:
        found = trial.fold_predictions(train, fold)
        trial.predictions = [
            PredictionSums.pooled([before, after])
            for before, after in zip(trial.predictions, found, strict=True)
        ]
    chosen, table = _choose(trial.candidates, trial.predictions)
    kept = trial.candidates[chosen]
    _load_layer_state(trial.selected, kept.state)
    choice = AutoChoice(
        criterion=CRITERION,
        estimation_samples=precise_stats.samples,
        held_out_samples=len(split.held_out),
        folds=1 + len(folds),
        scored_samples=trial.predictions[0].samples,
        candidates=table,
        chosen=kept.name,
        chosen_index=chosen,
        kept_source=chosen == 0,
    )
    return AutoStats(kept.stats.batches, kept.stats.samples, reset=kept.reset, choice=choice)


def _applied(
    task: EstimatorTask, statistics: Mapping[str, LayerStatistics], stats: AdaptStats
) -> AdaptStats:
    """Writes ``statistics`` into the job's layers; ``stats``: what estimating them ran."""
    apply_statistics(task.model, statistics, task.layers)
    return stats


class _Trial:
    """The candidates of one job, estimated in its model one after another from the source
    statistics (``source_state``) and scored as they come; ``done`` counts the units of
    progress reported so far."""

    def __init__(self, task: EstimatorTask, held_out: Data) -> None:
        self.task = task
        self.held_out = held_out  # (N_h, ...) on the CPU
        self.selected = resolve_batchnorm(task.model, task.layers)
        self.source_state = _layer_state(self.selected)
        self.done = 0
        self.candidates: list[_Candidate] = []
        self.predictions: list[PredictionSums] = []

    def progress_from_here(self) -> Callable[[int], None]:
        """A progress callback whose counts start at the units done so far."""
        return partial(self._report_after, self.done)

    def _report_after(self, base: int, count: int) -> None:
        self.task.hooks.report(base + count)

    def score(self, x: Data) -> PredictionSums:
        """The model's predictions on ``x`` as they stand, counted as progress."""
        params = self.task.params
        found = predict(
            self.task.model,
            x,
            batch_size=params.batch_size,
            device=self.task.device,
            should_stop=self.task.hooks.should_stop,
        )
        if found is None:
            raise AdaptError(
                "the auto estimator scores candidates by their class predictions, but the "
                "model's output is not class logits (B, num_classes >= 2); use a fixed "
                "estimator such as 'precise'"
            )
        self.done += num_batches(len(x), params.batch_size)
        self.task.hooks.report(self.done)
        return found

    def add(self, candidate: _Candidate) -> None:
        """``candidate``, whose state the model holds now, scored on the held-out samples."""
        self.candidates.append(candidate)
        self.predictions.append(self.score(self.held_out))

    def add_statistics(self, collected: Mapping[str, LayerStatistics], stats: AdaptStats) -> None:
        """``precise`` (the ``collected`` statistics) and its mixes with the source."""
        model, layers, hooks = self.task.model, self.task.layers, self.task.hooks
        apply_precise = partial(_applied, self.task, collected, stats)
        apply_precise()
        self.add(_Candidate("precise", _layer_state(self.selected), stats, reset=True))
        for weight in SOURCE_WEIGHTS:
            check_stop(hooks.should_stop, self.done)
            strength = weight / (1.0 - weight) * stats.samples
            _load_layer_state(self.selected, self.source_state)
            mix_with_source(model, layers, strength, apply_precise)
            candidate = _Candidate(
                "prior",
                _layer_state(self.selected),
                stats,
                reset=True,
                source_weight=weight,
                prior_strength=strength,
            )
            self.add(candidate)

    def tent_from_source(self, batches: list[torch.Tensor], tent_steps: int) -> AdaptStats:
        """TENT's steps on ``batches`` from the source statistics, counted as progress."""
        params = self.task.params
        _load_layer_state(self.selected, self.source_state)
        result = entropy_adapt(
            self.task.model,
            batches,
            layers=self.task.layers,
            lr=params.lr,
            steps=tent_steps,
            optimizer=params.optimizer,
            reset=False,
            progress=self.progress_from_here(),
            should_stop=self.task.hooks.should_stop,
        )
        self.done += tent_steps
        return result

    def fold_predictions(self, train: Data, fold: Data) -> list[PredictionSums]:
        """Every candidate estimated again without ``fold``, predicting it."""
        task, params = self.task, self.task.params
        check_stop(task.hooks.should_stop, self.done)
        _load_layer_state(self.selected, self.source_state)
        found = [self.score(fold)]
        progress = self.progress_from_here()
        again = collect_statistics(
            task.model,
            (batch.to(task.device) for batch in iter_batches(train, params.batch_size)),
            layers=task.layers,
            progress=progress,
            should_stop=task.hooks.should_stop,
        )
        train_batches = num_batches(len(train), params.batch_size)
        self.done += train_batches
        apply_again = partial(
            _applied, task, again, AdaptStats(batches=train_batches, samples=len(train))
        )
        apply_again()
        found.append(self.score(fold))
        for weight in SOURCE_WEIGHTS:
            _load_layer_state(self.selected, self.source_state)
            mix_with_source(
                task.model, task.layers, weight / (1.0 - weight) * len(train), apply_again
            )
            found.append(self.score(fold))
        if params.allow_backward:
            self.tent_from_source(
                list(iter_batches(train, params.batch_size)), params.steps or train_batches
            )
            found.append(self.score(fold))
        return found


def _choose(
    candidates: list[_Candidate], predictions: list[PredictionSums]
) -> tuple[int, list[AutoCandidate]]:
    """The index of the kept candidate by NOTE [ Choosing without labels ], and the table."""
    source = predictions[0]
    margin = margin_for(source.samples)
    summaries = [found.predictions() for found in predictions]
    scores = [found.information() for found in predictions]
    eligible = [True] + [
        statistics_eligible(scores[0], summaries[0], score, summary, margin)
        for score, summary in zip(scores[1:], summaries[1:], strict=True)
    ]
    entropy_at = [i for i, c in enumerate(candidates) if c.name == "entropy"]
    for index in entropy_at:
        eligible[index] = False
    best = 0
    for index, score in enumerate(scores):
        if eligible[index] and score > scores[best]:
            best = index
    for index in entropy_at:
        if best != 0 and tent_replaces(scores[0], scores[best], scores[index], margin):
            eligible[index] = True
            best = index
    table = [
        AutoCandidate(
            name=candidate.name,
            prior_strength=candidate.prior_strength,
            source_weight=candidate.source_weight,
            predictions=summary,
            score=score,
            eligible=ok,
            changed_fraction=source.changed_fraction(found),
        )
        for candidate, found, summary, score, ok in zip(
            candidates, predictions, summaries, scores, eligible, strict=True
        )
    ]
    return best, table


def margin_for(held_out: int) -> float:
    """The score margin for ``held_out`` samples (NOTE [ Choosing without labels ])."""
    return SCORE_MARGIN / math.sqrt(held_out)


def statistics_eligible(
    source_score: float,
    source: Predictions,
    score: float,
    found: Predictions,
    margin: float,
) -> bool:
    """Whether a statistics candidate (precise, a prior mix) may replace the source."""
    spreads = found.marginal_entropy > source.marginal_entropy + MARGINAL_GAIN
    return score > source_score + margin and (found.mean_entropy < source.mean_entropy or spreads)


def tent_replaces(
    source_score: float, chosen_score: float, tent_score: float, margin: float
) -> bool:
    """Whether entropy (TENT) replaces the statistics candidate that scored ``chosen_score``."""
    return (
        chosen_score > source_score + TENT_MARGINS * margin and tent_score > chosen_score + margin
    )
