"""``skymesh-replica --scheduler sglang``: a real process over loopback speaks SGLang's
metrics, and the balancer's probe reads its snapshot queue gauge."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from skymesh.common.probe import parse_metrics
from skymesh.util.procs import Daemon, start_daemon
from skymesh_replica.cli import build_parser, main

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("sgl-replica")
    d: Daemon = start_daemon("skymesh-replica",
                             ["--port", "0", "--scheduler", "sglang", "--time-scale", "0.02"],
                             log_path=tmp / "replica.log")
    try:
        yield d.url
    finally:
        assert d.stop() == 0, d.log()


def test_the_flag_names_both_schedulers() -> None:
    assert build_parser().parse_args(["--port", "1", "--scheduler", "sglang"]).scheduler == \
        "sglang"
    assert build_parser().parse_args(["--port", "1"]).scheduler == "vllm"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--port", "1", "--scheduler", "trt"])


def test_vllms_seq_limit_is_refused_in_sglang_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--port", "1", "--scheduler", "sglang", "--max-num-seqs", "4"])
    assert exc.value.code == 2
    assert "--max-num-seqs" in capsys.readouterr().err


async def test_metrics_are_sglangs_and_the_probe_reads_them(replica: str) -> None:
    async with aiohttp.ClientSession() as http:
        body = {"model": (await (await http.get(f"{replica}/v1/models")).json())
                ["data"][0]["id"],
                "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
        async with http.post(f"{replica}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            out = await resp.json()
        assert 1 <= out["usage"]["completion_tokens"] <= 8
        async with http.get(f"{replica}/metrics") as resp:
            text = await resp.text()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage",
            "sglang:generation_tokens"} <= names
    assert not any(n.startswith("vllm:") for n in names)  # an SGLang server has none
    probe = parse_metrics(text)
    assert (probe.waiting, probe.running) == (0, 0)  # the prefill's log point: empty queue
    assert probe.kv_capacity_tokens == 38_400
