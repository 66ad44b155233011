"""Learning-rate schedules: the rate of each optimizer step as a pure function of the step.

A function of the step count alone, not a torch scheduler object: a resumed job sets the rate
of step t from t, so a training checkpoint needs no scheduler state beyond the step count, and
the rates cannot drift from torch's chained multiplications. docs/training.md gives the
formulas; tests/workers/training/test_recipe.py checks them against a hand-written loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["ONE_CYCLE_DIV", "ONE_CYCLE_FINAL_DIV", "ONE_CYCLE_WARMUP_FRACTION", "Schedule"]

# one_cycle's start is lr / ONE_CYCLE_DIV and its end lr / (ONE_CYCLE_DIV *
# ONE_CYCLE_FINAL_DIV), and without warmup_steps its rise is that fraction of the steps: the
# defaults of torch.optim.lr_scheduler.OneCycleLR.
ONE_CYCLE_DIV: Final = 25.0
ONE_CYCLE_FINAL_DIV: Final = 1e4
ONE_CYCLE_WARMUP_FRACTION: Final = 0.3


@dataclass(frozen=True)
class Schedule:
    """The learning rate of optimizer step ``t`` (from 0) of ``total_steps``."""

    kind: Literal["constant", "cosine", "step", "one_cycle"]
    lr: float
    total_steps: int
    warmup_steps: int = 0
    steps_per_epoch: int = 1  # optimizer steps in one epoch (step schedule)
    step_epochs: int = 1  # epochs between two decays (step schedule)
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.total_steps < 1 or self.steps_per_epoch < 1 or self.step_epochs < 1:
            raise ValueError(
                f"total_steps, steps_per_epoch and step_epochs must be >= 1, got "
                f"{self.total_steps}, {self.steps_per_epoch} and {self.step_epochs}"
            )
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must be below the job's "
                f"{self.total_steps} optimizer steps; lower warmup_steps or train longer"
            )

    def rise_steps(self) -> int:
        """The steps of the warm-up (one_cycle: its rise)."""
        if self.kind == "one_cycle" and self.warmup_steps == 0:
            return max(1, round(ONE_CYCLE_WARMUP_FRACTION * self.total_steps))
        return self.warmup_steps

    def at(self, t: int) -> float:
        return self.lr * self.factor(t)

    def factor(self, t: int) -> float:
        """lr(t) / lr."""
        rise = self.rise_steps()
        if self.kind == "one_cycle":
            start, end = 1 / ONE_CYCLE_DIV, 1 / (ONE_CYCLE_DIV * ONE_CYCLE_FINAL_DIV)
            if t < rise:
                return start + (1 - start) * t / rise
            fall = max(1, self.total_steps - 1 - rise)
            return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * min(t - rise, fall) / fall))
        if t < rise:
            return (t + 1) / (rise + 1)
        if self.kind == "constant":
            return 1.0
        if self.kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * (t - rise) / (self.total_steps - rise)))
        if self.kind == "step":
            return float(self.gamma ** ((t // self.steps_per_epoch) // self.step_epochs))
        raise ValueError(f"unknown lr_schedule {self.kind!r}")
