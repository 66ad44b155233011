"""Train jobs: all parameters trained on a labelled dataset, with a trainer's recipe
(schedules, accumulation, mixed precision, clipping, label smoothing) and resumable from
training checkpoints (docs/training.md)."""

from typing import Final, Literal, Self

from pydantic import Field, model_validator

from api_schemas.common import RequestModel, ResourceId
from api_schemas.jobs.params import MAX_LR, MAX_STEPS, BaseJobCreate, ModelJobParams

__all__ = [
    "MAX_ACCUMULATE_STEPS",
    "MAX_EPOCHS",
    "MAX_LOADER_WORKERS",
    "MAX_PROCESSES",
    "MAX_SAVE_EVERY_S",
    "MIN_SAVE_EVERY_S",
    "MIN_SAVE_EVERY_STEPS",
    "Augmentation",
    "LrSchedule",
    "Precision",
    "TrainJobCreate",
    "TrainParams",
]

# NOTE [ Job bounds ] in api_schemas/jobs/params.py.
MAX_EPOCHS: Final = 1000
MAX_WEIGHT_DECAY: Final = 1.0
# Ranks of one train job on one worker (docs/distributed.md): on CUDA one a GPU, so a worker
# runs at most as many as it serves GPUs (the job fails saying so beyond); on the CPU one a
# share of the worker's cores. 8 is the GPUs of one large machine.
MAX_PROCESSES: Final = 8
# Micro-batches per optimizer step: 1024 batches of 64 make a 65,536-sample step, past any
# effective batch a recipe here asks for.
MAX_ACCUMULATE_STEPS: Final = 1024
# A checkpoint at most once a day is no checkpoint.
MAX_SAVE_EVERY_S: Final = 24 * 3600
# The floors of the checkpoint intervals. A training checkpoint writes every weight and every
# optimizer slot (three times the weights with Adam) as a new store object, hashed, then a
# record, and the previous one becomes garbage for the collector: at least the memory traffic
# of an optimizer step, plus a store round trip (a request to the bucket on S3), for a few
# milliseconds of a small model's step. Every 10 steps keeps the writes near a tenth of a job's
# time at worst; every 60 s at least bounds them by the clock whatever the model's size (a
# large checkpoint takes seconds to write), and a retried attempt redoes at most that minute.
MIN_SAVE_EVERY_STEPS: Final = 10
MIN_SAVE_EVERY_S: Final = 60
MAX_CLIP_GRAD_NORM: Final = 1e6

# DataLoader processes decoding one job's training batches: past 16 a worker machine's cores
# are the limit, not the job's.
MAX_LOADER_WORKERS: Final = 16

LrSchedule = Literal["constant", "cosine", "step", "one_cycle"]
Precision = Literal["fp32", "bf16", "fp16"]


class Augmentation(RequestModel):
    """Training-time augmentation of image samples (C, H, W), drawn per micro-batch from the
    job's seed (docs/training.md): validation and the measurements before and after see the
    samples as they are."""

    random_resized_crop: bool = Field(
        default=False,
        description="Crop each sample to a random box (area fraction in crop_scale, aspect "
        "ratio in crop_ratio, as torchvision's RandomResizedCrop) and resize it back to its "
        "size (bilinear).",
    )
    crop_scale: list[float] = Field(
        default=[0.08, 1.0],
        min_length=2,
        max_length=2,
        description="The box's area over the sample's: [low, high] in (0, 1].",
    )
    crop_ratio: list[float] = Field(
        default=[3 / 4, 4 / 3],
        min_length=2,
        max_length=2,
        description="The box's width over its height: [low, high], above 0.",
    )
    horizontal_flip: bool = Field(
        default=False, description="Flip each sample left-right with probability 1/2."
    )

    @model_validator(mode="after")
    def _ranges(self) -> Self:
        low, high = self.crop_scale
        if not 0 < low <= high <= 1:
            raise ValueError(
                f"crop_scale must be (low, high) with 0 < low <= high <= 1, got "
                f"{list(self.crop_scale)}; e.g. [0.08, 1.0]"
            )
        low, high = self.crop_ratio
        if not 0 < low <= high <= 100:
            raise ValueError(
                f"crop_ratio must be (low, high) with 0 < low <= high <= 100, got "
                f"{list(self.crop_ratio)}; e.g. [0.75, 1.3333]"
            )
        return self


