"""Tables and target verdicts of bench/adaptation/quality.py, from its results (no service here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "AutoSummary",
    "Results",
    "Verdict",
    "accuracy_tables",
    "auto_choice_table",
    "auto_summary",
    "auto_verdicts",
    "main_table",
    "noise_gains",
    "target_lines",
    "verdicts",
]

# The targets, in accuracy points (percent of the test set).
PRECISE_WITHIN_CLEAN_POINTS: Final = 3.0
PRECISE_SHIFTS: Final = ("contrast", "brightness", "scale")
NOISE_GAIN_POINTS: Final = 5.0
NOISE_SHIFT: Final = "gaussian_noise"
CLEAN_LOSS_POINTS: Final = 1.0
# The auto estimator's targets: it never loses more than this against the source model...
AUTO_LOSS_POINTS: Final = 0.5
# ...its mean gain over the shifted conditions is at least this share of the best fixed
# estimator's...
AUTO_GAIN_SHARE: Final = 0.9
# ...and on clean data it moves accuracy by at most this.
AUTO_CLEAN_POINTS: Final = 0.2


@dataclass
class Results:
    """Accuracies in [0, 1] on the whole test set of each condition. ``adapted`` is keyed by
    (condition, estimator, n) with ``n`` the number of target samples (``num_test`` = all);
    a missing key is a job that failed (its message in ``failures``)."""

    conditions: list[str]
    estimators: list[str]
    sample_counts: list[int]
    num_test: int
    source: dict[str, float]
    adapted: dict[tuple[str, str, int], float]
    failures: list[str]
    # What the auto jobs kept, by the same keys: "source", "precise", "prior w=0.5", ...
    choices: dict[tuple[str, str, int], str] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    target: str
    condition: str
    detail: str
    holds: bool


def _pct(value: float | None) -> str:
    return "failed" if value is None else f"{100 * value:.1f}"


def _n_label(n: int, num_test: int) -> str:
    return f"all ({num_test})" if n == num_test else str(n)


def main_table(results: Results, estimator_labels: dict[str, str]) -> list[str]:
    """Conditions by estimators, adapted on the whole shifted test set."""
    n = results.num_test
    head = ["condition", "source", *(estimator_labels[e] for e in results.estimators)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for condition in results.conditions:
        cells = [_pct(results.adapted.get((condition, e, n))) for e in results.estimators]
        lines.append(
            f"| {condition} | {_pct(results.source.get(condition))} | {' | '.join(cells)} |"
        )
    return lines


def accuracy_tables(results: Results, estimator_labels: dict[str, str]) -> list[str]:
    """One table per estimator: conditions by number of target samples."""
    lines: list[str] = []
    head = [
        "condition",
        "source",
        *(f"n={_n_label(n, results.num_test)}" for n in results.sample_counts),
    ]
    for estimator in results.estimators:
        lines += [f"`{estimator_labels[estimator]}`:", ""]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for condition in results.conditions:
            cells = [
                _pct(results.adapted.get((condition, estimator, n))) for n in results.sample_counts
            ]
            lines.append(
                f"| {condition} | {_pct(results.source.get(condition))} | {' | '.join(cells)} |"
            )
        lines.append("")
    return lines


def _severities(results: Results, shift: str) -> list[str]:
    """The uniform conditions of ``shift`` (``<shift>-<digit>``, not the per-image variants)."""
    return [
        c
        for c in results.conditions
        if c.rpartition("-")[0] == shift and c.rpartition("-")[2].isdigit()
    ]


def noise_gains(results: Results) -> dict[str, float | None]:
    """Points `precise` on all the test digits gains over the source model, at each severity of
    Gaussian noise (None: the job failed)."""
    gains: dict[str, float | None] = {}
    for condition in _severities(results, NOISE_SHIFT):
        acc = results.adapted.get((condition, "precise", results.num_test))
        gains[condition] = None if acc is None else 100 * (acc - results.source[condition])
    return gains


def verdicts(results: Results, clean: str) -> list[Verdict]:
    """Each target checked at every severity (and, for clean data, every estimator)."""
    n = results.num_test
    clean_acc = results.source[clean]
    found: list[Verdict] = []
    # The targets of `precise` on all the shifted digits; a plan without n = all has none.
    precise_shifts = PRECISE_SHIFTS if n in results.sample_counts else ()
    noise_shifts = [NOISE_SHIFT] if n in results.sample_counts else []
    for shift in precise_shifts:
        for condition in _severities(results, shift):
            acc = results.adapted.get((condition, "precise", n))
            gap = None if acc is None else 100 * (clean_acc - acc)
            found.append(
                Verdict(
                    f"precise within {PRECISE_WITHIN_CLEAN_POINTS:g} points of clean",
                    condition,
                    f"{_pct(acc)} vs clean {_pct(clean_acc)}"
                    + ("" if gap is None else f" (gap {gap:+.1f})"),
                    gap is not None and gap <= PRECISE_WITHIN_CLEAN_POINTS,
                )
            )
    gains = noise_gains(results) if noise_shifts else {}
    for condition, gain in gains.items():
        acc = results.adapted.get((condition, "precise", n))
        source = results.source[condition]
        found.append(
            Verdict(
                f"precise gains >= {NOISE_GAIN_POINTS:g} points on noise",
                condition,
                f"{_pct(acc)} vs source {_pct(source)}"
                + ("" if gain is None else f" (gain {gain:+.1f})")
                + f"; the source is {100 * (clean_acc - source):.1f} below clean",
                gain is not None and gain >= NOISE_GAIN_POINTS,
            )
        )
    for estimator in results.estimators:
        # The worst case over the numbers of target samples.
        accs = {c: results.adapted.get((clean, estimator, c)) for c in results.sample_counts}
        missing = [c for c, acc in accs.items() if acc is None]
        worst = min(results.sample_counts, key=lambda c: accs[c] or 0.0)
        loss = 100 * (clean_acc - (accs[worst] or 0.0))
        found.append(
            Verdict(
                f"clean: loses <= {CLEAN_LOSS_POINTS:g} point",
                f"{estimator}, every n",
                f"worst {_pct(accs[worst])} at n={_n_label(worst, n)} vs {_pct(clean_acc)} "
                f"(loss {loss:+.1f})",
                not missing and loss <= CLEAN_LOSS_POINTS,
            )
        )
    return found


def target_lines(found: Sequence[Verdict]) -> list[str]:
    lines = ["| target | where | accuracy (%) | holds |", "|---|---|---|---|"]
    lines += [
        f"| {v.target} | {v.condition} | {v.detail} | {'yes' if v.holds else '**no**'} |"
        for v in found
    ]
    return lines


def auto_choice_table(results: Results, autos: Sequence[str], labels: dict[str, str]) -> list[str]:
    """Conditions by numbers of target samples: what each auto estimator kept."""
    head = [
        "condition",
        *(
            f"{labels[a]}, n={_n_label(n, results.num_test)}"
            for a in autos
            for n in results.sample_counts
        ),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for condition in results.conditions:
        cells = [
            results.choices.get((condition, a, n), "failed")
            for a in autos
            for n in results.sample_counts
        ]
        lines.append(f"| {condition} | {' | '.join(cells)} |")
    return lines


def _losses(results: Results, auto: str, n: int) -> dict[str, float]:
    """Points ``auto`` at ``n`` samples loses against the source model, by condition (the
    conditions whose job failed left out)."""
    return {
        c: 100 * (results.source[c] - results.adapted[c, auto, n])
        for c in results.conditions
        if (c, auto, n) in results.adapted and c in results.source
    }


def _mean_gain(results: Results, shifted: Sequence[str], estimator: str, n: int) -> float | None:
    """Mean points gained over the source model across ``shifted`` (None: a job failed)."""
    gains = [
        results.adapted[c, estimator, n] - results.source[c]
        for c in shifted
        if (c, estimator, n) in results.adapted
    ]
    return 100 * sum(gains) / len(gains) if len(gains) == len(shifted) else None


@dataclass(frozen=True)
class _Gains:
    """``auto``'s mean gain at one n against the best fixed estimator's."""

    auto: float | None
    best: str
    best_gain: float | None

    @property
    def share(self) -> float | None:
        return None if self.auto is None or not self.best_gain else self.auto / self.best_gain


def _gains(
    results: Results, shifted: Sequence[str], auto: str, n: int, fixed: Sequence[str]
) -> _Gains:
    best = max(fixed, key=lambda e: _mean_gain(results, shifted, e, n) or -1e9)
    return _Gains(
        _mean_gain(results, shifted, auto, n), best, _mean_gain(results, shifted, best, n)
    )


@dataclass(frozen=True)
class AutoSummary:
    """``auto`` over every condition and n: its worst change against the source model, in
    points (negative: a loss), and the least and most share its mean gain is of the best fixed
    estimator's; None where a job failed."""

    worst_change: float | None
    shares: tuple[float, float] | None


