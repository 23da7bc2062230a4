"""Reading a replica's load from what vLLM and SGLang expose.

``/metrics`` (Prometheus text) is read with ``prometheus_client``'s own parser, by exact
metric name and exact label name, summed over series (one per engine or model):

- vLLM (and ``skymesh-replica``): ``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc``
  in older releases), KV capacity in tokens from ``vllm:cache_config_info``'s labels
  ``num_gpu_blocks`` x ``block_size``. ``vllm:num_requests_waiting_by_reason`` splits the
  waiting count by reason: it is another metric and never added in.
- SGLang: ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``, ``sglang:token_usage``,
  ``sglang:max_total_num_tokens``; besides its ``/get_load`` JSON (a list with one object
  per data-parallel rank: ``num_reqs``, ``num_waiting_reqs``, ``num_tokens``).
- The admission limit (``max_num_seqs``) where an engine tells it: ``skymesh_engine_max_num_seqs``
  (the emulator) or ``sglang:max_running_requests`` (older SGLang releases; current ones
  only have ``max_running_requests_under_SLO``, an estimate, not read). vLLM 0.32 does not
  publish it: nothing in the captured /metrics holds it, and ``cache_config_info``'s
  ``kv_cache_max_concurrency`` (512 in the capture, served with ``--max-num-seqs 4``) is
  the KV cache's limit at full context length, not the scheduler's.

Cost: a vLLM 0.32 scrape is about 55 KB, mostly histograms; the parser costs about 20 ms
of CPU on all of it (``python -m skymesh.common.probe FILE`` measures it), which at
10 Hz over 64 replicas would be 13 cores. So only the families read here are cut out of
the text (by their ``# HELP``/``# TYPE`` headers, a few ``str.find`` calls) and handed to
the parser, about 0.3 ms; text without those headers is parsed whole.
``cache_config_info``'s line, 1.2 KB of labels that only change when the engine
restarts, is parsed once per distinct line.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class ProbeResult:
    waiting: int
    running: int
    kv_usage: float
    kv_capacity_tokens: int | None = None
    max_num_seqs: int | None = None


class ProbeParseError(ValueError):
    pass


class ProbeStatusError(Exception):
    """A probe answered with a status other than 2xx."""


_VLLM_WAITING = "vllm:num_requests_waiting"
_VLLM_RUNNING = "vllm:num_requests_running"
_VLLM_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name first
_VLLM_CACHE_INFO = "vllm:cache_config_info"
_SGL_WAITING = "sglang:num_queue_reqs"
_SGL_RUNNING = "sglang:num_running_reqs"
_SGL_USAGE = "sglang:token_usage"
_SGL_CAPACITY = "sglang:max_total_num_tokens"
# The emulated replica's name, the one it used before (colons are for recording rules),
# and SGLang's.
_MAX_SEQS = ("skymesh_engine_max_num_seqs", "skymesh:max_num_seqs",
             "sglang:max_running_requests")
_LOAD = (_VLLM_WAITING, _VLLM_RUNNING, _SGL_WAITING, _SGL_RUNNING)
_VLLM_FAMILIES = (_VLLM_WAITING, _VLLM_RUNNING, *_VLLM_USAGE, *_MAX_SEQS[:2])
_SGL_FAMILIES = (_SGL_WAITING, _SGL_RUNNING, _SGL_USAGE, _SGL_CAPACITY, *_MAX_SEQS)
_FAMILIES = frozenset((*_VLLM_FAMILIES, *_SGL_FAMILIES))


def _cut(text: str) -> str | None:
    """The parts of ``text`` holding the families read here (each from its first header to
    the next ``# HELP``), in their order; None when no load family has a header. SGLang's
    names are looked for only when vLLM's are absent: each absent name costs a scan."""
    spans = _spans(text, _VLLM_FAMILIES) or _spans(text, _SGL_FAMILIES)
    if not spans:
        return None
    spans.sort()
    parts: list[str] = []
    end = 0
    for i, j in spans:
        if i >= end:  # a family without a header of its own may sit in another's span
            parts.append(text[i:j])
            end = j
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts)


