"""Print the requirement lines of the distributions an image role installs.

The image installs its dependencies in a layer of their own, before the source is copied
in, so a code change does not reinstall them. That layer may only see the pyproject.toml
files and the lock; this reads them. Our own distributions (``skymesh``,
``skymesh-controller``, ``skymesh-replica``) are left out: the image builds them from the
source.

    python requirements.py /deps balancer > requirements.txt

``/deps`` holds ``skymesh/``, ``controller/`` and ``replica/``, each with its
pyproject.toml.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

# role -> (folder under the deps directory, extras) of each distribution it installs
ROLES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "balancer": [("skymesh", ("fast", "kv-events"))],
    "controller": [("skymesh", ("fast", "kv-events")), ("controller", ("planning",))],
    "replica": [("skymesh", ("fast", "kv-events")), ("replica", ("tokenizer",))],
}
_OURS = re.compile(r"^skymesh(-controller|-replica|-lab)?\b")


def requirements(deps: Path, role: str) -> list[str]:
    if role not in ROLES:
        raise SystemExit(f"no image role {role!r} (roles: {', '.join(sorted(ROLES))})")
    out: set[str] = set()
    for folder, extras in ROLES[role]:
        project = tomllib.loads((deps / folder / "pyproject.toml").read_text())["project"]
        optional: dict[str, list[str]] = project.get("optional-dependencies", {})
        lines = list(project.get("dependencies", []))
        for extra in extras:
            if extra not in optional:
                raise SystemExit(f"{folder}/pyproject.toml has no extra {extra!r}")
            lines += optional[extra]
        out |= {line for line in lines if not _OURS.match(line)}
    return sorted(out, key=str.lower)


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(__doc__)
    print("\n".join(requirements(Path(argv[1]), argv[2])))


if __name__ == "__main__":
    main(sys.argv)
