"""skymesh-lb configuration, request intake and probe parsing (pure parts of the edge)."""

from __future__ import annotations

from pathlib import Path

import pytest

from skymesh.balancer.config import ConfigError, load_config, parse_config
from skymesh.balancer.errors import BadRequest
from skymesh.balancer.intake import parse_request, route_request
from skymesh.common.probe import ProbeParseError, parse_sglang_load, parse_vllm_metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lb.yaml"


def test_the_example_config_is_valid_and_complete() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.policy.name == "prefix-tree" and len(cfg.replicas) == 2
    assert cfg.slo.classes == {"interactive": 2.0, "batch": 600.0}
    assert cfg.prediction.predictor == "moe"


@pytest.mark.parametrize(("data", "culprit"), [
    ({"probe": {"intervl_s": 1}}, "probe.intervl_s"),
    ({"probe": {"interval_s": 0}}, "probe.interval_s"),
    ({"pushing": {"mode": "sideways"}}, "pushing.mode"),
    ({"replicas": [{"url": "ftp://x"}]}, "replicas.0.url"),
    ({"replicas": [{"url": "http://a:1"}, {"url": "http://a:1"}]}, "listed twice"),
    ({"policy": {"name": "best-one"}}, "best-one"),
    ({"policy": {"name": "prefix-tree", "params": {"threshold": 1}}}, "threshold"),
    ({"typo_section": {}}, "typo_section"),
    ({"logging": {"access_log_backlog": 0}}, "logging.access_log_backlog"),
])
def test_bad_config_fails_and_names_the_key(data: dict[str, object], culprit: str) -> None:
    with pytest.raises(ConfigError, match=culprit.replace(".", r"\.")):
        parse_config(data)


def test_the_access_log_backlog_is_the_balancer_s_key_alone() -> None:
    """The controller's access log has no writer thread to bound: it refuses the key
    rather than take one it ignores."""
    from skymesh_controller.config import parse_config as parse_controller_config

    assert parse_config({}).logging.access_log_backlog == 4096
    assert parse_config({"logging": {"access_log_backlog": 8}}).logging.access_log_backlog == 8
    with pytest.raises(ConfigError, match=r"logging\.access_log_backlog"):
        parse_controller_config({"logging": {"access_log_backlog": 8}})


def test_unreadable_or_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("probe: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_intake_renders_chat_and_takes_the_affinity_key() -> None:
    raw = (b'{"model": "m", "stream": true, "user": "u1", '
           b'"messages": [{"role": "user", "content": "hello there"}]}')
    it = parse_request("chat", raw, {})
    assert it.model == "m" and it.stream and it.affinity_key == "u1"
    assert "hello there" in it.prompt_text
    assert parse_request("chat", raw, {"X-Session-ID": "s9"}).affinity_key == "s9"
    route = route_request("r1", it)
    assert route.model == "m" and route.prompt_len >= 1


def test_same_prefix_gives_same_leading_keys() -> None:
    common = "You are a helpful assistant. " * 20
    a = route_request("a", parse_request(
        "completion", f'{{"model": "m", "prompt": "{common}first"}}'.encode(), {}))
    b = route_request("b", parse_request(
        "completion", f'{{"model": "m", "prompt": "{common}second"}}'.encode(), {}))
    shared = len(common) // 64
    assert shared > 0 and a.prefix_keys[:shared] == b.prefix_keys[:shared]


@pytest.mark.parametrize(("raw", "param"), [
    (b"[1, 2]", None),
    (b'{"messages": []}', "model"),
    (b'{"model": "m", "prompt": "x"}', "messages"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}',
     "max_tokens"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
     "max_tokens"),
])
def test_intake_errors_name_the_field(raw: bytes, param: str | None) -> None:
    with pytest.raises(BadRequest) as exc:
        parse_request("chat", raw, {})
    assert exc.value.param == param
    assert exc.value.body()["error"]["type"] == "invalid_request_error"


def test_deadline_header_must_be_positive_milliseconds() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    assert parse_request("chat", raw, {"X-SkyMesh-Deadline-Ms": "250"}).deadline_ms == 250
    for bad in ("soon", "-5"):
        with pytest.raises(BadRequest):
            parse_request("chat", raw, {"X-SkyMesh-Deadline-Ms": bad})


def test_vllm_metrics_parsing_sums_label_sets_and_reads_capacity() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_waiting x",
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="2400"} 1.0',
        'vllm:num_requests_waiting{model_name="a"} 2.0',
        'vllm:num_requests_waiting{model_name="b"} 1.0',
        'vllm:num_requests_running{model_name="a"} 7.0',
        'vllm:gpu_cache_usage_perc{model_name="a"} 0.5',
    ])
    res = parse_vllm_metrics(text)
    assert (res.waiting, res.running, res.kv_usage, res.kv_capacity_tokens) == (3, 7, 0.5, 38400)
    with pytest.raises(ProbeParseError):
        parse_vllm_metrics("# nothing here\n")


def test_sglang_load_parsing() -> None:
    res = parse_sglang_load([{"num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 9},
                             {"num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 3}])
    assert (res.waiting, res.running) == (2, 4)
    with pytest.raises(ProbeParseError):
        parse_sglang_load({"load": 3})


def test_a_deeply_nested_body_is_a_400_not_a_crash() -> None:
    from skymesh.balancer.errors import BadRequest

    raw = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_request("chat", raw, {})


def test_mesh_forwarding_rule_and_its_parameters() -> None:
    from skymesh.policies.peers import DEFAULT_FORWARDING_RULE, Balancing, ForwardingRule

    mesh = {"id": "lb-us", "certs_dir": "pki"}
    cfg = parse_config({"mesh": mesh})
    assert cfg.mesh is not None and cfg.mesh.forwarding_rule is DEFAULT_FORWARDING_RULE
    assert cfg.mesh.balancing() == Balancing()
    cfg = parse_config({"mesh": {**mesh, "forwarding_rule": "balanced",
                                 "balance_margin": 0.5, "locality_margin": 6,
                                 "rtt_weight": 0}})
    assert cfg.mesh is not None and cfg.mesh.forwarding_rule is ForwardingRule.BALANCED
    assert cfg.mesh.balancing() == Balancing(0.5, 6.0, 0.0)
    with pytest.raises(ConfigError, match=r"mesh\.forwarding_rule"):
        parse_config({"mesh": {**mesh, "forwarding_rule": "greedy"}})
    with pytest.raises(ConfigError, match=r"mesh\.locality_margin"):
        parse_config({"mesh": {**mesh, "locality_margin": -1}})


def test_quick_start_max_num_seqs_reaches_pushing_and_bad_values_are_refused() -> None:
    from skymesh.balancer.cli import build_parser, config_from_args

    argv = ["--port", "0", "--replicas", "http://127.0.0.1:18001,http://127.0.0.1:18002",
            "--push-mode", "sp-p"]
    cfg = config_from_args(build_parser().parse_args([*argv, "--max-num-seqs", "4"]))
    assert cfg.pushing.max_num_seqs == 4
    assert config_from_args(build_parser().parse_args(argv)).pushing.max_num_seqs is None
    with pytest.raises(ConfigError, match="max_num_seqs"):
        config_from_args(build_parser().parse_args([*argv, "--max-num-seqs", "0"]))
