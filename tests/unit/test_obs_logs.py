"""Log output (skymesh.obs.logs), the obs config sections and flags (skymesh.obs.config,
skymesh.obs.cli) as the controller's command line applies them."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from skymesh.obs.logs import ACCESS_LOGGER, setup_logging
from skymesh_controller.cli import build_parser, config_from_args
from skymesh_controller.config import ConfigError, parse_config


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root, access = logging.getLogger(), logging.getLogger(ACCESS_LOGGER)
    handlers, level, access_level = list(root.handlers), root.level, access.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    access.setLevel(access_level)


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


@pytest.mark.usefixtures("restore_logging")
def test_json_lines_carry_ts_level_logger_msg_and_the_extra_fields() -> None:
    out = io.StringIO()
    setup_logging("warning", "json", stream=out)

    class Opaque:
        def __str__(self) -> str:
            return "opaque!"

    logging.getLogger("skymesh.test").warning("%d replicas down", 2,
                                              extra={"region": "us", "thing": Opaque()})
    try:
        raise ValueError("bad value")
    except ValueError:
        logging.getLogger("skymesh.test").exception("it failed")
    first, second = (json.loads(line) for line in lines(out))
    assert set(first) == {"ts", "level", "logger", "msg", "region", "thing"}
    assert first["level"] == "WARNING" and first["logger"] == "skymesh.test"
    assert first["msg"] == "2 replicas down" and first["region"] == "us"
    assert first["thing"] == "opaque!"  # what JSON cannot hold is written with str()
    ts = datetime.fromisoformat(first["ts"].replace("Z", "+00:00"))
    assert ts.tzinfo == UTC and abs((datetime.now(UTC) - ts).total_seconds()) < 3600
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    assert second["level"] == "ERROR" and "ValueError: bad value" in second["exc"]


@pytest.mark.usefixtures("restore_logging")
def test_text_is_the_historic_line_and_a_second_setup_replaces_the_first() -> None:
    first, out = io.StringIO(), io.StringIO()
    setup_logging("info", "text", stream=first)
    setup_logging("info", "text", stream=out)  # a second main() in one process
    logging.getLogger("skymesh.test").info("hello %s", "there")
    assert first.getvalue() == ""
    (line,) = lines(out)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO skymesh.test: hello there",
                        line)


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize(("access_log", "shown"), [(True, 1), (False, 0)])
def test_access_lines_show_at_the_default_level_unless_turned_off(access_log: bool,
                                                                   shown: int) -> None:
    out = io.StringIO()
    setup_logging("warning", "text", access_log=access_log, stream=out)
    logging.getLogger(ACCESS_LOGGER).info("GET /health 200")
    logging.getLogger("skymesh.other").info("not at warning")
    assert len(lines(out)) == shown


def test_the_sections_are_strict_and_tracing_is_on_only_with_an_endpoint() -> None:
    cfg = parse_config({})
    assert (cfg.logging.format, cfg.logging.access_log) == ("text", True)
    assert not cfg.tracing.enabled
    with pytest.raises(ConfigError, match=r"logging\.format"):
        parse_config({"logging": {"format": "xml"}})
    with pytest.raises(ConfigError, match=r"logging\.colour"):
        parse_config({"logging": {"colour": True}})
    with pytest.raises(ConfigError, match=r"tracing\.otlp_endpoint: .*http:// or https://"):
        parse_config({"tracing": {"otlp_endpoint": "collector:4318"}})
    with pytest.raises(ConfigError, match=r"tracing\.sample_ratio"):
        parse_config({"tracing": {"otlp_endpoint": "http://c:4318/v1/traces",
                                  "sample_ratio": 1.5}})


def test_the_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("logging: {format: text, access_log: true}\n")
    args = build_parser().parse_args([
        "--config", str(path), "--log-format", "json", "--no-access-log",
        "--otlp-endpoint", "http://127.0.0.1:4318/v1/traces"])
    cfg = config_from_args(args)
    assert (cfg.logging.format, cfg.logging.access_log) == ("json", False)
    assert cfg.tracing.otlp_endpoint == "http://127.0.0.1:4318/v1/traces"
    assert config_from_args(build_parser().parse_args(["--config", str(path)])).logging \
        .format == "text"


@pytest.mark.parametrize("created", [1795885290.0, 1795885290.0421, 1795885290.9999,
                                     1795885290.99999994, 0.5, 1.0 - 2 ** -53])
def test_the_text_time_is_the_stdlib_formatters(created: float) -> None:
    """TextFormatter caches the second and looks the milliseconds up (the access log
    stamps every line with it): the text stays what logging.Formatter writes."""
    from skymesh.obs.logs import TEXT_FORMAT, TextFormatter

    record = logging.makeLogRecord({"name": "skymesh.access", "levelno": logging.INFO,
                                    "levelname": "INFO", "msg": "GET / 200"})
    record.created, record.msecs = created, (created - int(created)) * 1000
    ours = TextFormatter()
    assert ours.format(record) == logging.Formatter(TEXT_FORMAT).format(record)
    assert ours.format(record) == ours.line(created, "skymesh.access", "GET / 200", {})
