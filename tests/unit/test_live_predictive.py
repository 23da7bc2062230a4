"""The live balancer's predictive pieces that need no process: deadlines and SLO classes at
intake, the length predictor's fallbacks, and the pure parts of mid-stream migration."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from skymesh.balancer.config import ConfigError, PredictionConfig, parse_config
from skymesh.balancer.dispatch import Ticket
from skymesh.balancer.errors import BadRequest
from skymesh.balancer.intake import parse_request, prediction_input, request_deadline
from skymesh.balancer.migration import (
    LiveStream,
    SSEFramer,
    continuation_body,
    migratable,
    migrated_route,
    tokenize_requests,
)
from skymesh.balancer.prediction import LivePredictor
from skymesh.policies import build_policy
from skymesh.policies.base import RouteRequest


def chat_intake(headers: dict[str, str] | None = None, **body: Any) -> Any:
    raw = json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": [{"type": "text", "text": "second"},
                                     {"type": "text", "text": "question"}]}], **body}).encode()
    return parse_request("chat", raw, headers or {})


CLASSES = {"interactive": 2.0, "batch": 60.0}
HDR = "X-SkyMesh-SLO-Class"


@pytest.mark.parametrize(("headers", "default", "expected"), [
    ({}, None, None),
    ({"X-SkyMesh-Deadline-Ms": "1500"}, None, 1.5),
    ({HDR: "batch"}, None, 60.0),
    ({}, "interactive", 2.0),
    ({HDR: "batch", "X-SkyMesh-Deadline-Ms": "1500"}, None, 1.5),
    ({HDR: "interactive", "X-SkyMesh-Deadline-Ms": "9000"}, None, 2.0),
])
def test_deadline_is_the_tighter_of_header_and_slo_class(
        headers: dict[str, str], default: str | None, expected: float | None) -> None:
    intake = chat_intake(headers)
    assert request_deadline(intake, headers, HDR, CLASSES, default) == expected


def test_unknown_slo_class_is_a_400_naming_it_and_the_known_ones() -> None:
    headers = {HDR: "gold"}
    with pytest.raises(BadRequest, match=r"gold.*batch, interactive") as exc:
        request_deadline(chat_intake(headers), headers, HDR, CLASSES)
    assert exc.value.status == 400


def test_without_classes_the_slo_header_is_ignored() -> None:
    headers = {HDR: "gold"}
    assert request_deadline(chat_intake(headers), headers, HDR, {}) is None


@pytest.mark.parametrize(("slo", "culprit"), [
    ({"classes": {"x": 0}}, "slo.classes"),
    ({"classes": {"x": 1}, "default": "y"}, "slo.default"),
    ({"header": "Bad Header"}, "slo.header"),
    ({"clases": {}}, "slo.clases"),
])
def test_bad_slo_config_names_the_key(slo: dict[str, Any], culprit: str) -> None:
    with pytest.raises(ConfigError, match=culprit.replace(".", r"\.")):
        parse_config({"slo": slo})


def test_bad_prediction_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"prediction\.predictor"):
        parse_config({"prediction": {"predictor": "crystal-ball"}})


def test_prediction_input_is_the_last_user_turn_and_the_history_before_it() -> None:
    intake = chat_intake()
    text, turn, history = prediction_input(intake, 100)
    assert text == "second\nquestion"
    assert turn == len(text) // 4 and history == 100 - turn


async def test_missing_model_file_falls_back_to_history_and_says_so(tmp_path: Path) -> None:
    calls: list[Path] = []

    def loader(path: Path) -> Any:
        calls.append(path)
        raise AssertionError("must not load a missing file")

    p = LivePredictor(PredictionConfig(model_path=str(tmp_path / "none.pt")), loader)
    p.start()
    await p.wait_loaded()
    assert p.active == "history" and "not found" in (p.error or "") and not calls
    assert p.predict("x", 1, 0, 10, None) == 256  # HistoryPredictor's cold default
    for _ in range(3):
        p.observe(10, 7)
    assert p.predict("x", 1, 0, 10, None) == 7
    assert p.predict("x", 1, 0, 10, 5) == 5  # never above max_tokens


async def test_a_loaded_model_predicts_and_an_unreadable_one_falls_back(tmp_path: Path
                                                                        ) -> None:
    f = tmp_path / "m.pt"
    f.write_bytes(b"x")

    class Model:
        def predict_one(self, text: str, prompt_tokens: int, history_tokens: int = 0) -> int:
            return len(text) + prompt_tokens + history_tokens

    p = LivePredictor(PredictionConfig(model_path=str(f)), lambda path: Model())
    assert p.active == "history"  # until the load finishes
    p.start()
    await p.wait_loaded()
    assert p.active == "moe" and p.predict("abc", 2, 1, 9, None) == 6

    def broken(path: Path) -> Any:
        raise ValueError("not a SkyMesh length model")

    q = LivePredictor(PredictionConfig(model_path=str(f)), broken)
    q.start()
    await q.wait_loaded()
    assert q.active == "history" and "not a SkyMesh" in (q.error or "")
    none = LivePredictor(PredictionConfig(predictor="none"))
    assert none.active == "none" and none.predict("a", 1, 0, 1, None) is None


def test_sse_framer_cuts_only_between_events() -> None:
    f = SSEFramer()
    assert f.feed(b'data: {"a"') == []
    assert f.feed(b':1}\n\ndata: [DO') == [b'data: {"a":1}\n\n']
    assert f.feed(b"NE]\n\n") == [b"data: [DONE]\n\n"]
    assert f.feed(b"data: 1\n\ndata: 2\n\n") == [b"data: 1\n\n", b"data: 2\n\n"]


def ev(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_live_stream_passes_the_first_attempt_through_and_rewrites_a_continuation() -> None:
    route = RouteRequest("r1", model="m", prompt_len=10)
    st = LiveStream(Ticket(route, 0.0), "chat", {"model": "m"}, 0.0)
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    role = ev({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}]})
    tok = ev({**head, "choices": [{"index": 0, "delta": {"content": " the"},
                                   "finish_reason": None}]})
    assert st.accept(role) == role and st.accept(tok) == tok
    assert st.tokens == 1 and st.generated_text == " the"

    # Cut over: the continuation is a /v1/completions stream of another replica.
    st.spliced, st.prompt_ids, st.generated_ids, st.attempt_tokens = True, [1] * 12, 1, 0
    other = {"id": "cmpl-9", "object": "text_completion", "created": 99, "model": "m"}
    assert st.accept(ev({**other, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                     ) is None
    out = st.accept(ev({**other, "choices": [{"index": 0, "text": " river",
                                              "finish_reason": "length"}]}))
    assert out is not None
    chunk = json.loads(out[6:])
    assert chunk == {**head, "choices": [{"index": 0, "delta": {"content": " river"},
                                          "logprobs": None, "finish_reason": "length"}]}
    usage = st.accept(ev({**other, "choices": [], "usage": {
        "prompt_tokens": 13, "completion_tokens": 1, "total_tokens": 14}}))
    assert usage is not None
    assert json.loads(usage[6:]) == {**head, "choices": [], "usage": {
        "prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}}
    assert st.accept(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert st.tokens == 2 and st.attempt_tokens == 1 and st.finished and st.done
    assert st.generated_text == " the river"


def test_continuation_body_carries_sampling_and_shrinks_the_caps() -> None:
    body = {"model": "m", "messages": [], "max_completion_tokens": 50, "min_tokens": 10,
            "temperature": 0.3, "seed": 4, "stop": ["\n"], "stream": True,
            "stream_options": {"include_usage": True}, "tool_choice": "none"}
    out = continuation_body(body, "chat", [1, 2], [7, 8, 9])
    assert out == {"model": "m", "prompt": [1, 2, 7, 8, 9], "max_tokens": 47, "min_tokens": 7,
                   "temperature": 0.3, "seed": 4, "stop": ["\n"], "stream": True,
                   "stream_options": {"include_usage": True}}
    # Chat without a cap: explicitly none (absent would mean 16 on /v1/completions).
    no_cap = continuation_body({"model": "m", "messages": []}, "chat", [1], [2])
    assert no_cap is not None and no_cap["max_tokens"] is None
    # Completions without max_tokens had 16.
    c = continuation_body({"model": "m", "prompt": "x"}, "completion", [1], [2, 3])
    assert c is not None and c["max_tokens"] == 14
    assert continuation_body({"model": "m", "prompt": "x", "max_tokens": 2}, "completion",
                             [1], [2, 3]) is None


def test_what_can_migrate() -> None:
    assert migratable({"model": "m", "messages": [], "temperature": 1})
    assert migratable({"model": "m", "logprobs": False, "n": 1})
    for extra in ({"logprobs": True}, {"n": 2}, {"tools": [{}]},
                  {"response_format": {"type": "json_object"}}, {"echo": True}):
        assert not migratable({"model": "m", **extra})


def test_tokenize_requests_reuse_client_token_ids() -> None:
    p, g = tokenize_requests({"model": "m", "prompt": [[5, 6]]}, "completion", " a b")
    assert p is None and g == {"model": "m", "prompt": " a b", "add_special_tokens": False}
    p, _ = tokenize_requests({"model": "m", "messages": [{"role": "user", "content": "q"}]},
                             "chat", "")
    assert p == {"model": "m", "messages": [{"role": "user", "content": "q"}],
                 "add_generation_prompt": True}


def test_migrated_route_carries_what_is_left() -> None:
    r = RouteRequest("r", prompt_len=100, deadline_s=2.0, predicted_output_tokens=50,
                     output_len_hint=80)
    m = migrated_route(r, 30, 0.5)
    assert (m.prompt_len, m.predicted_output_tokens, m.output_len_hint, m.deadline_s) == \
        (130, 20, 50, 1.5)
    # Past its prediction: a 20% extension, as GoodServe's re-check assumes.
    assert migrated_route(r, 60, 0.5).predicted_output_tokens == 10
    # The continuation stays on this region's replicas (the dispatcher never forwards a
    # forwarded route to a peer).
    assert m.forwarded and not r.forwarded


def test_goodserve_decode_priors_set_per_target_estimates() -> None:
    p = build_policy("goodserve", {"decode_priors": {"http://slow": 0.05}})
    assert p.speed("http://slow").d == 0.05  # type: ignore[attr-defined]
    assert p.speed("http://other").d == 0.03  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="decode_priors"):
        build_policy("goodserve", {"decode_priors": {"http://slow": -1}})


# -- the CLI flags -----------------------------------------------------------------------
def test_sim_flags_build_a_mixed_fleet_with_deadlines_and_predictions(tmp_path: Path) -> None:
    from skymesh.cli import main

    out = tmp_path / "sim.json"
    args = ["sim", "--workload", "poisson", "--policy", "goodserve", "--regions", "us",
            "--duration", "10", "--no-progress", "--json", str(out)]
    assert main([*args, "--profiles", "l4=1,h100=1", "--deadline-scale", "2",
                 "--length-predictor", "oracle"]) == 0
    res = json.loads(out.read_text())
    assert res["predicted_length_mae"] == 0.0  # oracle lengths reached the run
    assert 0 <= res["slo_violation_rate"] <= 1 and res["goodput_rps"] > 0
    out.unlink()
    assert main(args) == 0  # no deadlines: no goodput figures
    assert "goodput_rps" not in json.loads(out.read_text())


@pytest.mark.parametrize("bad", [["--profiles", "tpu=2"], ["--profiles", "eu:l4=1"],
                                 ["--length-predictor", "psychic"],
                                 ["--deadline-scale", "0"]])
def test_bad_sim_flags_exit_2(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from skymesh.cli import main

    assert main(["sim", "--workload", "poisson", "--regions", "us", "--duration", "5",
                 "--no-progress", *bad]) == 2
    assert "skymesh sim:" in capsys.readouterr().err


def test_bench_predictor_flag_overrides_the_environment_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from skymesh.cli import build_parser
    from skymesh_lab.bench.goodput import PREDICTOR_ENV, PREDICTORS
    from skymesh_lab.predict.cli import BENCH_PREDICTORS

    assert BENCH_PREDICTORS == PREDICTORS
    monkeypatch.setenv(PREDICTOR_ENV, "oracle")
    build_parser().parse_args(["bench", "goodput"])
    assert os.environ[PREDICTOR_ENV] == "oracle"  # no flag: the variable
    args = build_parser().parse_args(["bench", "goodput", "--predictor", "history"])
    assert args.predictor == "history"
    assert os.environ[PREDICTOR_ENV] == "history"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "goodput", "--predictor", "psychic"])
    assert exc.value.code == 2


def test_single_text_tfidf_fast_path_matches_the_vectorizer() -> None:
    import numpy as np

    from skymesh.predict.moe import MoEConfig, MoEPredictor, _new_vectorizer

    docs = ["the river flows to the sea", "a river, a sea and a river again",
            "solve 3 + 4 for x", "the sea the sea the sea", "nothing in common here"]
    vec = _new_vectorizer(64)
    vec.fit(docs)
    m = MoEPredictor(vec, [], None, MoEConfig())
    for text in [*docs, "river river river sea", "zzz unknown words", ""]:
        cols, w = m.text_bag(text)
        row = vec.transform([text])
        assert list(cols) == sorted(row.indices.tolist())
        ref = dict(zip(row.indices.tolist(), row.data.tolist(), strict=True))
        assert np.allclose(w, [ref[c] for c in cols], rtol=1e-5)


def test_a_broken_stream_is_rebuilt_from_the_bytes_the_client_has() -> None:
    """``retry.resume_streams`` on the plain relay: the relayed bytes become the stream's
    state (tokens, text, head) and the resume begins; a break inside an event, which the
    client holds half of, is not resumed."""
    from skymesh.balancer.moves import Mover

    calls: list[LiveStream] = []

    class Fake:
        def resume(self, st: LiveStream, exc: BaseException) -> bool:
            calls.append(st)
            return True

    def chunk(text: str, finish: str | None = None) -> bytes:
        return b"data: " + json.dumps({
            "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}]}).encode() + b"\n\n"

    intake = parse_request("completion", json.dumps(
        {"model": "m", "prompt": "Rivers", "stream": True}).encode(), {})
    ticket = Ticket(RouteRequest("r"), 0.0)
    relayed = chunk(" run") + chunk(" to") + chunk(" the")
    st = Mover.resumable(Fake(), ticket, intake, 0.0, 0.1, None,  # type: ignore[arg-type]
                         relayed, ConnectionError())
    assert st is not None and calls == [st]
    assert (st.tokens, st.generated_text, st.head) == (3, " run to the", {
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"})
    half = relayed + chunk(" sea")[:20]
    assert Mover.resumable(Fake(), ticket, intake, 0.0, 0.1, None,  # type: ignore[arg-type]
                           half, ConnectionError()) is None
    assert len(calls) == 1  # never asked to resume