def auto_summary(results: Results, clean: str, auto: str, fixed: Sequence[str]) -> AutoSummary:
    shifted = [c for c in results.conditions if c != clean]
    losses = [_losses(results, auto, n) for n in results.sample_counts]
    complete = all(len(found) == len(results.conditions) for found in losses)
    worst = max(loss for found in losses for loss in found.values()) if complete else None
    shares = [_gains(results, shifted, auto, n, fixed).share for n in results.sample_counts]
    known = [share for share in shares if share is not None]
    return AutoSummary(
        None if worst is None else -worst,
        (min(known), max(known)) if known and len(known) == len(shares) else None,
    )


def auto_verdicts(
    results: Results, clean: str, autos: Sequence[str], fixed: Sequence[str]
) -> list[Verdict]:
    """The auto targets, for each auto estimator and every n: the worst loss against the source
    over all conditions, the mean gain over the shifted conditions against the best fixed
    estimator's, and the change on clean data."""
    found: list[Verdict] = []
    shifted = [c for c in results.conditions if c != clean]
    for auto in autos:
        for n in results.sample_counts:
            where = f"{auto}, n={_n_label(n, results.num_test)}"
            losses = _losses(results, auto, n)
            missing = len(results.conditions) - len(losses)
            worst = max(losses, key=lambda c: losses[c]) if losses else "none"
            found.append(
                Verdict(
                    f"auto loses <= {AUTO_LOSS_POINTS:g} point vs source, every condition",
                    where,
                    f"worst {worst}: {-losses.get(worst, 0.0):+.1f}"
                    + (f"; {missing} failed" if missing else ""),
                    not missing and losses[worst] <= AUTO_LOSS_POINTS,
                )
            )
            gains = _gains(results, shifted, auto, n, fixed)
            share = gains.share
            found.append(
                Verdict(
                    f"auto's mean gain >= {AUTO_GAIN_SHARE:.0%} of the best fixed estimator's",
                    where,
                    f"{gains.auto or 0:+.2f} vs {gains.best} {gains.best_gain or 0:+.2f} over "
                    f"{len(shifted)} conditions" + ("" if share is None else f" ({share:.0%})"),
                    share is not None and share >= AUTO_GAIN_SHARE,
                )
            )
            clean_acc = results.adapted.get((clean, auto, n))
            change = None if clean_acc is None else 100 * (clean_acc - results.source[clean])
            found.append(
                Verdict(
                    f"auto on clean data moves accuracy <= {AUTO_CLEAN_POINTS:g} point",
                    where,
                    f"{_pct(clean_acc)} vs {_pct(results.source[clean])}"
                    + ("" if change is None else f" ({change:+.1f})"),
                    change is not None and abs(change) <= AUTO_CLEAN_POINTS + 1e-9,
                )
            )
    return found
