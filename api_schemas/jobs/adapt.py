"""Adapt jobs: the estimator table and the parameters of BatchNorm adaptation.

NOTE [ The estimator table ]
:data:`ESTIMATORS` is the one list of estimators. The schema (names, defaults, which options
fit), the worker's dispatch (``runner``, a ``module:function`` path the worker imports, so the
API never imports torch), sharding (``sharding``: how shards' statistics pool) and the CLI all
read it. A new estimator is its module under workers/estimators/ plus one row here (and its
options, if it has any, as fields of :class:`AdaptParams`).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Final, Literal, Self

from pydantic import Field, model_validator

from api_schemas.jobs.params import (
    MAX_LR,
    MAX_NUM_BATCHES,
    MAX_SHARDS,
    MAX_STEPS,
    BaseJobCreate,
    ModelJobParams,
    ModulePattern,
    NumBatches,
    PatternList,
    num_batches,
)

__all__ = [
    "AUTO_HOLDOUT",
    "AUTO_MAX_HOLDOUT",
    "ESTIMATORS",
    "ESTIMATOR_NAMES",
    "AdaptJobCreate",
    "AdaptParams",
    "AdaptPrecision",
    "EstimatorName",
    "EstimatorSpec",
    "Pooling",
    "holdout_sizes",
]

# The fraction of the job's samples `auto` holds out of estimation unless the job says.
AUTO_HOLDOUT: Final = 0.25
AUTO_MAX_HOLDOUT: Final = 0.5
# prior: the source statistics weigh as this many target samples at most (NOTE [ Job bounds ]
# in api_schemas/jobs/params.py).
MAX_PRIOR_STRENGTH: Final = 1e9

# The adaptation forward's precision: "bf16" runs it under bfloat16 autocast (NOTE [ Adaptation
# in bf16 ] in workers/passes/precision.py). No fp16: bf16 has float32's range, so a
# forward-only pass needs no loss scaling and no overflow check.
AdaptPrecision = Literal["fp32", "bf16"]

# How the shards of a sharded job pool per-batch statistics: every element alike
# ("elements") or every batch alike ("batches"); "prior_base" pools as the job's prior_base
# does, then mixes the result with the source statistics.
Pooling = Literal["elements", "batches", "prior_base"]


@dataclass(frozen=True)
class EstimatorSpec:
    """One estimator's traits; see NOTE [ The estimator table ]."""

    summary: str
    # `module:function` taking workers.estimators.base.EstimatorTask, returning AdaptStats.
    runner: str
    # Whether the statistics are computed anew from the target data (reset=False is then
    # refused), or blended into the source statistics they start from (reset defaults False).
    resets: bool
    # None: sequential, each batch starting from what the batch before it did; the reason
    # is what a user who asks for shards > 1 is told.
    sharding: Pooling | None
    sequential_reason: str = ""
    # Runs backward passes (optimizer steps), timed step by step (the report's `steps`).
    backward: bool = False
    # Its passes run through what the job gives them, so `compile: true` runs them through
    # torch.compile (NOTE [ Compiled jobs ] in api_schemas/jobs/params.py); the reason is what a
    # user who asks for compile with another estimator is told.
    compiles: bool = True
    compile_reason: str = ""
    # The runner gets all the job's samples and holds out its share itself (split_target in
    # workers/passes/predictions.py); the others get the estimation samples only.
    holds_out: bool = False
    # What the merge of a sharded job runs (`module:function` taking the EstimatorTask, the
    # shards' merged LayerStatistics and their AdaptStats) in place of the estimator's pass;
    # None: the merged statistics are applied as `sharding` pools them (NOTE [ Sharded
    # adaptation ] in workers/sharding/compute.py).
    merged_runner: str | None = None
    # Estimates running statistics, so the model needs a normalization layer that keeps them
    # (a 422 at submission otherwise: service/jobs/submission.py check_running_statistics).
    needs_running_stats: bool = True


