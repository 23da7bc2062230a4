"""One prompt / output-length sample, as the length predictors train and predict on it."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOKENS = 4096  # PreServe's Table 2 counts lengths "up to 4096"


@dataclass(frozen=True, slots=True)
class Sample:
    text: str
    prompt_tokens: int
    history_tokens: int
    output_tokens: int
    source: str
    group: str
