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
# A time's milliseconds as ``%03d`` gives them, looked up rather than formatted per line
# (1000: a fraction a hair under 1 s may round up to it when multiplied).
MILLIS = tuple(f"{ms:03d}" for ms in range(1001))


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, with ``asctime``'s whole second formatted once per second (most
    lines of a busy daemon share it; strftime per line was a visible cost)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second: tuple[int, str] = (-1, "")  # one attribute: threads read it whole

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return self.asctime(record.created)

    def asctime(self, created: float) -> str:
        """``asctime`` of a record made at ``created``."""
        second = int(created)
        return self.second_text(created) + MILLIS[int((created - second) * 1000)]

    def second_text(self, created: float) -> str:
        """``asctime`` of a record made at ``created`` up to its milliseconds (``MILLIS``
        of ``int((created - int(created)) * 1000)`` completes it)."""
        second = int(created)
        cached, text = self._second
        if second != cached:
            text = time.strftime("%Y-%m-%d %H:%M:%S,", self.converter(created))
            self._second = (second, text)
        return text

    def line(self, created: float, name: str, msg: str, fields: dict[str, Any]) -> str:
        """What :meth:`format` gives for an INFO record of logger ``name`` made at
        ``created`` with message ``msg`` (no LogRecord needed)."""
        return f"{self.asctime(created)} INFO {name}: {msg}"


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second: tuple[int, str] = (-1, "")

    def _ts(self, created: float) -> str:
        second = int(created)
        cached, text = self._second
        if second != cached:
            text = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            self._second = (second, text)
        return f"{text}.{int((created - second) * 1000):03d}Z"

    def line(self, created: float, name: str, msg: str, fields: dict[str, Any]) -> str:
        """:meth:`format` of an INFO record carrying ``fields`` (see TextFormatter.line)."""
        out: dict[str, Any] = {"ts": self._ts(created), "level": "INFO", "logger": name,
                               "msg": msg}
        for key, value in fields.items():
            if key not in _STANDARD and not key.startswith("_") and key not in out:
                out[key] = value
        return _DUMPS(out)

    def plain_line(self, created: float, name: str, msg: str, fields: dict[str, Any]) -> str:
        """:meth:`line` for ``fields`` whose keys are all kept (none is a LogRecord's
        attribute, a line's head key, or starts with ``_``: the access log's)."""
        out: dict[str, Any] = {"ts": self._ts(created), "level": "INFO", "logger": name,
                               "msg": msg}
        out.update(fields)
        return _DUMPS(out)

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


_DUMPS = json.JSONEncoder(default=str, ensure_ascii=False).encode

_batch = threading.local()  # .pending: the lines of a batched_writes block, per handler


class _Handler(logging.StreamHandler):
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
    pending: dict[_Handler, list[str]] = {}
    _batch.pending = pending
    try:
        yield
    finally:
        _batch.pending = None
        for handler, lines in pending.items():
            handler.write_lines(lines)


def direct_handler(logger: logging.Logger) -> _Handler | None:
    """The handler ``logger``'s INFO lines reach, when it is the only one and ours with
    our formatter and nothing filters on the way (as :func:`setup_logging` leaves it):
    such lines can be formatted without a LogRecord (``formatter.line``) and written in
    a batch (:meth:`_Handler.write_lines`). None otherwise (a test's or an operator's own
    handlers, a filter): the caller then logs through ``logging``."""
    if not logger.isEnabledFor(logging.INFO):
        return None
    found: list[logging.Handler] = []
    node: logging.Logger | None = logger
    while node is not None:
        if node.filters:
            return None
        found += node.handlers
        if not node.propagate:
            break
        node = node.parent
    if len(found) != 1:
        return None
    (handler,) = found
    if not isinstance(handler, _Handler) or handler.filters or handler.level > logging.INFO \
            or not isinstance(handler.formatter, TextFormatter | JsonFormatter):
        return None
    return handler


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
