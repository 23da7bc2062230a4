"""Prefix state for routing: a bounded trie of who served which prefix, and text keys."""

from __future__ import annotations

from typing import Any

from skymesh.prefix.trie import DEFAULT_MAX_NODES, PrefixTrie

__all__ = ["DEFAULT_MAX_NODES", "PrefixTrie", "text_prefix_keys"]


def __getattr__(name: str) -> Any:
    # The keys need numpy (10 MB of a process's RSS), which the trie does not: loaded
    # when first asked for, so that skymesh-lb's supervisor, whose config check builds
    # the policy and its trie, does not carry numpy (docs/notes/memory-1m.md).
    if name == "text_prefix_keys":
        from skymesh.prefix.keys import text_prefix_keys

        return text_prefix_keys
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
