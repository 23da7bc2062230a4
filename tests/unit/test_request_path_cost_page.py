"""The request-path-cost page: a row per measured configuration, the paired ratio as the
headline, and the summary the bench computes from its turns."""

from __future__ import annotations

from skymesh_lab.bench.request_path_cost import summarize, verdict
from skymesh_lab.bench.request_path_cost_page import request_path_cost


def turn(config: str, build: str, rnd: int, cpu_us: float) -> dict[str, object]:
    return {"config": config, "build": build, "round": rnd, "requests": 1000.0,
            "errors": 0.0, "rps": 5000.0 + rnd, "cpu_us": cpu_us}


SEGMENTS = [turn("rr", "current", 0, 90.0), turn("rr", "base", 0, 100.0),
            turn("rr", "current", 1, 99.0), turn("rr", "base", 1, 110.0),
            turn("rr", "current", 2, 120.0), turn("rr", "base", 2, 100.0),
            turn("stream", "current", 0, 130.0), turn("stream", "base", 0, 140.0)]


def test_the_ratio_is_paired_within_each_round() -> None:
    s = summarize(SEGMENTS)
    assert s["rr"]["ratio"] == {"median": 0.9, "min": 0.9, "max": 1.2}
    assert s["rr"]["current_us"]["median"] == 99.0 and s["rr"]["base_us"]["median"] == 100.0
    assert s["stream"]["ratio"]["median"] == round(130 / 140, 4)
    assert verdict("rr", s["rr"]) == ("rr: base 100.0 us, current 99.0 us per request; "
                                      "current/base 0.900 [0.900, 1.200]")


def page_of(segments: list[dict[str, object]], rounds: int) -> str:
    doc = {"setup": {"base": "7ed796e", "current": "abc1234", "rounds": rounds,
                     "duration_s": 4.0, "connections": 64, "cores": 2,
                     "common_flags": ["--workers", "1", "--no-access-log"],
                     "loadavg_before": [3.0], "loadavg_after": [4.0], "stream_events": 64},
           "summary": summarize(segments), "segments": segments}
    return request_path_cost(doc)


def test_the_page_has_a_row_per_configuration_and_the_rr_headline() -> None:
    page = page_of(SEGMENTS, 3)
    rows = [line for line in page.splitlines() if line.startswith("| ")][2:]
    assert [r.split(" | ")[0] for r in rows] == [
        "| non-streamed, round-robin + `bp`", "| streamed (64 events), round-robin + `bp`"]
    assert "**99.0 us**" in page and "100.0 us before: 10.0% less" in page
    assert "within this run's noise: the rounds' ratios span 1 (0.900 to 1.200)" in page
    assert "before (`7ed796e`)" in page and "now (`abc1234`)" in page
    assert "No socket error" in page


def test_a_ratio_above_one_reads_as_more_not_as_a_negative_less() -> None:
    segs = [turn("rr", "current", 0, 106.0), turn("rr", "base", 0, 100.0),
            turn("rr", "current", 1, 104.0), turn("rr", "base", 1, 100.0)]
    page = page_of(segs, 2)
    assert "100.0 us before: 5.0% more (the median of the rounds' ratios). " in page
    assert "-5.0% less" not in page and "noise" not in page
