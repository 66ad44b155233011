"""Reports: what a job changed, measured by the worker."""

from pydantic import BaseModel, ConfigDict, Field

from api_schemas.common import ResourceId
from api_schemas.datasets import Preprocessing
from api_schemas.jobs.kinds import JobKind

__all__ = [
    "AffineChange",
    "AutoCandidate",
    "AutoChoice",
    "BatchNormChange",
    "CheckpointSummary",
    "EpochLog",
    "Metrics",
    "PredictionDiagnostics",
    "Predictions",
    "Report",
    "ShardSummary",
    "StepTimings",
    "TensorChange",
    "Timings",
    "TrainAttempt",
]


class _ReportModel(BaseModel):
    # A diverged training run has a NaN loss and the report must still say so: written as the
    # strings "NaN"/"Infinity" the JSON stays valid and reads back as the same float.
    model_config = ConfigDict(ser_json_inf_nan="strings")


class Timings(_ReportModel):
    """Wall-clock seconds."""

    load_s: float = Field(ge=0.0, description="Building the model, reading weights and data.")
    compute_s: float = Field(
        ge=0.0, description="The adaptation or the training alone (an auto job's choice included)."
    )
    measure_s: float = Field(
        default=0.0,
        ge=0.0,
        description="Measuring the model before and after: the metrics on labelled data and "
        "the prediction diagnostics (0 in reports written before this field existed).",
    )
    total_s: float = Field(ge=0.0)


class StepTimings(_ReportModel):
    """The optimizer steps of a train job or a backward-pass adapt job (``entropy``), timed one
    by one: what compilation costs and what it gives (NOTE [ Compiled jobs ] in
    api_schemas/jobs/params.py). Given for compiled and eager jobs alike, measured the same
    way, so that two jobs on the same data and params compare like for like.

    The speed-up of ``compile`` is not in one report: it is ``steady_samples_per_s`` of a
    compiled job over that of the same job run eagerly. The worker does not time an eager
    reference inside a compiled job: that would cost every compiled job extra steps (on a
    copy of the model and optimizer, since steps change them), and a few steps' timing is
    too noisy to be worth its cost. ``python -m bench.training.compile`` gives the ratio.
    """

    compiled: bool = Field(description="Whether the steps ran through torch.compile.")
    backend: str | None = Field(
        default=None, description="The torch.compile backend; null for an eager job."
    )
    steps: int = Field(ge=0, description="All optimizer steps of the job.")
    warmup_steps: int = Field(
        ge=0,
        description="Steps that paid a one-off cost, timed apart from the rest: the first "
        "step (compilation of the forward and backward graphs when compiled; lazy "
        "initialisation when eager) and every later step during which torch compiled another "
        "graph (a recompilation, such as for a shorter last batch).",
    )
    warmup_s: float = Field(
        ge=0.0,
        description="Wall-clock seconds of the warm-up steps, compilation included: a "
        "compiled job's compile cost is about warmup_s less warmup_steps steady steps. Lower "
        "when torch's on-disk compile cache already holds the graphs (an earlier job of the "
        "same model and shapes on the same worker machine).",
    )
    graphs_compiled: int = Field(
        ge=0, description="Graphs torch compiled during the steps (0 for an eager job)."
    )
    steady_steps: int = Field(ge=0, description="steps - warmup_steps.")
    steady_samples: int = Field(ge=0, description="Samples in the steady steps.")
    steady_s: float = Field(ge=0.0, description="Wall-clock seconds of the steady steps.")
    steady_samples_per_s: float | None = Field(
        default=None,
        ge=0.0,
        description="steady_samples / steady_s: the throughput once nothing is compiled any "
        "more; null without steady steps. Each step is its own forward, backward and "
        "optimizer update (on CUDA followed by a synchronisation, in both modes, so that a "
        "step's time is its own).",
    )


class BatchNormChange(_ReportModel):
    """One normalization layer before and after the job.

    ``batches_run`` is how many batches went through the layer in train mode; ``reset`` says
    whether its statistics were cleared first. The stat-consistency fact (no double update
    under checkpointing): ``num_batches_tracked_after == (0 if reset else
    num_batches_tracked_before) + batches_run``.
    """

    name: str
    adapted: bool
    running_mean_mean_abs_shift: float
    running_var_mean_ratio: float  # mean over channels of after / before
    num_batches_tracked_before: int = Field(ge=0)
    num_batches_tracked_after: int = Field(ge=0)
    batches_run: int = Field(ge=0)
    reset: bool = False

    @property
    def consistent(self) -> bool:
        start = 0 if self.reset else self.num_batches_tracked_before
        return self.num_batches_tracked_after == start + self.batches_run


