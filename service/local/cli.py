"""The ``bnadapt`` command.

Servers: ``up`` (everything on one machine), ``api``, ``worker``, ``keys create|list|revoke``,
``store gc``. Client: ``architectures``, ``models add|list|download|delete``, ``datasets
add|list|delete``, ``jobs submit|show|list|cancel|download|report|logs|delete``
(service/local/cli_client.py). ``demo`` runs the README's main
job.
Operators: ``tenants`` (what each tenant may do, kept in Redis):
``allow-import|list-imports|revoke-import``.

About 400 lines on purpose: the whole command-line grammar in one place (what each command
does lives in service/local/cli_client.py and service/local/up.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from api_schemas import ESTIMATORS, JOB_KINDS, JobStatus
from service.client import ApiClientError
from service.errors import BnadaptError
from service.local.cli_client import (
    cmd_architectures,
    cmd_datasets_add,
    cmd_datasets_delete,
    cmd_datasets_list,
    cmd_jobs_cancel,
    cmd_jobs_delete,
    cmd_jobs_download,
    cmd_jobs_list,
    cmd_jobs_logs,
    cmd_jobs_report,
    cmd_jobs_show,
    cmd_jobs_submit,
    cmd_models_add,
    cmd_models_delete,
    cmd_models_download,
    cmd_models_list,
    json_arg,
    preprocessing_arg,
    print_value,
    tag_arg,
)
from service.local.up import (
    API_HOST_ENV,
    DEFAULT_API_PROCESSES,
    WORKER_THREADS_ENV,
    LocalStack,
    fresh_metrics_dir,
    worker_command,
)
from service.records.tenancy.turns import MAX_WEIGHT
from service.settings import get_settings

if TYPE_CHECKING:
    from service.records.sync import Records

__all__ = ["main"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {value}")
    return value


def cmd_up(args: argparse.Namespace) -> int:
    with LocalStack(
        Path(args.data_dir),
        args.host,
        args.port,
        args.device,
        args.api_processes,
        uploads_nice=args.uploads_nice,
        advertise_host=args.advertise_host,
    ) as stack:
        assert stack.client_config is not None
        print(f"bnadapt is up at {stack.url} (API docs: {stack.url}/docs)")
        print(f"data directory: {stack.data_dir}")
        print(f"API key: {stack.client_config.key}")
        print(f"  (saved in {stack.data_dir / 'client.json'}: the CLI here needs no flags)")
        print("Ctrl-C stops everything.", flush=True)
        stopping = False

        def on_signal(signum: int, frame: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        while not stopping:
            stack.check_alive()
            time.sleep(0.5)
        print("stopping...", flush=True)
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    if args.workers > 1 and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        # The processes' request metrics, summed at a scrape (service/api/metrics.py).
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(
            fresh_metrics_dir(get_settings().data_dir.resolve())
        )
    # Where it listens, for what only an API on loopback answers (NOTE [ Cheap scrapes ]).
    os.environ[API_HOST_ENV] = args.host
    uvicorn.run(
        "service.api.app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
    )
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    # A separate interpreter: the service never imports the workers' torch code itself.
    if args.threads is not None:
        os.environ[WORKER_THREADS_ENV] = str(args.threads)
    os.execv(sys.executable, worker_command(args.device))  # noqa: S606 - our own argv


def cmd_keys_create(args: argparse.Namespace) -> int:
    from service.records.connection import redis_client
    from service.records.sync import Records

    url = args.redis_url or get_settings().redis_url
    key = Records(redis_client(url)).create_api_key(args.tenant)
    print(key.key)
    print(f"(tenant {key.tenant_id}; shown once, only its hash is stored)", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from service.records.connection import redis_client
    from service.records.sync import Records

    url = args.redis_url or get_settings().redis_url
    for key in Records(redis_client(url)).list_api_keys():
        print(f"{key['key_id']}  {key['tenant_id']}  {key['tenant']:16} {key['created_at']}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from service.records.connection import redis_client
    from service.records.sync import Records

    url = args.redis_url or get_settings().redis_url
    if not Records(redis_client(url)).revoke_api_key(args.key):
        raise BnadaptError(f"no API key {args.key!r}; list them with `bnadapt keys list`")
    print(f"revoked {args.key}", file=sys.stderr)
    return 0


def cmd_tenants_set_quota(args: argparse.Namespace) -> int:
    from service.records.tenancy.quotas import parse_quota_value

    try:
        value = parse_quota_value(args.name, args.value)
    except ValueError as exc:
        raise BnadaptError(str(exc)) from None
    records, tenant_id = _tenant_records(args)
    records.set_quota(tenant_id, args.name, value)
    shown = "the setting's value" if value is None else f"{value:g}"
    print(f"tenant {tenant_id}: {args.name} is {shown}", file=sys.stderr)
    return 0


def cmd_tenants_quotas(args: argparse.Namespace) -> int:
    from service.records.tenancy.quotas import QUOTAS

    records, tenant_id = _tenant_records(args)
    own = records.quota_overrides(tenant_id)
    effective = records.effective_quotas(tenant_id, get_settings())
    used = records.quota_usage(tenant_id)
    print(f"{'quota':18} {'value':>14} {'in use':>14}  from")
    for name, quota in QUOTAS.items():
        value = "no limit" if effective[name] == 0 else f"{effective[name]:g}"
        origin = "tenant" if name in own else quota.setting
        in_use = f"{used[name]:g}" if name in used else "-"
        print(f"{name:18} {value:>14} {in_use:>14}  {origin}")
    return 0


def _tenant_records(args: argparse.Namespace) -> tuple[Records, str]:
    """The records over ``--redis-url`` and the id of the tenant ``args.tenant`` names (its
    name, as given to `keys create --tenant`, or its id); ``BnadaptError`` if there is none."""
    from service.records import keys
    from service.records.connection import redis_client
    from service.records.format import text
    from service.records.sync import Records

    records = Records(redis_client(args.redis_url or get_settings().redis_url))
    found = records.client.get(keys.tenant_by_name(args.tenant))
    if found is not None:
        return records, text(found)
    if records.client.exists(keys.tenant(args.tenant)):
        return records, str(args.tenant)
    raise BnadaptError(
        f"no tenant named {args.tenant!r}; a tenant is made with its first key: "
        f"`bnadapt keys create --tenant {args.tenant}`"
    )


def _source_prefix(text: str) -> str:
    from service.records.tenancy.import_sources import normalize_prefix

    try:
        bucket, prefix = normalize_prefix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return f"s3://{bucket}/{prefix}"


def cmd_tenants_allow_import(args: argparse.Namespace) -> int:
    from service.records.tenancy.import_sources import normalize_prefix

    records, tenant_id = _tenant_records(args)
    store_url = get_settings().store_url
    if store_url is not None and store_url.startswith("s3://"):
        store_bucket, store_prefix = normalize_prefix(store_url)
        bucket, prefix = normalize_prefix(args.prefix)
        if bucket == store_bucket and prefix.startswith(store_prefix):
            raise BnadaptError(
                f"{args.prefix} is inside the store ({store_url}), which is never a source: "
                "every tenant's datasets and weights are there"
            )
    try:
        source = records.allow_import(tenant_id, args.prefix)
    except ValueError as exc:
        raise BnadaptError(str(exc)) from exc
    print(f"tenant {args.tenant} may import from {source}", file=sys.stderr)
    return 0


def cmd_tenants_list_imports(args: argparse.Namespace) -> int:
    records, tenant_id = _tenant_records(args)
    for source in records.import_sources(tenant_id):
        print(source)
    return 0


def cmd_tenants_revoke_import(args: argparse.Namespace) -> int:
    records, tenant_id = _tenant_records(args)
    if not records.revoke_import(tenant_id, args.prefix):
        raise BnadaptError(
            f"tenant {args.tenant} has no import source {args.prefix}; list them with "
            f"`bnadapt tenants list-imports {args.tenant}`"
        )
    print(f"tenant {args.tenant} may no longer import from {args.prefix}", file=sys.stderr)
    return 0


def cmd_tenants_set_weight(args: argparse.Namespace) -> int:
    from service.records import keys
    from service.records.connection import redis_client
    from service.records.format import text
    from service.records.tenancy.turns import Turns

    client = redis_client(args.redis_url or get_settings().redis_url)
    tenant_id = client.get(keys.tenant_by_name(args.tenant))
    if tenant_id is None:
        raise BnadaptError(
            f"no tenant named {args.tenant!r}; a tenant is made with its first key "
            "(`bnadapt keys create --tenant NAME`), and `bnadapt keys list` shows them"
        )
    try:
        Turns(client).set_weight(text(tenant_id), args.weight)
    except ValueError as exc:
        raise BnadaptError(str(exc)) from exc
    print(f"tenant {args.tenant} ({text(tenant_id)}): weight {args.weight:g}", file=sys.stderr)
    return 0


def cmd_tenants_weights(args: argparse.Namespace) -> int:
    from service.records import keys
    from service.records.connection import redis_client
    from service.records.format import text
    from service.records.tenancy.turns import Turns

    client = redis_client(args.redis_url or get_settings().redis_url)
    for tenant_id, weight in sorted(Turns(client).weights().items()):
        name = client.hget(keys.tenant(tenant_id), "name")
        print(f"{tenant_id}  {'' if name is None else text(name):16} {weight:g}")
    return 0


def cmd_store_gc(args: argparse.Namespace) -> int:
    from service.records import keys
    from service.records.connection import redis_client
    from service.store import open_store
    from service.store.gc import collect_now

    settings = get_settings()
    if args.store_dir:
        settings = settings.model_copy(update={"store_dir": Path(args.store_dir)})
    store = open_store(settings)
    grace_s = settings.store_gc_grace_s if args.grace_s is None else args.grace_s
    client = redis_client(args.redis_url or settings.redis_url)
    done = collect_now(client, store, grace_s)
    if done is None:
        left_s = max(int(client.pttl(keys.STORE_GC_LOCK)), 0) / 1000
        print(
            f"another store collection is running (its lock ends within {left_s:.0f} s unless "
            "it renews it); try again then",
            file=sys.stderr,
        )
        return 1
    print_value(dataclasses.asdict(done))
    return 0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from exc
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text}")
    return value


def cmd_demo(args: argparse.Namespace) -> int:
    from service.local.demo import run_demo

    return run_demo(Path(args.data_dir), args.port)


def _id(parser: argparse.ArgumentParser, name: str, what: str) -> None:
    parser.add_argument(name, help=f"the {what}'s id (as listed by `bnadapt {what}s list`)")


def _page_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--page-size", type=_positive_int, default=50, help="how many to list (default: 50)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bnadapt", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("BNADAPT_DATA_DIR", "data"),
        help="where `up` keeps its state (default: ./data)",
    )
    parser.add_argument(
        "--url", help="API URL (default: BNADAPT_URL, or the data directory's client.json)"
    )
    parser.add_argument(
        "--key", help="API key (default: BNADAPT_API_KEY, or the data directory's client.json)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Redis, the API and a worker on this machine")
    up.add_argument("--host", default="127.0.0.1", help="address the API listens on")
    up.add_argument("--port", type=int, default=8000, help="port the API listens on")
    up.add_argument(
        "--advertise-host",
        default=None,
        help="the name or address clients reach this machine by, given to them in client.json "
        "and as uploads' transfer_url (default: --host, or this machine's name when --host is "
        "a wildcard such as 0.0.0.0)",
    )
    up.add_argument("--device", default="auto", help="the worker's device: auto, cpu or cuda:N")
    up.add_argument(
        "--api-processes",
        type=_positive_int,
        default=DEFAULT_API_PROCESSES,
        help="uvicorn worker processes of the API",
    )
    up.add_argument(
        "--uploads-nice",
        type=int,
        choices=range(20),
        metavar="0..19",
        default=None,
        help="run an API process of its own for the bytes of uploads, at this lower priority "
        "(a nice value, e.g. 19): other requests then keep their pace during large uploads",
    )
    up.set_defaults(func=cmd_up)

    api = sub.add_parser("api", help="run the API (settings from BNADAPT_* variables)")
    api.add_argument("--host", default="127.0.0.1", help="address to listen on")
    api.add_argument("--port", type=int, default=8000, help="port to listen on")
    api.add_argument(
        "--workers",
        type=_positive_int,
        default=DEFAULT_API_PROCESSES,
        help="uvicorn worker processes",
    )
    api.set_defaults(func=cmd_api)

    worker = sub.add_parser("worker", help="run a worker (RQ worker + inspector)")
    worker.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda (every GPU), cuda:N, or GPUs as cuda:0,cuda:1",
    )
    worker.add_argument(
        "--threads", type=_positive_int, help="torch threads per job (BNADAPT_WORKER_THREADS)"
    )
    worker.set_defaults(func=cmd_worker)

    keys = sub.add_parser("keys", help="API keys (talks to Redis directly)").add_subparsers(
        dest="keys", required=True
    )
    create = keys.add_parser("create", help="create an API key for a tenant")
    create.add_argument("--tenant", required=True, help="the tenant's name (made on first use)")
    create.add_argument("--redis-url", help="default: BNADAPT_REDIS_URL")
    create.set_defaults(func=cmd_keys_create)
    klist = keys.add_parser("list", help="list the keys: id, tenant, creation (never secrets)")
    klist.add_argument("--redis-url", help="default: BNADAPT_REDIS_URL")
    klist.set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser("revoke", help="delete a key: requests with it get 401")
    revoke.add_argument("key", help="the key's id (from `keys list`) or the whole key")
    revoke.add_argument("--redis-url", help="default: BNADAPT_REDIS_URL")
    revoke.set_defaults(func=cmd_keys_revoke)

    tenants = sub.add_parser(
        "tenants", help="what each tenant may do (talks to Redis directly)"
    ).add_subparsers(dest="tenants", required=True)

    def tenant_command(name: str, summary: str) -> argparse.ArgumentParser:
        command = tenants.add_parser(name, help=summary)
        command.add_argument("tenant", help="the tenant's name (as in `keys create`) or id")
        command.add_argument("--redis-url", help="default: BNADAPT_REDIS_URL")
        return command

    source_help = "s3://BUCKET/PREFIX/ (a folder; s3://BUCKET/ for the whole bucket)"
    allow = tenant_command(
        "allow-import", "let the tenant import datasets from everything under an S3 prefix"
    )
    allow.add_argument("prefix", type=_source_prefix, help=source_help)
    allow.set_defaults(func=cmd_tenants_allow_import)
    tenant_command("list-imports", "the S3 prefixes the tenant may import from").set_defaults(
        func=cmd_tenants_list_imports
    )
    revoke_import = tenant_command("revoke-import", "take back an S3 prefix from the tenant")
    revoke_import.add_argument("prefix", type=_source_prefix, help=source_help)
    revoke_import.set_defaults(func=cmd_tenants_revoke_import)

    # Quotas per tenant (NOTE [ Tenant quotas ] in service/records/tenancy/quotas.py).
    set_quota = tenant_command("set-quota", "give a tenant its own value of a quota (0: no limit)")
    set_quota.add_argument(
        "name",
        help="max_active_jobs, max_stored_bytes, max_open_uploads, max_streams, rate_per_s or "
        "rate_burst",
    )
    set_quota.add_argument("value", help="a number (0: no limit), or 'default': the setting's")
    set_quota.set_defaults(func=cmd_tenants_set_quota)
    tenant_command("quotas", "a tenant's quotas in effect, and its use").set_defaults(
        func=cmd_tenants_quotas
    )

    weight = tenant_command(
        "set-weight",
        "how many turns the tenant's queued jobs get for each one of a tenant of weight 1 "
        "(default 1; docs/service.md, Fair turns)",
    )
    weight.add_argument("weight", type=float, help=f"in (0, {MAX_WEIGHT:g}]; 1 resets it")
    weight.set_defaults(func=cmd_tenants_set_weight)
    weights = tenants.add_parser("weights", help="the tenants whose weight is not 1")
    weights.add_argument("--redis-url", help="default: BNADAPT_REDIS_URL")
    weights.set_defaults(func=cmd_tenants_weights)

    store = sub.add_parser("store", help="the artifact store").add_subparsers(
        dest="store", required=True
    )
    gc = store.add_parser(
        "gc", help="delete store objects nothing uses (also runs on its own, periodically)"
    )
    gc.add_argument("--redis-url", help="default: BNADAPT_REDIS_URL")
    gc.add_argument("--store-dir", help="default: BNADAPT_STORE_DIR or <BNADAPT_DATA_DIR>/store")
    gc.add_argument(
        "--grace-s",
        type=_seconds,
        help="keep objects written or last used within this many seconds (default: "
        "BNADAPT_STORE_GC_GRACE_S, an hour); less is safe only while no API or worker runs",
    )
    gc.set_defaults(func=cmd_store_gc)

    arches = sub.add_parser(
        "architectures",
        help="list what can be registered: families with counts (the zoo has over a thousand)",
    )
    arches.add_argument(
        "pattern",
        nargs="?",
        help="list the architectures whose name matches this fnmatch pattern or contains it "
        "(e.g. 'timm.resnet*', 'convnext'), one a line with kwargs and input shape",
    )
    arches.add_argument("--all", action="store_true", help="list every architecture, one a line")
    arches.set_defaults(func=cmd_architectures)

    models = sub.add_parser("models", help="models: register, list, download, delete")
    mcmds = models.add_subparsers(dest="models", required=True)
    add = mcmds.add_parser("add", help="register a model")
    add.add_argument("architecture", help="a name from `bnadapt architectures`")
    add.add_argument(
        "--kwargs", type=json_arg, default={}, help="the architecture's kwargs, a JSON object"
    )
    add.add_argument(
        "--weights",
        help="a .safetensors file, or a .pth/.pt state_dict (or checkpoint wrapping one) that "
        "is converted to safetensors here with torch (else: initialised with --seed)",
    )
    add.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    add.set_defaults(func=cmd_models_add)
    listing = mcmds.add_parser("list", help="your models, newest first")
    _page_size(listing)
    listing.set_defaults(func=cmd_models_list)
    mdown = mcmds.add_parser("download", help="a model's weights as .safetensors")
    _id(mdown, "model_id", "model")
    mdown.add_argument("--out", help="file to write (default: <model id>.safetensors)")
    mdown.set_defaults(func=cmd_models_download)
    mdel = mcmds.add_parser("delete", help="delete a model (jobs that used it keep working)")
    _id(mdel, "model_id", "model")
    mdel.set_defaults(func=cmd_models_delete)

    datasets = sub.add_parser("datasets", help="datasets: upload, list, delete")
    dcmds = datasets.add_subparsers(dest="datasets", required=True)
    dadd = dcmds.add_parser(
        "add", help="upload an .npz, .safetensors or image .tar file, or a folder of images"
    )
    dadd.add_argument(
        "file",
        help="the file to upload, or a folder of images (class subfolders are labels, "
        "numbered as torchvision's ImageFolder numbers them; a flat folder is unlabelled)",
    )
    dadd.add_argument(
        "--preprocessing",
        type=preprocessing_arg,
        help='how images become inputs: a JSON object (\'{"resize_shorter": 256, '
        '"center_crop": [224, 224], "interpolation": "bicubic"}\') or a JSON file',
    )
    dadd.add_argument("--name", help="a name to show (default: the file's)")
    dadd.add_argument(
        "--resume",
        metavar="UPLOAD_ID",
        help="continue an interrupted upload (its id is printed when it starts)",
    )
    dadd.set_defaults(func=cmd_datasets_add)
    dlist = dcmds.add_parser("list", help="your datasets, newest first")
    _page_size(dlist)
    dlist.set_defaults(func=cmd_datasets_list)
    ddel = dcmds.add_parser("delete", help="delete a dataset")
    _id(ddel, "dataset_id", "dataset")
    ddel.set_defaults(func=cmd_datasets_delete)

    jobs = sub.add_parser("jobs", help="jobs: submit, watch, list, report, logs, delete")
    jcmds = jobs.add_subparsers(dest="jobs", required=True)
    kinds = "; ".join(f"{kind}: {spec.summary}" for kind, spec in JOB_KINDS.items())
    submit = jcmds.add_parser("submit", help=f"submit a job ({', '.join(JOB_KINDS)})")
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
    show = jcmds.add_parser("show", help="a job as JSON")
    _id(show, "job_id", "job")
    show.set_defaults(func=cmd_jobs_show)
    jlist = jcmds.add_parser("list", help="your jobs, newest first; filters combine")
    jlist.add_argument(
        "--status", choices=[s.value for s in JobStatus], help="only jobs with this status"
    )
    jlist.add_argument("--kind", choices=list(JOB_KINDS), help="only jobs of this kind")
    jlist.add_argument("--model", help="only jobs on this model id")
    jlist.add_argument("--dataset", help="only jobs on this dataset id")
    jlist.add_argument(
        "--tag",
        type=tag_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only jobs with this tag; repeat for several",
    )
    _page_size(jlist)
    jlist.set_defaults(func=cmd_jobs_list)
    cancel = jcmds.add_parser("cancel", help="cancel a queued or running job")
    _id(cancel, "job_id", "job")
    cancel.set_defaults(func=cmd_jobs_cancel)
    download = jcmds.add_parser(
        "download", help="the new weights and the report (evaluate jobs: the report)"
    )
    _id(download, "job_id", "job")
    download.add_argument("--out", default=".", help="directory to write into (default: .)")
    download.set_defaults(func=cmd_jobs_download)
    report = jcmds.add_parser("report", help="a succeeded job's report as a summary table")
    _id(report, "job_id", "job")
    report.add_argument("--json", action="store_true", help="the whole report as JSON instead")
    report.set_defaults(func=cmd_jobs_report)
    logs = jcmds.add_parser("logs", help="what the job's process logged (warnings, tracebacks)")
    _id(logs, "job_id", "job")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new lines until the job ends"
    )
    logs.set_defaults(func=cmd_jobs_logs)
    jdel = jcmds.add_parser("delete", help="delete an ended job, its logs and report")
    _id(jdel, "job_id", "job")
    jdel.set_defaults(func=cmd_jobs_delete)

    demo = sub.add_parser("demo", help="the README's main job, end to end")
    demo.add_argument("--port", type=int, default=8000, help="port the demo's API listens on")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # `bnadapt jobs show ID | head`: the reader left. Python would print a traceback at
        # exit while flushing stdout; point stdout at /dev/null so that it does not.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # what a shell reports for SIGPIPE
    except ApiClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BnadaptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
