"""Prefix state for routing: a bounded trie of who served which prefix, and text keys."""

from skymesh.prefix.keys import text_prefix_keys
from skymesh.prefix.trie import DEFAULT_MAX_NODES, PrefixTrie

__all__ = ["DEFAULT_MAX_NODES", "PrefixTrie", "text_prefix_keys"]
