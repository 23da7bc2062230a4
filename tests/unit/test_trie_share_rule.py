"""What a worker tells its siblings about its prefix trie (skymesh.balancer.siblings): only
inserts that changed its record, and the siblings still end up holding what one trie
shared by all the workers would."""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter
from support import eventually

from skymesh.balancer.siblings import TrieShare, decode_inserts, encode_inserts
from skymesh.prefix.trie import PrefixTrie


def chained(path: Sequence[int]) -> tuple[int, ...]:
    """Key i names the whole prefix ``path[: i + 1]``, as the balancer's keys do."""
    return tuple(hash(tuple(path[: i + 1])) & ((1 << 64) - 1) for i in range(len(path)))


def told(trie: PrefixTrie) -> list[tuple[tuple[int, ...], str]]:
    out: list[tuple[tuple[int, ...], str]] = []
    trie.on_insert = lambda keys, target: out.append((tuple(keys), target))
    return out


def test_only_a_changed_record_is_told() -> None:
    trie = PrefixTrie()
    got = told(trie)
    abc, ab, abcd = chained([1, 2, 3]), chained([1, 2]), chained([1, 2, 3, 4])
    trie.insert(abc, "a")
    assert got == [(abc, "a")]  # a new prefix
    trie.insert(abc, "a")
    trie.insert(ab, "a")  # held already: every prefix of a recorded path is
    trie.insert((), "a")
    assert got == [(abc, "a")]
    trie.insert(abcd, "a")  # one key more
    trie.insert(ab, "b")  # a target new to a prefix the trie holds
    assert got == [(abc, "a"), (abcd, "a"), (ab, "b")]


def test_a_decision_lost_to_eviction_is_told_again() -> None:
    trie = PrefixTrie(max_nodes=4)
    got = told(trie)
    trie.insert(chained([1, 2]), "a")
    trie.insert(chained([7, 8, 9]), "b")  # evicts [1, 2] (the oldest) to make room
    assert trie.depth_of(chained([1, 2])) < 2
    trie.insert(chained([1, 2]), "a")
    assert got[-1] == (chained([1, 2]), "a")


def share(tries: list[PrefixTrie]) -> None:
    """Wire ``tries`` as workers that apply each other's news at once (the live share
    without its datagrams)."""
    applying = [False]
    for trie in tries:
        def record(keys: Sequence[int], target: str, me: PrefixTrie = trie) -> None:
            if applying[0]:
                return
            applying[0] = True
            try:
                for other in tries:
                    if other is not me:
                        other.insert(keys, target)
            finally:
                applying[0] = False
        trie.on_insert = record


paths = st.lists(st.integers(0, 3), min_size=1, max_size=6)
inserts = st.lists(st.tuples(st.integers(0, 2), paths, st.sampled_from("abc")),
                   min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(inserts)
def test_siblings_hold_what_one_shared_trie_would(ops: list[tuple[int, list[int], str]]
                                                  ) -> None:
    tries = [PrefixTrie(), PrefixTrie(), PrefixTrie()]
    reference = PrefixTrie()  # one trie that sees every insert
    share(tries)
    for worker, path, target in ops:
        tries[worker].insert(chained(path), target)
        reference.insert(chained(path), target)
    everyone = ("a", "b", "c")
    for _, path, _ in ops:
        for cut in range(1, len(path) + 1):
            keys = chained(path[:cut])
            want = reference.depth_groups(keys, everyone)
            for trie in tries:
                got = trie.depth_groups(keys, everyone)
                # Targets come in first-recorded order, which differs between tries.
                assert [(d, set(g)) for d, g in got] == [(d, set(g)) for d, g in want]


async def test_a_repeat_sends_no_datagram(tmp_path: Path) -> None:
    """Over real unix datagrams: a thousand repeats of one decision are sent once, and
    the sibling still learns the decision and a later new target for it."""
    tries = [PrefixTrie(), PrefixTrie()]
    dropped = Counter("dropped", "d", registry=CollectorRegistry())
    shares = [TrieShare(tmp_path, i, 2, lambda i=i: tries[i], lambda t: True, dropped)
              for i in (0, 1)]
    for s in shares:
        s.start()
    try:
        keys = chained([1, 2, 3])
        for _ in range(1000):
            tries[0].insert(keys, "http://a")
        tries[0].insert(keys[:2], "http://b")
        await eventually(lambda: shares[1].applied == 2, "both decisions applied")
        assert shares[0].inserts_sent == 2
        assert tries[1].depth_groups(keys, ["http://a", "http://b"]) == [
            (3, ("http://a",)), (2, ("http://b",))]
        assert shares[1].inserts_sent == 0  # what it applied is not echoed back
    finally:
        for s in shares:
            await s.stop()


def _datagram(names: bytes, entries: list[int], keys: bytes, count: int | None = None
              ) -> bytes:
    """A share datagram with the given parts (siblings' format), for malformed ones."""
    n = len(entries) // 2 if count is None else count
    return (struct.pack("<II", len(names), n) + names
            + struct.pack(f"<{len(entries)}I", *entries) + keys)


@pytest.mark.parametrize("data", [
    b"", b"\x05",  # no header
    struct.pack("<II", 100, 1) + b"ab",  # names cut short
    _datagram(b"a", [0, 1], b"\x01" * 7),  # keys not a whole number of uint64
    _datagram(b"\xff", [0, 1], b"\x00" * 8),  # a name that is not UTF-8
    _datagram(b"a", [0, 5], b"\x00" * 8),  # more keys counted than sent
    _datagram(b"a", [3, 1], b"\x00" * 8),  # a target index past the names
    _datagram(b"a", [0, 1], b"", count=4),  # more inserts counted than sent
])
def test_a_malformed_datagram_is_refused(data: bytes) -> None:
    with pytest.raises((ValueError, IndexError, struct.error)):
        decode_inserts(data)


async def test_a_malformed_datagram_is_ignored_and_the_next_applied(tmp_path: Path) -> None:
    trie = PrefixTrie()
    dropped = Counter("dropped", "d", registry=CollectorRegistry())
    share = TrieShare(tmp_path, 0, 2, lambda: trie, lambda t: True, dropped)
    share.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"\x05\x00garbage", str(share.path))
            (msg,) = encode_inserts([(chained([1, 2]), "http://a")])
            s.sendto(msg, str(share.path))
        await eventually(lambda: share.applied == 1, "the good datagram applied")
        assert trie.depth_of(chained([1, 2])) == 2
    finally:
        await share.stop()
