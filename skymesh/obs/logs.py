"""Log output for the daemons: ``text`` (the historic ``TIME LEVEL LOGGER: MESSAGE``) or
``json`` (one object per line, for log shippers).

A JSON line has ``ts`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``, ``msg``,
then every field a caller passed with ``extra={...}`` (the access log's fields come this
way), and ``exc`` with the traceback when there is one. Values JSON cannot hold are
written with ``str()``: a log call never fails because of a field.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any

from skymesh.obs.config import LogFormat

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_LOGGER = "skymesh.access"
# What every LogRecord carries by itself; anything else on a record came from ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_") and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class _Handler(logging.StreamHandler):
    """Ours, so a second :func:`setup_logging` replaces it rather than adding another."""


def formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


def setup_logging(level: str, fmt: LogFormat = "text", access_log: bool = True,
                  stream: IO[str] | None = None) -> logging.Handler:
    """Route the process's logs to ``stream`` (stderr) in ``fmt`` at ``level``.

    The access log has its own level: its lines are INFO, and they show at the default
    ``--log-level warning`` too unless ``access_log`` is off. Replaces handlers a previous
    call installed, so calling it again (tests, a second ``main``) does not double lines.
    """
    handler = _Handler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO if access_log else logging.WARNING)
    return handler