class TrainParams(ModelJobParams):
    """Train all parameters with ``optimizer``. ``loss=None`` picks cross-entropy for class
    labels and MSE for float targets. Every field is described in docs/training.md.

    ``batch_size`` is the micro-batch: the samples of one forward and backward pass (and of
    one BatchNorm statistics update). The optimizer steps once every ``accumulate_steps``
    micro-batches, on the mean gradient over their samples: the effective batch is
    ``batch_size * accumulate_steps`` samples.

    ``compile``: the training steps run through ``torch.compile`` with ``compile_backend``
    (NOTE [ Compiled jobs ] in api_schemas/jobs/params.py); the report's ``steps`` gives the
    compilation's cost and the steady-state throughput."""

    epochs: int = Field(
        default=1, ge=1, le=MAX_EPOCHS, description=f"Passes over the data, 1 to {MAX_EPOCHS}."
    )
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(
        default=0.05,
        gt=0.0,
        le=MAX_LR,
        allow_inf_nan=False,
        description=f"Learning rate, above 0, at most {MAX_LR:g}.",
    )
    momentum: float = Field(
        default=0.9,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="sgd: momentum; adamw: its beta1. 0 to below 1.",
    )
    weight_decay: float = Field(
        default=0.0,
        ge=0.0,
        le=MAX_WEIGHT_DECAY,
        allow_inf_nan=False,
        description=f"Weight decay, 0 to {MAX_WEIGHT_DECAY:g}.",
    )
    loss: Literal["cross_entropy", "mse"] | None = None
    validation_fraction: float = Field(
        default=0.1,
        ge=0.0,
        le=0.9,
        allow_inf_nan=False,
        description="Fraction of the samples kept out of training to validate on, 0 to 0.9.",
    )
    # Data parallelism (docs/distributed.md): kept together, checked by _ranks_fit.
    processes: int = Field(
        default=1,
        ge=1,
        le=MAX_PROCESSES,
        description=f"Ranks of the job on one worker, 1 to {MAX_PROCESSES}: one a GPU on CUDA "
        "(at most the worker's GPUs), gloo processes on the CPU. Each global batch of "
        "batch_size is split into processes slices of batch_size / processes (it must divide); "
        "gradients are averaged over the ranks (DDP), BatchNorm statistics are rank 0's.",
    )
    sync_batchnorm: bool = Field(
        default=False,
        description="Synchronise BatchNorm across the ranks: statistics over the whole global "
        "batch, all ranks together, on the CPU (gloo) as on CUDA (NCCL); with processes 1 it "
        "changes nothing.",
    )

    lr_schedule: LrSchedule = Field(
        default="constant",
        description="How the learning rate moves over the optimizer steps after the warm-up: "
        "constant; cosine (down to 0 at the end); step (times lr_gamma every lr_step_epochs "
        "epochs); one_cycle (up from lr/25 over warmup_steps, 30% of the steps when 0, then "
        "cosine down to lr/250000).",
    )
    warmup_steps: int = Field(
        default=0,
        ge=0,
        le=MAX_STEPS,
        description="Optimizer steps of linear warm-up: step t (from 0) of the warm-up runs at "
        "lr * (t + 1) / (warmup_steps + 1). Fewer than the job's optimizer steps.",
    )
    lr_step_epochs: int | None = Field(
        default=None,
        ge=1,
        le=MAX_EPOCHS,
        description="lr_schedule step: the learning rate is multiplied by lr_gamma every this "
        "many epochs. Needed by step, refused otherwise.",
    )
    lr_gamma: float = Field(
        default=0.1,
        gt=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="lr_schedule step: the factor of each decay, above 0, below 1.",
    )
    label_smoothing: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="Cross-entropy's label smoothing in training (validation reports the "
        "plain loss), 0 to below 1. Class labels only.",
    )
    clip_grad_norm: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_CLIP_GRAD_NORM,
        allow_inf_nan=False,
        description="Clip the total gradient norm (all parameters as one vector, L2) to this "
        "before each optimizer step; null: no clipping.",
    )
    accumulate_steps: int = Field(
        default=1,
        ge=1,
        le=MAX_ACCUMULATE_STEPS,
        description=f"Micro-batches (of batch_size samples) per optimizer step, 1 to "
        f"{MAX_ACCUMULATE_STEPS}; the step uses the mean gradient over their samples.",
    )
    precision: Precision = Field(
        default="fp32",
        description="fp32; bf16 (autocast to bfloat16, CPU and CUDA); fp16 (autocast to "
        "float16 with a gradient scaler, CUDA only: device must be cuda).",
    )
    keep_best: bool = Field(
        default=False,
        description="Keep the weights of the epoch with the lowest validation loss (the "
        "report's best_epoch) instead of the last; needs validation_fraction > 0.",
    )
    augmentation: Augmentation | None = Field(
        default=None,
        description="Augmentation of image samples (C, H, W) in training; null: none.",
    )
    loader_workers: int = Field(
        default=0,
        ge=0,
        le=MAX_LOADER_WORKERS,
        description=f"DataLoader processes that read, decode and augment the training "
        f"batches ahead of the steps, 0 to {MAX_LOADER_WORKERS}; 0: the job's own process. "
        "The results are the same either way.",
    )
    save_every_steps: int | None = Field(
        default=None,
        ge=MIN_SAVE_EVERY_STEPS,
        le=MAX_STEPS,
        description="Write a training checkpoint every this many optimizer steps (and at the "
        f"end), at least {MIN_SAVE_EVERY_STEPS}: each one writes the weights and the optimizer's "
        "state to the store; a retried attempt resumes from the latest. null: none by steps.",
    )
    save_every_s: int | None = Field(
        default=None,
        ge=MIN_SAVE_EVERY_S,
        le=MAX_SAVE_EVERY_S,
        description="Write a training checkpoint at the first optimizer step this many seconds "
        f"after the last one (and at the end), at least {MIN_SAVE_EVERY_S}. null: none by time.",
    )
    resume_from: ResourceId | None = Field(
        default=None,
        description="A train job of yours that kept a training checkpoint (save_every_steps or "
        "save_every_s): this job continues from its latest checkpoint up to epoch `epochs`. "
        "Same model_id, dataset_id, seed, batch_size, accumulate_steps, "
        "validation_fraction, optimizer and processes as that job.",
    )

    @model_validator(mode="after")
    def _ranks_fit(self) -> Self:
        if self.batch_size % self.processes:
            raise ValueError(
                f"batch_size {self.batch_size} does not split into processes={self.processes} "
                "equal slices; use a batch_size that is a multiple of processes (e.g. "
                f"{self.batch_size - self.batch_size % self.processes or self.processes})"
            )
        if self.processes > 1 and self.batch_size // self.processes < 2:
            raise ValueError(
                f"batch_size {self.batch_size} over processes={self.processes} leaves "
                f"{self.batch_size // self.processes} sample per rank, and BatchNorm in train "
                f"mode needs at least 2; use batch_size >= {2 * self.processes}"
            )
        if self.processes > 1 and self.device.startswith("cuda:"):
            raise ValueError(
                f"device {self.device!r} names one GPU, but processes={self.processes} runs "
                "one rank a GPU; use device 'cuda' or 'auto'"
            )
        if self.processes > 1 and self.compile:
            raise ValueError(
                "compile is not offered with processes > 1 yet; submit with compile: false "
                "or processes: 1"
            )
        return self

    @model_validator(mode="after")
    def _recipe_fits(self) -> Self:
        if self.lr_schedule == "step" and self.lr_step_epochs is None:
            raise ValueError(
                "lr_schedule 'step' needs lr_step_epochs (the epochs between two decays by "
                "lr_gamma); add it, or choose another lr_schedule"
            )
        if self.lr_schedule != "step" and self.lr_step_epochs is not None:
            raise ValueError(
                f"lr_step_epochs is an option of lr_schedule 'step', not "
                f"{self.lr_schedule!r}; add lr_schedule: 'step', or drop lr_step_epochs"
            )
        if self.label_smoothing > 0 and self.loss == "mse":
            raise ValueError(
                "label_smoothing applies to cross_entropy on class labels, not to loss mse; "
                "drop label_smoothing or use loss cross_entropy"
            )
        if self.precision == "fp16" and not self.device.startswith("cuda"):
            raise ValueError(
                f"precision fp16 runs on CUDA only (a gradient scaler with float16 autocast), "
                f"and device is {self.device!r}; set device 'cuda', or use precision bf16 "
                "(CPU and CUDA) or fp32"
            )
        if self.keep_best and self.validation_fraction == 0:
            raise ValueError(
                "keep_best picks the epoch with the lowest validation loss and "
                "validation_fraction is 0: there is no validation split; set "
                "validation_fraction above 0, or drop keep_best"
            )
        return self


class TrainJobCreate(BaseJobCreate):
    """Asks for training of a model on a labelled dataset."""

    kind: Literal["train"]
    params: TrainParams = Field(default_factory=TrainParams)
