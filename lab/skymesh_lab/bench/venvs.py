"""Third-party routers for side-by-side benchmarks, each in its own venv under /tmp.

Never the repository's venv: sglang-router and vllm-router pull in their own dependency
sets, which must not leak into SkyMesh's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def ensure_package(venv: Path, package: str, version: str, import_name: str
                   ) -> tuple[Path | None, str]:
    """The python of ``venv`` with ``package==version`` importable (the venv is created
    and the package installed if needed), or None and why."""
    py = venv / "bin" / "python"
    check = [str(py), "-c", f"import importlib.metadata as m, {import_name}; "
             f"print(m.version('{package}'))"]

    def installed() -> str:
        if not py.exists():
            return ""
        r = subprocess.run(check, capture_output=True, text=True, timeout=60)
        return r.stdout.strip() if r.returncode == 0 else ""

    try:
        if installed() == version:
            return py, f"{package} {version} in {venv}"
        if not py.exists():
            base = shutil.which("python3") or sys.executable
            print(f"creating {venv} for {package}", flush=True)
            r = subprocess.run([base, "-m", "venv", str(venv)], capture_output=True,
                               text=True, timeout=300)
            if r.returncode != 0:
                return None, f"python3 -m venv {venv} failed: {(r.stderr or r.stdout)[-500:]}"
        print(f"installing {package}=={version} into {venv}", flush=True)
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", f"{package}=={version}"],
                           capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            return None, f"pip install {package}=={version} failed: " \
                         f"{(r.stderr or r.stdout)[-800:]}"
        got = installed()
        if got != version:
            return None, f"{package} import check failed after install (got {got!r})"
        return py, f"{package} {version} in {venv} (installed now)"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"could not set up {package}: {exc}"