class AffineChange(_ReportModel):
    """One normalization layer whose affine parameters the job trained (the ``entropy``
    estimator): its class (``BatchNorm2d``, ``LayerNorm``, ``GroupNorm``, ...), the parameters
    (``weight``, ``bias``) and the largest absolute change of any of their elements."""

    name: str
    kind: str
    parameters: list[str]
    changed: bool
    max_abs: float


class CheckpointSummary(_ReportModel):
    """Which modules ran under activation checkpointing (the job's ``checkpoint`` policy).

    ``blocks_rule`` says how the ``blocks`` preset found the model's blocks: ``block_types``
    (the architecture's own block classes), ``repeated`` (the structural rule: modules of one
    class repeated in an nn.Sequential or nn.ModuleList) or ``none`` (neither found any: the
    job ran without checkpointing them, and ``note`` says so); null for the preset ``none``.
    """

    preset: str
    blocks_rule: str | None = None
    wrapped: int = Field(ge=0, description="How many modules were wrapped.")
    modules: list[str] = Field(default_factory=list, description="Their qualified names.")
    note: str | None = None


class TensorChange(_ReportModel):
    """One state-dict tensor before and after the job. ``relative_l2`` is
    ``||after - before|| / ||before||``, null where it means nothing: an integer tensor (a
    counter like ``num_batches_tracked``) or a zero baseline (``||before||`` < 1e-12, such as
    a fresh model's ``running_mean``); ``l2`` is the absolute change ``||after - before||``,
    and a one-element integer tensor shows its plain ``before`` and ``after`` values. (Reports
    of earlier versions divided by a floor instead: 1e37 and more from a zero baseline, and
    have no ``l2``.)"""

    name: str
    changed: bool
    max_abs: float  # largest absolute elementwise difference
    relative_l2: float | None
    l2: float | None = None
    before: float | None = None
    after: float | None = None


class Metrics(_ReportModel):
    """Evaluation on the job's dataset; ``accuracy`` for class labels, ``mse`` for targets.
    ``loss`` is the mean cross-entropy per sample, or the mean squared error per element."""

    num_samples: int = Field(ge=0)
    loss: float
    accuracy: float | None = Field(default=None, ge=0.0, le=1.0)
    mse: float | None = None


class EpochLog(_ReportModel):
    """One training epoch, numbered from 1."""

    epoch: int = Field(ge=1)
    train_loss: float
    val_loss: float | None = None
    val_accuracy: float | None = Field(default=None, ge=0.0, le=1.0)
    lr: float | None = None  # the learning rate of the epoch's last step
    best: bool = False  # the lowest validation loss so far (the epoch keep_best would keep)


class TrainAttempt(_ReportModel):
    """One attempt of a train job (NOTE [ Job attempts ]): the optimizer step it started at,
    from the latest training checkpoint (0: from the start; NOTE [ Training checkpoints ])."""

    attempt: int = Field(ge=1)
    resumed_from_step: int = Field(ge=0)


class ShardSummary(_ReportModel):
    """One shard of a sharded adapt job: batches ``first_batch`` to ``first_batch + batches -
    1`` of the job (numbered from 0), collected by the RQ worker named ``worker``."""

    index: int = Field(ge=0)
    first_batch: int = Field(ge=0)
    batches: int = Field(ge=1)
    samples: int = Field(ge=1)
    worker: str
    compute_s: float = Field(ge=0.0)


class Predictions(_ReportModel):
    """A model's class predictions on some samples, without labels: ``mean_entropy`` (nats)
    and ``mean_max_probability`` of the softmax per sample, ``marginal_entropy`` (nats) of the
    mean softmax (low when predictions pile onto few classes)."""

    mean_entropy: float = Field(ge=0.0)
    mean_max_probability: float = Field(ge=0.0, le=1.0)
    marginal_entropy: float = Field(ge=0.0)


class PredictionDiagnostics(_ReportModel):
    """Unsupervised diagnostics of an adapt job: the input and the output model on the same
    ``samples`` target samples, in the job's batch size. ``held_out``: the samples were held
    out of estimation (the job's ``holdout``); otherwise they are the samples the estimator
    used. ``changed_fraction``: samples whose predicted class differs after."""

    samples: int = Field(ge=1)
    held_out: bool
    before: Predictions
    after: Predictions
    changed_fraction: float = Field(ge=0.0, le=1.0)


class AutoCandidate(_ReportModel):
    """One candidate the ``auto`` estimator scored on its held-out samples. ``name`` is
    ``source`` (the input statistics), ``precise``, ``prior`` (then ``prior_strength`` is the
    N the ``prior`` estimator would take for the same estimation samples, ``source_weight``
    the source's share) or ``entropy``. ``score``: marginal entropy minus mean entropy (higher
    is better); ``eligible``: it passed the rule's gates against the source (the report's
    ``criterion``), so it could be kept (the source always is)."""

    name: str
    prior_strength: float | None = None
    source_weight: float | None = Field(default=None, ge=0.0, le=1.0)
    predictions: Predictions
    score: float
    eligible: bool
    changed_fraction: float = Field(ge=0.0, le=1.0)  # held-out predictions unlike the source's


