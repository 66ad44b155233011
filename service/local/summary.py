"""A job's report as lines of text, for every printer: `bnadapt demo`, `bnadapt jobs report`,
and what `bnadapt jobs submit --wait` and `bnadapt jobs show` add under a succeeded job. (The
web UI draws the report itself, as elements and charts: service/api/ui/app.js.)"""

from __future__ import annotations

from api_schemas import JobPublic, JobStatus
from api_schemas.reports import AutoChoice, Metrics, PredictionDiagnostics, Report

__all__ = ["diagnostic_lines", "outcome_lines", "report_summary"]


def _score(metrics: Metrics) -> str:
    return (
        f"accuracy {metrics.accuracy:.4f}" if metrics.accuracy is not None else f"mse {metrics.mse}"
    )


def _metrics_line(when: str, metrics: Metrics | None) -> str | None:
    if metrics is None:
        return None
    return f"{when:7} {_score(metrics)}, loss {metrics.loss:.4f} ({metrics.num_samples} samples)"


def _predictions_line(found: PredictionDiagnostics) -> str:
    where = "held-out" if found.held_out else "estimation"
    return (
        f"predictions on {found.samples} {where} samples, before -> after: mean entropy "
        f"{found.before.mean_entropy:.3f} -> {found.after.mean_entropy:.3f}, mean max "
        f"probability {found.before.mean_max_probability:.3f} -> "
        f"{found.after.mean_max_probability:.3f}, predictions changed "
        f"{100 * found.changed_fraction:.1f}%"
    )


def _auto_lines(auto: AutoChoice) -> list[str]:
    lines = [
        f"auto: {len(auto.candidates)} candidates estimated on "
        f"{auto.estimation_samples} samples, scored on {auto.held_out_samples} held out"
        + (
            f" and cross-fitted over {auto.folds} folds ({auto.scored()} samples scored)"
            if auto.folds > 1
            else ""
        )
        + f" ({auto.criterion})",
        "  candidate                 mean entropy  score    changed  eligible",
    ]
    for index, candidate in enumerate(auto.candidates):
        label = candidate.name
        if candidate.source_weight is not None:
            label += f" (source weight {candidate.source_weight:g})"
        mark = "  <- kept" if index == auto.chosen_index else ""
        lines.append(
            f"  {label:25} {candidate.predictions.mean_entropy:12.4f} "
            f"{candidate.score:7.4f} {100 * candidate.changed_fraction:6.1f}%  "
            f"{'yes' if candidate.eligible else 'no':8}{mark}"
        )
    lines.append(
        "auto kept the source model unchanged" if auto.kept_source else f"auto chose {auto.chosen}"
    )
    return lines


def diagnostic_lines(report: Report) -> list[str]:
    """An adapt job's prediction diagnostics and the auto estimator's candidates and choice
    (empty when it has neither)."""
    lines = [] if report.diagnostics is None else [_predictions_line(report.diagnostics)]
    return lines + ([] if report.auto is None else _auto_lines(report.auto))


def outcome_lines(job: JobPublic, report: Report) -> list[str]:
    """The few lines under a succeeded job: an ``evaluate`` job's metrics in one line, an
    ``adapt`` job's prediction diagnostics and the auto estimator's choice; nothing for
    other jobs and jobs that did not succeed."""
    if job.status is not JobStatus.SUCCEEDED:
        return []
    if job.kind == "adapt":
        return diagnostic_lines(report)
    metrics = report.metrics_before  # an evaluate job changes nothing: its result
    if job.kind != "evaluate" or metrics is None:
        return []
    return [
        f"{job.model_id} on {job.dataset_id}: {_score(metrics)}, loss {metrics.loss:.4f} "
        f"({metrics.num_samples} samples)"
    ]


def report_summary(report: Report) -> list[str]:
    """The report as the demo prints it (and `bnadapt jobs report`): metrics before and after,
    one line per BatchNorm layer, the tensors changed, the consistency check, the timing."""
    lines = [
        f"report of job {report.job_id} ({report.kind}, {report.estimator or '-'}): "
        f"{report.batches} batches, {report.samples} samples"
    ]
    lines += [
        line
        for line in (
            _metrics_line("before", report.metrics_before),
            _metrics_line("after", report.metrics_after),
        )
        if line is not None
    ]
    if report.batchnorm:
        lines.append("layer               mean |shift| of mean   var ratio   batches tracked")
    for layer in report.batchnorm:
        how = "reset, then" if layer.reset else "then"
        lines.append(
            f"{layer.name:20} {layer.running_mean_mean_abs_shift:20.4f} "
            f"{layer.running_var_mean_ratio:11.3f}   "
            f"{layer.num_batches_tracked_before} -> {layer.num_batches_tracked_after} "
            f"({how} {layer.batches_run} batches run)"
        )
    for epoch in report.epochs:
        val = "" if epoch.val_loss is None else f", val loss {epoch.val_loss:.4f}"
        lines.append(f"epoch {epoch.epoch:3}: train loss {epoch.train_loss:.4f}{val}")
    if report.tensors:
        changed = sum(t.changed for t in report.tensors)
        what = " (statistics only)" if report.kind == "adapt" else ""
        lines.append(f"tensors changed: {changed} of {len(report.tensors)}{what}")
    if report.batchnorm:
        consistent = all(layer.consistent for layer in report.batchnorm)
        lines.append(f"statistics consistent with the batches run: {'yes' if consistent else 'NO'}")
    lines.append(f"compute {report.timings.compute_s:.2f} s on {report.device}")
    steps = report.steps
    if steps is not None:
        how = f"compiled with {steps.backend}" if steps.compiled else "eager"
        graphs = f", {steps.graphs_compiled} graphs compiled" if steps.compiled else ""
        rate = (
            "no steady steps"
            if steps.steady_samples_per_s is None
            else f"then {steps.steady_samples_per_s:,.0f} samples/s"
        )
        lines.append(
            f"steps ({how}): {steps.warmup_steps} warm-up in {steps.warmup_s:.2f} s{graphs}, "
            f"{rate} over {steps.steady_steps} steps"
        )
    if report.world_size > 1:
        rates = [r.steady_samples_per_s for r in report.rank_steps]
        each = ", ".join("-" if r is None else f"{r:,.0f}" for r in rates)
        lines.append(
            f"{report.world_size} processes (ranks; the steps above are rank 0's), steady "
            f"samples/s by rank: {each}"
        )
    return lines + diagnostic_lines(report)
