"""Runs fault scenarios, prints the fault table and builds the contract JSON.

``{"scenarios": {NAME: {"accepted", "completed", "retried", "failed_explicit", "lost",
...detail}}, "ok": bool}``. Each scenario runs in its own scratch directory under a
time bound; one that raises (or overruns) is reported with its error and counts as a
failure, and the others still run.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from skymesh_lab.faults.scenarios import SCENARIOS

SHORT_BOUND_S = 90.0  # per scenario, short form
FULL_BOUND_S = 600.0
COLUMNS = ("accepted", "completed", "retried", "failed_explicit", "lost")


async def run_one(name: str, short: bool, workdir: Path | None = None) -> dict[str, Any]:
    """Run one scenario; its row (contract keys, checks, info, seconds, ok)."""
    fn = SCENARIOS[name]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"skymesh-fault-{name}-",
                                     dir=workdir) as tmp:
        try:
            res = await asyncio.wait_for(fn(Path(tmp), short),
                                         SHORT_BOUND_S if short else FULL_BOUND_S)
        except Exception as exc:  # report it; the other scenarios still run
            return {**dict.fromkeys(COLUMNS, 0), "seconds": round(time.monotonic() - t0, 1),
                    "ok": False, "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(limit=8)}
    row = res.tally.row()
    row.update(checks=res.checks, info=res.info, seconds=round(time.monotonic() - t0, 1))
    row["ok"] = row["lost"] == 0 and all(res.checks.values())
    return row


async def run(names: Iterable[str], short: bool, workdir: Path | None = None,
              echo: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        if echo:
            print(f"  running {name} ...", flush=True)
        out[name] = await run_one(name, short, workdir)
    return {"short": short, "scenarios": out, "ok": all(r["ok"] for r in out.values())}


def table(report: dict[str, Any]) -> str:
    head = f"{'scenario':<27}" + "".join(f"{c:>17}" for c in COLUMNS) + f"{'s':>7}  result"
    lines = [head, "-" * len(head)]
    for name, r in report["scenarios"].items():
        failed = [k for k, v in r.get("checks", {}).items() if not v]
        verdict = "ok" if r["ok"] else "FAIL " + (r.get("error") or ", ".join(failed)
                                                  or "lost > 0")
        lines.append(f"{name:<27}" + "".join(f"{r[c]:>17}" for c in COLUMNS)
                     + f"{r['seconds']:>7.1f}  {verdict}")
    return "\n".join(lines)
