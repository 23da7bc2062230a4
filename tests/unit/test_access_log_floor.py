"""The access log's floor (``--ablate floor``) writes the full log's line for the
benchmark's requests: its live cost is that of the same output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

_RUN = """
import asyncio, sys
if sys.argv[2] == "floor":
    from skymesh_lab.bench import access_log_floor
    access_log_floor.apply()
from skymesh.obs.logs import setup_logging
from skymesh_lab.bench.access_log_loop import loop_us
with open(sys.argv[1], "w") as out:
    setup_logging("warning", "text", stream=out)
    asyncio.run(loop_us(128, True))  # two whole batches
"""
# What differs from run to run: the time of the line and the request's durations.
_VARYING = re.compile(r"^\S+ \S+ |(?<=_ms=)[0-9.]+")


def _lines(tmp_path: Path, build: str) -> list[str]:
    out = tmp_path / f"{build}.log"
    subprocess.run([sys.executable, "-c", _RUN, str(out), build], check=True,
                   timeout=120, cwd=tmp_path)
    return [_VARYING.sub("", line) for line in out.read_text().splitlines()]


def test_the_floor_writes_the_full_logs_lines(tmp_path: Path) -> None:
    full = _lines(tmp_path, "full")
    floor = _lines(tmp_path, "floor")
    assert len(full) == 128
    assert floor == full
    assert "request_id=req-0 model=stub served_by=http://127.0.0.1:8001 via=replica" in floor[0]