ESTIMATORS: Final[dict[str, EstimatorSpec]] = {
    "ema": EstimatorSpec(
        "the train-mode loop users write by hand, with the layers' own momentum",
        "workers.estimators.moving_averages:run_ema",
        resets=False,
        sharding=None,
        sequential_reason="each batch updates the statistics the next batch starts from",
    ),
    "ema_momentum": EstimatorSpec(
        "the train-mode loop with a momentum of the job's own (`momentum`)",
        "workers.estimators.ema_momentum:run",
        resets=False,
        sharding=None,
        sequential_reason="each batch updates the statistics the next batch starts from",
    ),
    "cumulative": EstimatorSpec(
        "reset, then an equal-weight average of batch statistics (as update_bn)",
        "workers.estimators.moving_averages:run_cumulative",
        resets=True,
        sharding="batches",
    ),
    "precise": EstimatorSpec(
        "pooled mean and unbiased variance of all activations, in float64",
        "workers.estimators.precise:run",
        resets=True,
        sharding="elements",
    ),
    "prior": EstimatorSpec(
        "target statistics mixed with the source ones with strength `prior_strength`",
        "workers.estimators.prior:run",
        resets=True,
        sharding="prior_base",
    ),
    "entropy": EstimatorSpec(
        "TENT/SAR: the affine parameters of the normalization layers (BatchNorm, and with "
        "affine_norms 'all' LayerNorm and GroupNorm) trained to minimise prediction entropy",
        "workers.estimators.entropy:run",
        resets=False,
        sharding=None,
        sequential_reason="each optimizer step starts from the parameters the previous one made",
        backward=True,
        needs_running_stats=False,
    ),
    "auto": EstimatorSpec(
        "chooses the source statistics, precise, prior at a few strengths or (allow_backward) "
        "entropy by an unsupervised score on target samples held out from estimation",
        "workers.estimators.auto:run",
        resets=False,
        # Its candidates but entropy are the source and precise statistics, pooled element by
        # element, mixed: the shards collect precise on their runs of the estimation samples,
        # the merge scores the candidates on the held-out ones (entropy: refused with shards).
        sharding="elements",
        holds_out=True,
        merged_runner="workers.estimators.auto:run_merged",
        compiles=False,
        compile_reason="it runs and scores several candidates, each a pass of its own, on the "
        "eager model",
    ),
}
ESTIMATOR_NAMES: Final[tuple[str, ...]] = tuple(ESTIMATORS)


if TYPE_CHECKING:
    EstimatorName = str
else:
    # A Literal of the table's names, built from the table: validation errors and the
    # OpenAPI enum are pydantic's own, as for any Literal.
    EstimatorName = Literal[ESTIMATOR_NAMES]


