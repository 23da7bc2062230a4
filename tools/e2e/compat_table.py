"""Render the e2e suite's route-by-route compatibility record as a Markdown table.

    python tools/e2e/compat_table.py [out/e2e/compat.json] > table.md

One row per case of ``tests/e2e/test_compat.py``: the route, the status and media type
vLLM answers directly, what skymesh-lb answers, and whether status and body shape match
("shape": JSON keys and value types, not values). Routes the balancer answers itself
(``/health``, ``/metrics``, errors of its own) are marked "own": only their status has to
match, unless the suite names the status the balancer gives by design ("by design").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DEFAULT = Path(__file__).resolve().parents[2] / "out" / "e2e" / "compat.json"


def _media(side: dict[str, Any]) -> str:
    return side["content_type"].split(";")[0] or "-"


def render(doc: dict[str, Any]) -> str:
    lines = [f"Route by route, {doc.get('engine', 'vllm')} directly vs through skymesh-lb "
             f"(e2e run of {doc.get('generated_at', '?')}).", "",
             "| case | route | vLLM | skymesh-lb | status | body shape |",
             "| --- | --- | --- | --- | --- | --- |"]
    for case, row in sorted(doc["routes"].items(), key=lambda kv: kv[1]["path"]):
        d, lb = row["direct"], row["skymesh_lb"]
        same_shape = ("own" if row["owned_by_balancer"]
                      else "same" if row["same_shape"] else "differs")
        same_status = ("same" if row["same_status"]
                       else "by design" if row.get("lb_status_by_design") == lb["status"]
                       else "differs")
        lines.append(f"| {case} | `{row['method']} {row['path']}` "
                     f"| {d['status']} {_media(d)} | {lb['status']} {_media(lb)} "
                     f"| {same_status} | {same_shape} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else DEFAULT
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"compat_table: cannot read {path}: {exc} (run `make e2e` first)",
              file=sys.stderr)
        return 2
    sys.stdout.write(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
