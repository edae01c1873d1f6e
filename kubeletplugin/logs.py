"""Structured JSON logs for the plugin process: one JSON object per line on stderr.

The plugin's own code logs through structlog with bound context (claim uid/namespace/name, pods); the core
packages log through the standard library, whose records go through the same renderer so the whole
process writes one format.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_SHARED: list[structlog.typing.Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def configure_logging(level: str = "info", stream: Any = None, json_output: bool = True) -> None:
    """Route structlog and stdlib logging to ``stream`` (stderr) as JSON lines (or readable text)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r}: use debug, info, warning or error")
    renderer: Any = structlog.processors.JSONRenderer(sort_keys=False) if json_output else \
        structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*_SHARED, structlog.processors.StackInfoRenderer(), structlog.processors.format_exc_info,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_SHARED,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # grpc and urllib3 are chatty at debug level and say nothing the plugin's own logs do not.
    for noisy in ("urllib3", "grpc"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))
