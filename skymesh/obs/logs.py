"""Log output for the daemons: ``text`` (the historic ``TIME LEVEL LOGGER: MESSAGE``) or
``json`` (one object per line, for log shippers).

A JSON line has ``ts`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``, ``msg``,
then every field a caller passed with ``extra={...}`` (the access log's fields come this
way), and ``exc`` with the traceback when there is one. Values JSON cannot hold are
written with ``str()``: a log call never fails because of a field.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO, Any

from skymesh.obs.config import LogFormat

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_LOGGER = "skymesh.access"
# What every LogRecord carries by itself; anything else on a record came from ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}


class _SecondCache:
    """The text of the last whole second a formatter printed: most lines of a busy daemon
    share it, and strftime per line was a visible part of the access log's cost."""

    __slots__ = ("second", "text")

    def __init__(self) -> None:
        self.second = -1
        self.text = ""


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, with ``asctime`` built once per second."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._cache = _SecondCache()

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second = int(record.created)
        c = self._cache
        if second != c.second:  # two threads may both refresh it: same text
            c.text, c.second = time.strftime("%Y-%m-%d %H:%M:%S",
                                             self.converter(record.created)), second
        return f"{c.text},{int(record.msecs):03d}"


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._cache = _SecondCache()

    def _ts(self, created: float) -> str:
        second = int(created)
        c = self._cache
        if second != c.second:
            c.text, c.second = datetime.fromtimestamp(second, UTC).strftime(
                "%Y-%m-%dT%H:%M:%S"), second
        return f"{c.text}.{int((created - second) * 1000):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self._ts(record.created),
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


_batch = threading.local()  # .pending: the lines of a batched_writes block, per handler


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Ours, so a second :func:`setup_logging` replaces it rather than adding another;
    inside :func:`batched_writes` it keeps its lines for one write at the block's end."""

    def emit(self, record: logging.LogRecord) -> None:
        pending: dict[_Handler, list[str]] | None = getattr(_batch, "pending", None)
        if pending is None:
            super().emit(record)
            return
        try:
            pending.setdefault(self, []).append(self.format(record) + self.terminator)
        except Exception:
            self.handleError(record)

    def write_lines(self, lines: list[str]) -> None:
        with self.lock or contextlib.nullcontext():
            try:
                self.stream.write("".join(lines))
                self.flush()
            except Exception:
                self.handleError(logging.makeLogRecord({"msg": "(batched log lines)"}))


@contextlib.contextmanager
def batched_writes() -> Iterator[None]:
    """Lines our handler formats in this thread inside the block are written when it
    ends, in one write (a line-buffered stderr makes one system call per write, not per
    line). The access log's writer thread runs each batch inside one."""
    _batch.pending = pending = {}
    try:
        yield
    finally:
        _batch.pending = None
        for handler, lines in pending.items():
            handler.write_lines(lines)


def formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


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