class AdaptParams(ModelJobParams):
    """Re-estimate normalization statistics on a dataset.

    Estimators (:data:`ESTIMATORS`): ``ema`` (the layers' own momentum), ``ema_momentum``
    (the same loop with ``momentum``), ``cumulative`` (equal-weight average of batch
    statistics, as ``update_bn``), ``precise`` (mean and variance of all activations, whatever
    the batch split), ``prior`` (``prior_base`` target statistics mixed with the source ones:
    weight ``prior_strength / (prior_strength + n)`` on the source, ``n`` the number of target
    samples) and ``entropy`` (TENT: ``steps`` optimizer steps with ``lr`` on the layers' affine
    parameters, minimising prediction entropy; ``steps=None`` is one pass). All but
    ``entropy`` use forward passes only.

    ``reset=None`` means the estimator's default, see :meth:`effective_reset`. ``include`` and
    ``exclude`` select normalization layers by qualified name (fnmatch).

    ``shards=K`` splits the batches into K contiguous runs of whole batches, collected by K
    jobs that may run on different workers and then merged: the same result as one worker
    (up to float rounding). Only for estimators whose result is a function of pooled
    per-batch statistics (``precise``, ``cumulative``, ``prior``, and ``auto`` without
    ``allow_backward``). With a holdout, the shards split the estimation batches (the held-out
    samples, drawn as one worker draws them, are left out of every shard); a sharded ``auto``
    job scores its candidates on the held-out samples in the merge.

    ``layerwise`` (``precise`` only) estimates one layer at a time in forward order, the layers
    before it already adapted and in eval mode: every layer's statistics then do not depend on
    how the data is split into batches (one pass estimates all layers at once, each normalizing
    with its batch statistics, so a layer's input depends a little on the batch size), at the
    cost of one pass over the data per layer.

    ``measure_batches`` bounds the measurement of labelled data before and after (the first
    that many batches of ``batch_size``); None: as many as ``max_batches``, all when that is
    None too. The report's ``metrics_*.num_samples`` says how many samples were measured. It
    bounds the prediction diagnostics too (at most 10,000 held-out samples in any case).

    ``compile`` runs the estimator's passes (``entropy``: its optimizer steps) through
    ``torch.compile`` with ``compile_backend`` (NOTE [ Compiled jobs ] in
    api_schemas/jobs/params.py); for ``entropy`` the report's ``steps`` gives the compilation's
    cost and the steady-state throughput. Not for ``auto`` nor ``layerwise``.

    ``precision`` ``bf16`` runs the estimator's forward passes under bfloat16 autocast, the
    statistics still accumulated in float32 and above (NOTE [ Adaptation in bf16 ] in
    workers/passes/precision.py gives the measured distance to fp32 per estimator); ``fp32``,
    the default, is the exact path. ``channels_last`` runs the pass with the model's weights
    and the batches in channels-last memory format (faster convolutions on GPUs), the weights
    put back to the default format afterwards.

    ``auto`` (see workers/estimators/auto.py) holds ``holdout`` of the job's samples out of
    estimation (default 1/4, drawn with ``seed``), estimates ``precise`` on the rest, scores the
    source statistics, ``precise``, ``prior`` mixes of the two and, with ``allow_backward``,
    ``entropy`` (with ``steps``, ``lr``, ``optimizer``) on the held-out samples, and keeps the
    best; it may keep the source model unchanged. Sharded (``shards > 1``) it collects
    ``precise`` in the shards and scores in the merge, the same choice and statistics as one
    worker up to float rounding; ``entropy`` is sequential, so ``allow_backward`` with
    ``shards > 1`` is refused. The other estimators hold nothing out by
    default; with ``holdout > 0`` they estimate on the rest. Every adapt job's report gives
    prediction diagnostics on the held-out samples (on the estimation samples when nothing is
    held out)."""

    max_batches: NumBatches | None = Field(
        default=None,
        description=f"At most this many batches (1 to {MAX_NUM_BATCHES}); null: all the dataset's.",
    )
    measure_batches: NumBatches | None = Field(
        default=None,
        description=f"Batches of labelled data measured before and after (1 to "
        f"{MAX_NUM_BATCHES}); null: as many as max_batches.",
    )
    estimator: EstimatorName = "cumulative"
    reset: bool | None = None
    include: Annotated[list[ModulePattern], Field(min_length=1, max_length=256)] = Field(
        default_factory=lambda: ["*"]
    )
    exclude: PatternList = Field(default_factory=list)
    prior_strength: float = Field(
        default=16.0,
        ge=0.0,
        le=MAX_PRIOR_STRENGTH,
        allow_inf_nan=False,
        description=f"prior: weight of the source statistics, in samples (0 to "
        f"{MAX_PRIOR_STRENGTH:g}).",
    )
    prior_base: Literal["precise", "cumulative"] = "precise"
    # ema_momentum: the weight of each new batch's statistics.
    momentum: float = Field(
        default=0.1,
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="ema_momentum: weight of each new batch's statistics, above 0, at most 1.",
    )
    lr: float = Field(
        default=1e-3,
        gt=0.0,
        le=MAX_LR,
        allow_inf_nan=False,
        description=f"entropy: learning rate of the optimizer steps, above 0, at most {MAX_LR:g}.",
    )
    steps: int | None = Field(
        default=None,
        ge=1,
        le=MAX_STEPS,
        description=f"entropy: optimizer steps (1 to {MAX_STEPS}); null: one pass over the data.",
    )
    optimizer: Literal["sgd", "adam"] = "adam"
    # entropy: whose affine parameters it trains. "all" (as SAR): BatchNorm, LayerNorm and
    # GroupNorm layers; "batchnorm" (as TENT): BatchNorm layers only. Both select by
    # include/exclude.
    affine_norms: Literal["all", "batchnorm"] = "all"
    shards: int = Field(
        default=1,
        ge=1,
        le=MAX_SHARDS,
        description=f"Jobs the batches are split among (1 to {MAX_SHARDS}), each taking at least "
        "one whole batch.",
    )
    layerwise: bool = False
    # The fraction of the job's samples held out of estimation; None: 1/4 for auto, else 0.
    holdout: float | None = Field(
        default=None,
        ge=0.0,
        le=AUTO_MAX_HOLDOUT,
        allow_inf_nan=False,
        description=f"Fraction of the samples held out of estimation (0 to {AUTO_MAX_HOLDOUT:g}); "
        f"null: {AUTO_HOLDOUT:g} for auto, else 0.",
    )
    # auto: may try candidates that need backward passes (entropy).
    allow_backward: bool = False
    precision: AdaptPrecision = Field(
        default="fp32",
        description="fp32 (exact statistics); bf16: the estimator's forward passes under "
        "bfloat16 autocast (CPU and CUDA), statistics accumulated in float32 and above, within "
        "the tolerances the docs give per estimator.",
    )
    channels_last: bool = Field(
        default=False,
        description="Run the estimator's passes in channels-last memory format (weights and "
        "batches of 4-D inputs); the stored weights are unchanged in layout.",
    )

    def measured_samples(self, num_samples: int) -> int:
        """How many of the dataset's first samples the before/after measurement covers."""
        bound = self.measure_batches or self.max_batches
        return num_samples if bound is None else min(num_samples, bound * self.batch_size)

    @property
    def spec(self) -> EstimatorSpec:
        """The estimator's row of :data:`ESTIMATORS`."""
        return ESTIMATORS[self.estimator]

    @model_validator(mode="after")
    def _layerwise_fits(self) -> Self:
        if self.layerwise and self.estimator != "precise":
            raise ValueError(
                f"layerwise is an option of the precise estimator, not of {self.estimator}; "
                "use estimator 'precise', or drop layerwise"
            )
        if self.layerwise and self.shards > 1:
            raise ValueError(
                "layerwise estimates one layer after another, each pass starting from the "
                "layers before it, so it cannot be split into shards; use shards=1, or drop "
                "layerwise (one pass, which shards can split)"
            )
        return self

    @model_validator(mode="after")
    def _shards_fit_estimator(self) -> Self:
        if self.shards > 1 and self.spec.sharding is None:
            shardable = [repr(name) for name, spec in ESTIMATORS.items() if spec.sharding]
            choices = ", ".join(shardable[:-1]) + f" or {shardable[-1]}"
            raise ValueError(
                f"the {self.estimator} estimator is sequential ({self.spec.sequential_reason}), "
                f"so its batches cannot be split across {self.shards} workers; use shards=1, "
                f"or estimator {choices}, whose statistics shards can collect apart"
            )
        return self

    @model_validator(mode="after")
    def _compile_fits_estimator(self) -> Self:
        if self.compile and not self.spec.compiles:
            accepting = [repr(name) for name, spec in ESTIMATORS.items() if spec.compiles]
            raise ValueError(
                f"the {self.estimator} estimator cannot run through torch.compile: "
                f"{self.spec.compile_reason}. Drop compile, or use estimator "
                f"{', '.join(accepting[:-1])} or {accepting[-1]}"
            )
        if self.compile and self.layerwise:
            raise ValueError(
                "layerwise runs one pass per layer, each with other layers in train mode, and "
                "would compile the model anew for each; drop compile, or drop layerwise"
            )
        return self

    @model_validator(mode="after")
    def _reset_fits_estimator(self) -> Self:
        if self.spec.resets and self.reset is False:
            raise ValueError(
                f"the {self.estimator} estimator replaces the statistics with ones computed "
                "from the target data; drop reset, or use estimator 'ema' to blend into the "
                "current statistics"
            )
        return self

    @model_validator(mode="after")
    def _auto_options_fit(self) -> Self:
        if self.allow_backward and self.estimator != "auto":
            raise ValueError(
                f"allow_backward is an option of the auto estimator, not of {self.estimator}; "
                "use estimator 'auto', or drop allow_backward"
            )
        if self.estimator == "auto" and self.reset is not None:
            raise ValueError(
                "the auto estimator decides per candidate whether statistics start anew "
                "(precise, prior) or from the source ones (entropy, the source itself); drop reset"
            )
        if self.estimator == "auto" and self.holdout == 0:
            raise ValueError(
                "the auto estimator chooses on samples held out of estimation, so holdout must "
                f"be > 0; drop holdout (default {AUTO_HOLDOUT:g}) or use a fixed estimator"
            )
        if self.estimator == "auto" and self.allow_backward and self.shards > 1:
            raise ValueError(
                "allow_backward adds the entropy candidate, whose optimizer steps each start "
                "from the parameters the previous one made, so it cannot be split across "
                f"{self.shards} workers; use shards=1 to include entropy, or drop "
                "allow_backward to shard the other candidates (source, precise, prior)"
            )
        return self

    def estimation_batches(self, num_samples: int) -> int:
        """The batches the estimator runs over ``num_samples`` (the dataset's): the job's
        batches less the held-out samples (NOTE [ Held-out target samples ] in
        workers/passes/predictions.py), what a sharded job splits among its shards."""
        used, held = holdout_sizes(
            num_samples, self.batch_size, self.max_batches, self.effective_holdout()
        )
        if held == 0:
            return num_batches(num_samples, self.batch_size, self.max_batches)
        return num_batches(used - held, self.batch_size)

    def effective_holdout(self) -> float:
        """The fraction of the job's samples held out of estimation: the job's ``holdout``,
        else :data:`AUTO_HOLDOUT` for ``auto`` and 0 for the others."""
        if self.holdout is not None:
            return self.holdout
        return AUTO_HOLDOUT if self.estimator == "auto" else 0.0

    def effective_reset(self) -> bool:
        """Whether the running statistics are cleared before the first batch: the job's
        ``reset``, else whether the estimator computes its statistics anew (prior mixes the
        source ones back in afterwards, from a copy taken before)."""
        return self.spec.resets if self.reset is None else self.reset


def holdout_sizes(
    num_samples: int, batch_size: int, max_batches: int | None, fraction: float
) -> tuple[int, int]:
    """How many of ``num_samples`` a job uses (``max_batches`` batches of ``batch_size``, or
    all) and how many of those it holds out for ``fraction``: ``round(fraction * used)``, at
    least 1 and at most ``used - 1`` when ``fraction > 0`` (0 when ``used < 2``: too few to
    split, which the worker refuses), else 0. NOTE [ Held-out target samples ] in
    workers/passes/predictions.py."""
    used = min(num_samples, num_batches(num_samples, batch_size, max_batches) * batch_size)
    if fraction <= 0:
        return used, 0
    return used, max(min(max(round(fraction * used), 1), used - 1), 0)


class AdaptJobCreate(BaseJobCreate):
    """Asks for BatchNorm adaptation of a model on a dataset."""

    kind: Literal["adapt"]
    params: AdaptParams = Field(default_factory=AdaptParams)
