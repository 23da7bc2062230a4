"""Reading a replica's load from what vLLM and SGLang expose.

vLLM (and ``skymesh-replica``): Prometheus text at ``/metrics``; we read
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and
``vllm:gpu_cache_usage_perc`` (``vllm:kv_cache_usage_perc`` in newer releases), summed
over label sets (one per model or engine), and the KV capacity in tokens from the labels
of ``vllm:cache_config_info`` (``num_gpu_blocks`` x ``block_size``). SGLang:
``/get_load``, a JSON list with one object per data-parallel rank (``num_reqs``,
``num_waiting_reqs``, ``num_tokens``).

The text parser only looks at the three lines it needs: a full Prometheus parser costs
about a millisecond per scrape, which at 10 Hz over 64 replicas is most of a core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ProbeResult:
    waiting: int
    running: int
    kv_usage: float
    kv_capacity_tokens: int | None = None


class ProbeParseError(ValueError):
    pass


class ProbeStatusError(Exception):
    """A probe answered with a status other than 2xx."""


_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_USAGE = ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc")
_CACHE_INFO = "vllm:cache_config_info{"


def _value(line: str) -> float:
    # "name{labels} value [timestamp]": the value follows the closing brace or the name.
    rest = line[line.rindex("}") + 1:] if "}" in line else line.split(None, 1)[1]
    return float(rest.split()[0])


def _label(line: str, name: str) -> str | None:
    key = f'{name}="'
    i = line.find(key)
    if i < 0:
        return None
    j = line.find('"', i + len(key))
    return line[i + len(key):j] if j > 0 else None


def _capacity(line: str) -> int | None:
    """KV capacity in tokens from ``cache_config_info``'s labels, when both are present."""
    blocks, size = _label(line, "num_gpu_blocks"), _label(line, "block_size")
    try:
        return int(blocks) * int(size) if blocks and size else None
    except ValueError:
        return None


def parse_vllm_metrics(text: str) -> ProbeResult:
    waiting = running = 0.0
    usage: float | None = None
    capacity: int | None = None
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        if line.startswith(_WAITING):
            waiting += _value(line)
            seen = True
        elif line.startswith(_RUNNING):
            running += _value(line)
            seen = True
        elif line.startswith(_USAGE):
            v = _value(line)
            usage = v if usage is None else max(usage, v)
        elif line.startswith(_CACHE_INFO):
            capacity = _capacity(line)
    if not seen:
        raise ProbeParseError("no vllm:num_requests_waiting/running in /metrics")
    return ProbeResult(int(waiting), int(running), usage or 0.0, capacity)


def parse_sglang_load(obj: Any) -> ProbeResult:
    ranks = obj if isinstance(obj, list) else [obj]
    waiting = running = 0
    for r in ranks:
        if not isinstance(r, dict) or "num_reqs" not in r:
            raise ProbeParseError("unexpected /get_load shape")
        w = int(r.get("num_waiting_reqs", 0))
        waiting += w
        running += max(0, int(r["num_reqs"]) - w)
    return ProbeResult(waiting, running, 0.0)
