"""Print the requirement lines of pyproject.toml's core and the named extras.

The image installs its dependencies in a layer of their own, before the source is copied
in, so a code change does not reinstall them. That layer may only see pyproject.toml and
the lock; this reads the former (extras that name ``skymesh[...]`` are followed).

    python requirements.py pyproject.toml controller,fast > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Any

_SELF = re.compile(r"^skymesh\[(?P<extras>[^\]]*)\]\s*$")


def requirements(pyproject: dict[str, Any], extras: list[str]) -> list[str]:
    project = pyproject["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    out: list[str] = list(project.get("dependencies", []))
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (has: {sorted(optional)})")
        for req in optional[extra]:
            m = _SELF.match(req)
            if m:
                todo.extend(e.strip() for e in m["extras"].split(",") if e.strip())
            else:
                out.append(req)
    return sorted(set(out), key=str.lower)


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(__doc__)
    data = tomllib.loads(Path(argv[1]).read_text())
    extras = [e.strip() for e in argv[2].split(",") if e.strip()]
    print("\n".join(requirements(data, extras)))


if __name__ == "__main__":
    main(sys.argv)
