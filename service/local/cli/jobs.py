"""The ``bnadapt jobs`` commands, through the API:
``submit|show|list|cancel|download|report|logs|delete``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from api_schemas import ESTIMATORS, JOB_KINDS, JobPublic, JobStatus
from api_schemas.jobs.public import JobLogEntry
from service.client import Client
from service.errors import BnadaptError
from service.local.cli.options import Commands, add_id_command, add_page_size
from service.local.cli_client import (
    api_client,
    json_arg,
    preprocessing_arg,
    print_value,
    tag_arg,
    wait_with_bar,
)
from service.local.summary import outcome_lines, report_summary

__all__ = ["declare_jobs"]


def declare_jobs(commands: Commands) -> None:
    jobs = commands.add_parser("jobs", help="jobs: submit, watch, list, report, logs, delete")
    subcommands = jobs.add_subparsers(dest="jobs", required=True)
    _declare_submit(subcommands)
    _declare_show(subcommands)
    _declare_list(subcommands)
    _declare_cancel(subcommands)
    _declare_download(subcommands)
    _declare_report(subcommands)
    _declare_logs(subcommands)
    _declare_delete(subcommands)


def _declare_submit(jobs: Commands) -> None:
    kinds = "; ".join(f"{kind}: {spec.summary}" for kind, spec in JOB_KINDS.items())
    submit = jobs.add_parser("submit", help=f"submit a job ({', '.join(JOB_KINDS)})")
    submit.add_argument("kind", choices=list(JOB_KINDS), help=kinds)
    submit.add_argument("--model", required=True, help="the input model's id")
    submit.add_argument("--dataset", required=True, help="the dataset's id")
    estimators = ", ".join(ESTIMATORS)
    submit.add_argument(
        "--params",
        type=json_arg,
        default={},
        help=f"the kind's params as a JSON object (adapt estimators: {estimators})",
    )
    submit.add_argument(
        "--preprocessing",
        type=preprocessing_arg,
        help="the job's preprocessing spec (a JSON object or file), or 'model': the model's "
        "own evaluation transform; sets params.preprocessing",
    )
    submit.add_argument(
        "--tag",
        type=tag_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a tag on the job; repeat for several",
    )
    submit.add_argument(
        "--priority",
        type=int,
        default=0,
        help="order among your own queued jobs, -10..10, higher first (default 0); other "
        "tenants' turns are not affected",
    )
    submit.add_argument(
        "--idempotency-key", help="repeating a submit with the same key returns the same job"
    )
    submit.add_argument(
        "--wait",
        action="store_true",
        help="show live progress until it ends (exit 1 unless it succeeded)",
    )
    submit.set_defaults(func=cmd_jobs_submit)


def cmd_jobs_submit(args: argparse.Namespace) -> int:
    client = api_client(args)
    params = dict(args.params)
    if args.preprocessing is not None:
        params["preprocessing"] = args.preprocessing
    job = client.submit(
        args.kind,
        args.model,
        args.dataset,
        params,
        args.idempotency_key,
        dict(args.tag),
        args.priority,
    )
    if not args.wait:
        print_value(job)
        return 0
    job = wait_with_bar(client, job.id)
    print_value(job)
    _print_outcome(client, job)
    return 0 if job.status is JobStatus.SUCCEEDED else 1


def _print_outcome(client: Client, job: JobPublic) -> None:
    """Under a succeeded adapt or evaluate job, its report's outcome lines on stderr (stdout
    stays JSON): :func:`service.local.summary.outcome_lines`."""
    if job.kind not in ("adapt", "evaluate") or job.status is not JobStatus.SUCCEEDED:
        return  # the other jobs print nothing: their report is not fetched
    for line in outcome_lines(job, client.report(job.id)):
        print(line, file=sys.stderr)


def _declare_show(jobs: Commands) -> None:
    add_id_command(jobs, "show", "job", "a job as JSON", cmd_jobs_show)


def cmd_jobs_show(args: argparse.Namespace) -> int:
    client = api_client(args)
    job = client.job(args.job_id)
    print_value(job)
    _print_outcome(client, job)
    return 0


def _declare_list(jobs: Commands) -> None:
    listing = jobs.add_parser("list", help="your jobs, newest first; filters combine")
    listing.add_argument(
        "--status", choices=[s.value for s in JobStatus], help="only jobs with this status"
    )
    listing.add_argument("--kind", choices=list(JOB_KINDS), help="only jobs of this kind")
    listing.add_argument("--model", help="only jobs on this model id")
    listing.add_argument("--dataset", help="only jobs on this dataset id")
    listing.add_argument(
        "--tag",
        type=tag_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only jobs with this tag; repeat for several",
    )
    add_page_size(listing)
    listing.set_defaults(func=cmd_jobs_list)


def cmd_jobs_list(args: argparse.Namespace) -> int:
    page = api_client(args).jobs(
        page_size=args.page_size,
        status=args.status,
        kind=args.kind,
        model_id=args.model,
        dataset_id=args.dataset,
        tags=dict(args.tag),
    )
    for job in page.items:
        tags = " ".join(f"{k}={v}" for k, v in job.tags.items())
        print(f"{job.id}  {job.kind:8} {job.status.value:9} model={job.model_id} {tags}".rstrip())
    return 0


def _declare_cancel(jobs: Commands) -> None:
    add_id_command(jobs, "cancel", "job", "cancel a queued or running job", cmd_jobs_cancel)


def cmd_jobs_cancel(args: argparse.Namespace) -> int:
    print_value(api_client(args).cancel(args.job_id))
    return 0


def _declare_download(jobs: Commands) -> None:
    download = add_id_command(
        jobs,
        "download",
        "job",
        "the new weights and the report (evaluate jobs: the report)",
        cmd_jobs_download,
    )
    download.add_argument("--out", default=".", help="directory to write into (default: .)")


def cmd_jobs_download(args: argparse.Namespace) -> int:
    """The new weights and the report; an evaluate job has the report only."""
    client = api_client(args)
    job = client.job(args.job_id)
    if job.result is None:
        raise BnadaptError(f"job {job.id} is {job.status.value}: nothing to download yet")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if job.result.model_id is None:
        print(f"job {job.id} ({job.kind}) registered no model: the report only", file=sys.stderr)
    else:
        model_id = job.result.model_id
        print(client.download_weights(model_id, out / f"{model_id}.safetensors"))
    report = out / f"{job.id}.report.json"
    report.write_text(client.report(job.id).model_dump_json(indent=2))
    print(report)
    return 0


def _declare_report(jobs: Commands) -> None:
    report = add_id_command(
        jobs, "report", "job", "a succeeded job's report as a summary table", cmd_jobs_report
    )
    report.add_argument("--json", action="store_true", help="the whole report as JSON instead")


def cmd_jobs_report(args: argparse.Namespace) -> int:
    report = api_client(args).report(args.job_id)
    if args.json:
        print_value(report)
    else:
        print("\n".join(report_summary(report)))
    return 0


def _declare_logs(jobs: Commands) -> None:
    logs = add_id_command(
        jobs, "logs", "job", "what the job's process logged (warnings, tracebacks)", cmd_jobs_logs
    )
    logs.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new lines until the job ends"
    )


def _log_line(entry: JobLogEntry) -> str:
    part = f"[{entry.part}] " if entry.part else ""  # a part of a sharded job
    return f"{entry.at:%H:%M:%S} {entry.level:7} {part}{entry.message}"


def cmd_jobs_logs(args: argparse.Namespace) -> int:
    client = api_client(args)
    page = client.logs(args.job_id)
    for entry in page.items:
        print(_log_line(entry), flush=True)
    if args.follow:
        for entry in client.follow_logs(args.job_id, after=page.last_seq):
            print(_log_line(entry), flush=True)
    return 0


def _declare_delete(jobs: Commands) -> None:
    add_id_command(
        jobs, "delete", "job", "delete an ended job, its logs and report", cmd_jobs_delete
    )


def cmd_jobs_delete(args: argparse.Namespace) -> int:
    api_client(args).delete_job(args.job_id)
    print(f"deleted job {args.job_id}", file=sys.stderr)
    return 0
