"""The ``bnadapt`` command.

Servers: ``up`` (everything on one machine), ``api``, ``worker``, ``demo`` (the README's main
job): servers.py. Operators, talking to Redis directly: ``keys create|list|revoke``, ``store
gc`` (operators.py), ``tenants`` (what each tenant may do: tenants.py). Clients of the API:
``architectures``, ``models``, ``datasets`` (catalog.py), ``jobs`` (jobs.py).

Each command is declared by a small function next to the handler that runs it; what several
declare alike (argument types, ``--redis-url``, ids, page sizes) is in options.py, and the
options every command shares (where the API and its data directory are) are declared once,
here, on the top-level parser.
"""

from __future__ import annotations

import argparse
import os
import sys

from service.client import ApiClientError
from service.errors import BnadaptError
from service.local.cli.catalog import declare_architectures, declare_datasets, declare_models
from service.local.cli.jobs import declare_jobs
from service.local.cli.operators import declare_keys, declare_store
from service.local.cli.servers import declare_api, declare_demo, declare_up, declare_worker
from service.local.cli.tenants import declare_tenants

__all__ = ["main"]

# Every command's, in the order `bnadapt --help` lists them.
_COMMANDS = (
    declare_up,
    declare_api,
    declare_worker,
    declare_keys,
    declare_tenants,
    declare_store,
    declare_architectures,
    declare_models,
    declare_datasets,
    declare_jobs,
    declare_demo,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bnadapt", description=__doc__.split("\n\n")[0])
    _shared_options(parser)
    commands = parser.add_subparsers(dest="command", required=True)
    for declare in _COMMANDS:
        declare(commands)
    return parser


def _shared_options(parser: argparse.ArgumentParser) -> None:
    """Given before the command (``bnadapt --url URL jobs list``): where ``up`` keeps its
    state, and the API the client commands talk to."""
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
