"""Options every long-running command spells the same way: ``--log-level``.

One spelling across commands: lower-case levels (``debug``, ``info``, ``warning``, ``error``), any case accepted
(the chart passes ``INFO``), ``warn`` an alias of ``warning``. The value is kept lower-case; ``logging`` takes
``args.log_level.upper()``.
"""
from __future__ import annotations

import argparse
import os

LOG_LEVELS = ("debug", "info", "warning", "error")
_ALIASES = {"warn": "warning"}


def log_level(text: str) -> str:
    """An argparse type: the level in lower case, aliases resolved; an unknown level names the valid ones."""
    level = _ALIASES.get(text.strip().lower(), text.strip().lower())
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r}: use one of {', '.join(LOG_LEVELS)} (any case)")
    return level


def add_log_level(parser: argparse.ArgumentParser, default: str = "info", env: str | None = None) -> None:
    """``--log-level LEVEL``; with ``env``, that environment variable gives the default."""
    initial = (os.environ.get(env) or default) if env else default
    where = f" [env {env}]" if env else ""
    # A string default goes through `type` too: a bad LOG_LEVEL is refused like a bad flag, naming the levels.
    parser.add_argument("--log-level", default=initial, type=log_level, metavar="LEVEL",
                        help=f"{', '.join(LOG_LEVELS)} (any case; default {log_level(default)}){where}")
