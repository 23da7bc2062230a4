"""A sequence's place in the engine (shared by the vLLM and SGLang schedulers)."""

from __future__ import annotations

import enum


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
