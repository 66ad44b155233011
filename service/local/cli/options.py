"""What several ``bnadapt`` commands declare alike: argument types and options."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeAlias

__all__ = [
    "Commands",
    "add_id",
    "add_id_command",
    "add_list_command",
    "add_page_size",
    "add_redis_url",
    "positive_int",
    "seconds",
]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from exc
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text}")
    return value


def add_redis_url(parser: argparse.ArgumentParser) -> None:
    """The operators' commands talk to Redis directly."""
    parser.add_argument("--redis-url", help="default: BNADAPT_REDIS_URL")


def add_id(parser: argparse.ArgumentParser, name: str, what: str) -> None:
    parser.add_argument(name, help=f"the {what}'s id (as listed by `bnadapt {what}s list`)")


def add_page_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--page-size", type=positive_int, default=50, help="how many to list (default: 50)"
    )


# What `add_subparsers` returns: each module's `declare_*` adds its commands to one.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_id_command(
    commands: Commands, name: str, what: str, summary: str, handler: Callable[..., int]
) -> argparse.ArgumentParser:
    """The command ``name`` on one ``what`` (a model, a dataset, a job) given by its id,
    run by ``handler``; the caller adds any further options to the parser returned."""
    command = commands.add_parser(name, help=summary)
    add_id(command, f"{what}_id", what)
    command.set_defaults(func=handler)
    return command


def add_list_command(
    commands: Commands, summary: str, handler: Callable[..., int]
) -> argparse.ArgumentParser:
    """The ``list`` command of a resource, one page of ``--page-size``, run by ``handler``."""
    command = commands.add_parser("list", help=summary)
    add_page_size(command)
    command.set_defaults(func=handler)
    return command