class AutoChoice(_ReportModel):
    """What the ``auto`` estimator tried and kept: candidates estimated on
    ``estimation_samples``, scored on ``held_out_samples`` by ``criterion``; ``chosen`` is one
    of the candidates' names (by index, ``chosen_index``), ``kept_source`` when it is the
    input model, unchanged."""

    criterion: str
    estimation_samples: int = Field(ge=1)
    held_out_samples: int = Field(ge=1)
    # Cross-fitting (a few held-out samples): the candidates were also estimated without each
    # of folds - 1 further folds of the estimation samples and scored on it, so the scores are
    # over scored_samples (all the job's samples); 1 fold: the held-out samples only.
    folds: int = Field(default=1, ge=1)
    scored_samples: int | None = Field(default=None, ge=1)

    def scored(self) -> int:
        """How many samples the scores are over."""
        return self.held_out_samples if self.scored_samples is None else self.scored_samples

    candidates: list[AutoCandidate]
    chosen: str
    chosen_index: int = Field(ge=0)
    kept_source: bool


class Report(_ReportModel):
    """The report of one finished job. ``estimator`` is a plain string so reports written by
    older versions stay readable when estimators are renamed or removed.

    ``metrics_before`` measures the input model on the job's dataset, ``metrics_after`` the
    output model. An ``evaluate`` job changes nothing: its result is ``metrics_before``;
    ``output_model_id`` and ``metrics_after`` are null, ``batchnorm`` and ``tensors`` empty,
    and ``batches``/``samples`` count the evaluation's forward passes."""

    job_id: ResourceId
    kind: JobKind
    input_model_id: ResourceId
    output_model_id: ResourceId | None
    device: str
    torch_version: str
    # torch's CPU threads in the job's process (BNADAPT_WORKER_THREADS); null in old reports.
    torch_threads: int | None = Field(default=None, ge=1)
    estimator: str | None = None
    batches: int = Field(ge=0)
    samples: int = Field(ge=0)
    timings: Timings
    batchnorm: list[BatchNormChange]
    tensors: list[TensorChange]
    metrics_before: Metrics | None = None
    metrics_after: Metrics | None = None
    epochs: list[EpochLog] = Field(default_factory=list)
    # An adapt job run with shards=K > 1: its K shards, in batch order (the timings are then
    # the merge's); empty when one worker ran all batches.
    shards: list[ShardSummary] = Field(default_factory=list)
    # Adapt jobs with class logits: predictions before and after on target samples (null in
    # old reports, for other outputs, and for sharded jobs whose evaluation children measure).
    diagnostics: PredictionDiagnostics | None = None
    # The auto estimator's candidates and choice; null for other estimators.
    auto: AutoChoice | None = None
    # Train jobs and entropy adapt jobs: the optimizer steps' timings, compiled or not; null
    # for forward-only jobs and in reports written before this field existed.
    steps: StepTimings | None = None
    # A train job run with processes=N (docs/distributed.md): N ranks, and each rank's step
    # timings in rank order, counting that rank's slices (their samples per second add up to
    # the job's). `steps` is then rank 0's. 1 and empty for a job in one process.
    world_size: int = Field(default=1, ge=1)
    rank_steps: list[StepTimings] = Field(default_factory=list)
    # How the dataset's images became inputs (its preprocessing spec); null for arrays
    # registered without one.
    preprocessing: Preprocessing | None = None
    # What the checkpoint policy wrapped; null in old reports and for evaluate jobs.
    checkpoint: CheckpointSummary | None = None
    # FrozenBatchNorm2d layers (torchvision's, timm's): fixed statistics and affine parameters
    # kept as buffers, never adapted by any estimator; listed so that a job that leaves them
    # as they were says so.
    frozen_norms: list[str] = Field(default_factory=list)
    # The entropy estimator: per layer, the affine parameters it trained and how they changed.
    affine: list[AffineChange] = Field(default_factory=list)
    # Train jobs run by a worker: each attempt and the step it resumed from, in order; empty
    # in-process and in reports written before this field existed.
    attempts: list[TrainAttempt] = Field(default_factory=list)
    # A train job with keep_best: the epoch whose weights are the job's output (by the lowest
    # validation loss); null otherwise.
    best_epoch: int | None = Field(default=None, ge=1)
    # A train job with resume_from: that job, and the optimizer step its checkpoint was at.
    resumed_from_job: ResourceId | None = None
