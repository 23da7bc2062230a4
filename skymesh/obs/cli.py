"""The observability flags both daemons take; each overrides its config key when given.

    --log-format text|json      logging.format
    --no-access-log             logging.access_log: false
    --otlp-endpoint URL         tracing.otlp_endpoint (turns tracing on)
"""

from __future__ import annotations

import argparse
from typing import Any


def add_obs_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--log-format", choices=["text", "json"],
                    help="log lines as text (default) or one JSON object each")
    ap.add_argument("--no-access-log", action="store_true",
                    help="no skymesh.access line per request")
    ap.add_argument("--otlp-endpoint", metavar="URL",
                    help="trace requests (OpenTelemetry) to this OTLP/HTTP collector, "
                         "e.g. http://127.0.0.1:4318/v1/traces")


def apply_obs_flags(args: argparse.Namespace, base: dict[str, Any]) -> None:
    """Write the given flags into the config mapping ``base`` (validated with the rest)."""
    if args.log_format:
        base.setdefault("logging", {})["format"] = args.log_format
    if args.no_access_log:
        base.setdefault("logging", {})["access_log"] = False
    if args.otlp_endpoint:
        base.setdefault("tracing", {})["otlp_endpoint"] = args.otlp_endpoint