def _spans(text: str, names: tuple[str, ...]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    found_load = False
    for name in names:
        i = _header(text, name)
        if i >= 0:
            found_load = found_load or name in _LOAD
            j = text.find("\n# HELP ", i + 1)
            spans.append((i, len(text) if j < 0 else j + 1))
    return spans if found_load else []


def _header(text: str, name: str) -> int:
    """Where the first ``# HELP name ...`` or ``# TYPE name ...`` line starts, or -1."""
    key = f" {name} "
    i = text.find(key)
    while i >= 0:
        start = i - 6
        if start >= 0 and text[start:i] in ("# HELP", "# TYPE") and \
                (start == 0 or text[start - 1] == "\n"):
            return start
        i = text.find(key, i + 1)
    return -1


def _cache_info_span(text: str) -> str | None:
    i = text.find(f"\n{_VLLM_CACHE_INFO}{{")
    if i < 0:
        return None
    j = text.find("\n", i + 1)
    return text[i + 1:] if j < 0 else text[i + 1:j + 1]


@functools.lru_cache(maxsize=256)
def _capacity(line: str) -> int | None:
    """KV capacity in tokens from one ``cache_config_info`` sample line, when both labels
    are present and numeric; cached because the line only changes with the engine."""
    total = 0
    for fam in _families(line):
        for s in fam.samples:
            if s.name != _VLLM_CACHE_INFO:
                continue
            try:
                total += int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
            except (KeyError, ValueError):
                continue
    return total or None


def _families(text: str) -> list[Any]:
    try:
        return list(text_string_to_metric_families(text))
    except (ValueError, IndexError, TypeError) as exc:  # the parser's ways of failing
        # The parser names the bad line: keep the message short, it lands in /status.
        raise ProbeParseError(f"unparsable /metrics text: {str(exc)[:200]}") from None


def parse_metrics(text: str) -> ProbeResult:
    """Load figures from a vLLM, SGLang or ``skymesh-replica`` ``/metrics`` body (vLLM's
    names win when both are present). Raises ProbeParseError without a load family."""
    cut = _cut(text)
    sums: dict[str, float] = {}
    for fam in _families(text if cut is None else cut):
        for s in fam.samples:
            if s.name in _FAMILIES:  # exact: a _by_reason or _total series is not its family
                if not math.isfinite(s.value):
                    raise ProbeParseError(f"{s.name} is {s.value}")
                prev = sums.get(s.name)
                if s.name in _VLLM_USAGE or s.name == _SGL_USAGE:
                    sums[s.name] = s.value if prev is None else max(prev, s.value)
                else:
                    sums[s.name] = s.value + (prev or 0.0)
    seqs = next((int(sums[n]) for n in _MAX_SEQS if n in sums), None) or None
    if _VLLM_WAITING in sums or _VLLM_RUNNING in sums:
        usage = next((sums[n] for n in _VLLM_USAGE if n in sums), 0.0)
        info = _cache_info_span(text)
        capacity = _capacity(info) if info is not None else None
        return ProbeResult(int(sums.get(_VLLM_WAITING, 0)), int(sums.get(_VLLM_RUNNING, 0)),
                           usage, capacity, seqs)
    if _SGL_WAITING in sums or _SGL_RUNNING in sums:
        cap = int(sums.get(_SGL_CAPACITY, 0)) or None
        return ProbeResult(int(sums.get(_SGL_WAITING, 0)), int(sums.get(_SGL_RUNNING, 0)),
                           sums.get(_SGL_USAGE, 0.0), cap, seqs)
    raise ProbeParseError("no vllm:num_requests_waiting/running or "
                          "sglang:num_queue_reqs/num_running_reqs in /metrics")


# The name the balancer has always imported; it reads SGLang's names too.
parse_vllm_metrics = parse_metrics


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


def _measure(path: str, rounds: int = 200) -> None:
    text = Path(path).read_text(encoding="utf-8")
    res = parse_metrics(text)
    cut_cpu = time.process_time()
    for _ in range(rounds):
        _capacity.cache_clear()
        parse_metrics(text)
    cut_cpu = (time.process_time() - cut_cpu) / rounds
    warm = time.process_time()
    for _ in range(rounds):
        parse_metrics(text)
    warm = (time.process_time() - warm) / rounds
    full = time.process_time()
    for _ in range(max(1, rounds // 10)):
        _families(text)
    full = (time.process_time() - full) / max(1, rounds // 10)
    print(f"{path}: {len(text)} bytes -> {res}")
    print(f"  CPU per scrape: {warm * 1e3:.3f} ms (cache_config_info line seen before), "
          f"{cut_cpu * 1e3:.3f} ms (first time), whole text through the parser "
          f"{full * 1e3:.2f} ms")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        _measure(p)
