"""The pass-through's path rule (issue #33, item 12): normalised before the deny check,
refused when it climbs above the root or hides a separator or a dot in an encoding."""

from __future__ import annotations

import pytest
from yarl import URL

from skymesh.balancer.errors import BadRequest
from skymesh.balancer.passthrough import forwarded, normalise_path


@pytest.mark.parametrize(("raw", "expected"), [
    ("/v1/responses", "/v1/responses"),
    ("/", "/"),
    ("//", "/"),
    ("/v1/./load_lora_adapter", "/v1/load_lora_adapter"),
    ("/v1//load_lora_adapter", "/v1/load_lora_adapter"),
    ("/v1/load_lora_adapter/", "/v1/load_lora_adapter"),
    ("/v1/x/../../sleep", "/sleep"),
    ("/v1/x/../load_lora_adapter", "/v1/load_lora_adapter"),
    ("/./v1/.//embeddings/.", "/v1/embeddings"),
    ("/v1/files/abc/..", "/v1/files"),
    ("/v1/%6coad_lora_adapter", "/v1/%6coad_lora_adapter"),  # decoded by the caller
    ("/v1/files/a%20b", "/v1/files/a%20b"),
    ("/v1/..a/b..", "/v1/..a/b.."),  # not dot segments
])
def test_a_path_is_normalised(raw: str, expected: str) -> None:
    assert normalise_path(raw) == expected


@pytest.mark.parametrize("raw", [
    "/..",
    "/v1/../..",
    "/v1/../../sleep",
    "/v1/%2e%2e/sleep",
    "/v1/%2E%2E/%2e%2E/sleep",
    "/v1/%2e/load_lora_adapter",
    "/v1/.%2e/x",
    "/v1%2fload_lora_adapter",
    "/v1/%2F",
    "/v1/%5c..%5csleep",
    "/v1/x\\..\\..\\sleep",
    "v1/responses",
])
def test_a_path_that_escapes_or_encodes_a_separator_is_refused(raw: str) -> None:
    with pytest.raises(BadRequest):
        normalise_path(raw)


@pytest.mark.parametrize(("raw", "passes"), [
    # Each of these reached the replica as written before the fix.
    ("/v1/./load_lora_adapter", False),
    ("/v1//load_lora_adapter", False),
    ("/v1/load_lora_adapter/", False),
    ("/v1/x/../../sleep", False),
    ("/v1/%6coad_lora_adapter", False),  # an encoded letter is decoded before the check
    ("/v1//unload_lora_adapter/.", False),
    ("/v1/x/../../tokenize", True),
    ("/v1//responses/", True),
])
def test_the_deny_check_reads_the_normalised_decoded_path(raw: str, passes: bool) -> None:
    path = URL.build(path=normalise_path(raw), encoded=True).path
    assert forwarded(path) is passes
