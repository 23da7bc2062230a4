"""Writing a command's ``--json PATH`` result: one JSON object, replaced atomically.

Here rather than in ``skymesh.cli`` so that the subcommand modules (planning, predict,
bench) do not import the command-line entry point back: that made import cycles.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | None, obj: dict[str, Any]) -> None:
    """Write ``obj`` to ``path`` (no-op when ``path`` is empty), creating the folder; a
    reader never sees a half-written file (written beside it, then renamed)."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    tmp.replace(p)
