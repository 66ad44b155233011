"""A job's report as lines of text: what `bnadapt demo` and `bnadapt jobs report` print."""

from __future__ import annotations

from api_schemas.reports import Metrics, Report

__all__ = ["report_summary"]


def _metrics_line(when: str, metrics: Metrics | None) -> str | None:
    if metrics is None:
        return None
    score = (
        f"accuracy {metrics.accuracy:.4f}" if metrics.accuracy is not None else f"mse {metrics.mse}"
    )
    return f"{when:7} {score}, loss {metrics.loss:.4f} ({metrics.num_samples} samples)"


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
    return lines + report.summary_lines()  # prediction diagnostics, auto's candidates
