"""The mesh heartbeat's exact prefix summary: built from the replicas' KV-event block
indexes, carried in the heartbeat, probed by the receiving peer with a request's block
keys (docs/kv-events.md, "Across the mesh")."""

from __future__ import annotations

import random

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from support import View

from skymesh.balancer.config import KVEventsConfig, ReplicaConfig
from skymesh.balancer.intake import parse_request
from skymesh.balancer.kv_feed import SKYMESH_KEY, ExactScorer, KVFeeds
from skymesh.mesh.heartbeat import HeartbeatSession, prefix_summary, read_block_summaries
from skymesh.mesh.proto import pb
from skymesh.mesh.state import Identity, PeerState
from skymesh.mesh.summary import (
    BLOCK_DEPTHS,
    DEFAULT_DEPTHS,
    PeerSnapshot,
    build_block_summary,
    build_summary,
)
from skymesh.policies import RouteRequest
from skymesh.policies.prefix_tree import PrefixTree
from skymesh.prefix.kv_index import ReplicaBlockIndex, block_keys
from skymesh.prefix.prompt import FallbackTokenizer
from skymesh.util.procs import free_port

BS = 4
TAG = (SKYMESH_KEY, BS)


def toks(n_blocks: int, base: int) -> list[int]:
    return [base + i for i in range(n_blocks * BS)]


def store(idx: ReplicaBlockIndex, ids: list[int], first_hash: int) -> list[int]:
    """Store ``ids``'s blocks as one chain of engine hashes ``first_hash, +1, ...``."""
    n = len(ids) // BS
    hashes = list(range(first_hash, first_hash + n))
    idx.stored(hashes, None, ids, BS)
    return hashes


# -- the sender: walking an index ---------------------------------------------------------
def test_hot_runs_give_recent_blocks_first_with_their_ancestors_and_skip_holes() -> None:
    idx = ReplicaBlockIndex()
    a, b = toks(6, 1000), toks(3, 5000)
    ka, kb = block_keys(a, BS), block_keys(b, BS)
    store(idx, a, 100)
    store(idx, b, 200)
    # a child of a's 3rd block, stored last: the hottest run, then a's other blocks
    idx.stored([300], 102, toks(1, 9000), BS)
    kc = idx._by_engine[300]
    runs = list(idx.hot_runs())
    assert runs[0] == [(kc, 4), (ka[2], 3), (ka[1], 2), (ka[0], 1)]
    assert runs[1] == [(kb[2], 3), (kb[1], 2), (kb[0], 1)]
    assert runs[2] == [(ka[5], 6), (ka[4], 5), (ka[3], 4)]  # only what was not given yet
    assert sum(len(r) for r in runs) == len(idx)
    # An evicted ancestor leaves its descendants out: the engine cannot reuse them.
    idx.removed([101])
    assert {k for r in idx.hot_runs() for k, _d in r} == {ka[0], *kb}


def test_a_parent_cycle_from_a_hash_collision_ends_the_walk() -> None:
    idx = ReplicaBlockIndex()
    ka = block_keys(toks(2, 1), BS)
    store(idx, toks(2, 1), 10)
    idx._parent[ka[0]] = ka[1]  # what colliding keys could make: a loop of parents
    assert list(idx.hot_runs()) == []


def test_block_summary_samples_the_ladder_most_recent_first_within_the_bound() -> None:
    idx = ReplicaBlockIndex()
    old, new = toks(40, 10_000), toks(20, 20_000)
    store(idx, old, 1000)
    store(idx, new, 2000)
    ko, kn = block_keys(old, BS), block_keys(new, BS)
    got = build_block_summary([idx], depths=(1, 2, 4, 8, 16, 32))
    # newest chain first, each chain deepest ladder key first
    assert got == [kn[15], kn[7], kn[3], kn[1], kn[0], ko[31], ko[15], ko[7], ko[3], ko[1],
                   ko[0]]
    assert build_block_summary([idx], max_keys=3, depths=(1, 2, 4, 8, 16, 32)) == got[:3]
    assert build_block_summary([idx], max_keys=0) == []
    # The default ladder reaches 4096 blocks.
    assert BLOCK_DEPTHS[-1] == 4096 and set(DEFAULT_DEPTHS) < set(BLOCK_DEPTHS)


def test_block_summary_takes_the_replicas_in_turn_and_shares_common_blocks() -> None:
    r1, r2 = ReplicaBlockIndex(), ReplicaBlockIndex()
    shared, x, y = toks(2, 1), toks(4, 100), toks(4, 200)
    store(r1, shared, 10)
    store(r2, shared, 10)
    store(r1, x, 20)
    store(r2, y, 30)
    kx, ky, ks = block_keys(x, BS), block_keys(y, BS), block_keys(shared, BS)
    got = build_block_summary([r1, r2], depths=(1, 2, 4))
    assert got == [kx[3], kx[1], kx[0], ky[3], ky[1], ky[0], ks[1], ks[0]]


def test_an_evicted_or_cleared_block_is_absent_from_the_next_summary() -> None:
    idx = ReplicaBlockIndex(max_blocks=8)
    a, b = toks(4, 1), toks(4, 100)
    ka, kb = block_keys(a, BS), block_keys(b, BS)
    hashes = store(idx, a, 10)
    idx.removed(hashes[3:])  # the engine evicted a's last block
    assert ka[3] not in build_block_summary([idx], depths=(1, 2, 3, 4))
    assert ka[2] in build_block_summary([idx], depths=(1, 2, 3, 4))
    store(idx, b, 20)
    store(idx, toks(2, 300), 30)  # the cap (8) forgets a's first blocks, oldest stored
    got = build_block_summary([idx], depths=(1, 2, 3, 4))
    assert not set(got) & set(ka) and kb[3] in got
    idx.clear()  # AllBlocksCleared, or a restarted engine
    assert build_block_summary([idx]) == []


# -- the wire ------------------------------------------------------------------------------
def exact_heartbeat(*groups: tuple[str, int, list[ReplicaBlockIndex]]) -> pb.HeartbeatMsg:
    msg = pb.HeartbeatMsg(balancer_id="lb-b")
    msg.prefix.CopyFrom(prefix_summary([[1, 2, 3]], exact=groups))
    return msg


def test_the_exact_summary_crosses_the_wire_tagged_and_an_old_receiver_ignores_it() -> None:
    idx = ReplicaBlockIndex()
    store(idx, toks(8, 1), 10)
    wire = exact_heartbeat((SKYMESH_KEY, BS, [idx])).SerializeToString()
    msg = pb.HeartbeatMsg.FromString(wire)
    [(key, size, keys, depths)] = read_block_summaries(msg.prefix)
    assert (key, size) == TAG and list(depths) == list(BLOCK_DEPTHS)
    assert list(keys) == build_block_summary([idx])
    # A receiver built from the proto before the field reads the text summary alone.
    old = _old_prefix_summary_class()
    parsed = old.FromString(msg.prefix.SerializeToString())
    assert list(parsed.keys) == list(msg.prefix.keys) == [3, 2, 1]
    # An empty index still sends its tag: "holds nothing" is news.
    idx.clear()
    [(_k, _s, keys, _d)] = read_block_summaries(
        exact_heartbeat((SKYMESH_KEY, BS, [idx])).prefix)
    assert list(keys) == []


def _old_prefix_summary_class() -> type:
    fd = descriptor_pb2.FileDescriptorProto(name="old_peering.proto", package="old.v1",
                                            syntax="proto3")
    m = fd.message_type.add(name="PrefixSummary")
    f = descriptor_pb2.FieldDescriptorProto
    m.field.add(name="keys", number=1, type=f.TYPE_FIXED64, label=f.LABEL_REPEATED)
    m.field.add(name="depths", number=2, type=f.TYPE_UINT32, label=f.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("old.v1.PrefixSummary"))


def test_session_sends_a_changed_exact_summary_and_trims_text_keys_first() -> None:
    now = [0.0]  # a fake clock
    st = PeerState(Identity("us", "lb-a", 1), peers=["lb-b", "lb-c"], clock=lambda: now[0])
    idx = ReplicaBlockIndex()
    store(idx, toks(8, 1), 10)
    paths = [list(range(i * 1000 + 1, i * 1000 + 40)) for i in range(100)]

    def local(include_prefix: bool) -> pb.HeartbeatMsg:
        msg = pb.HeartbeatMsg()
        if include_prefix:
            msg.prefix.CopyFrom(prefix_summary(paths,
                                               exact=[(SKYMESH_KEY, BS, [idx])]))
        return msg

    s = HeartbeatSession(st, "lb-b", local, summary_interval=1.0, summary_refresh=60.0)
    first = s.outgoing()
    assert len(first.prefix.blocks[0].keys) == 6  # depths 1, 2, 3, 4, 6, 8 of 8 blocks
    now[0] += 1.0
    assert not s.outgoing().HasField("prefix")  # unchanged
    idx.clear()
    now[0] += 1.0
    again = s.outgoing()  # only the exact part changed: sent
    assert again.HasField("prefix") and list(again.prefix.blocks[0].keys) == []
    # Over the bound, the text keys go first; the exact summary stays whole.
    store(idx, toks(8, 1), 10)
    tight = HeartbeatSession(st, "lb-c", local, max_bytes=1024)
    out = tight.outgoing()
    assert out.ByteSize() <= 1024 and len(out.prefix.blocks[0].keys) == 6
    assert 0 < len(out.prefix.keys) < len(build_summary(paths)) == 512


# -- the receiver ------------------------------------------------------------------------
def text_keys(n: int) -> tuple[int, ...]:
    return tuple(range(7000, 7000 + n))


def snapshot_with(peer: str, idx: ReplicaBlockIndex, tag: tuple[str, int] = TAG
                  ) -> PeerSnapshot:
    snap = PeerSnapshot()
    snap.insert_block_summaries(peer, [(tag[0], tag[1], build_block_summary([idx]),
                                        BLOCK_DEPTHS)])
    return snap


def test_block_probe_in_text_units_and_it_overrides_what_else_we_know_of_the_peer() -> None:
    idx = ReplicaBlockIndex()
    ids = toks(10, 1)
    store(idx, ids[: 8 * BS], 10)  # lb-b's engines hold 8 of the prompt's 10 blocks
    snap = snapshot_with("lb-b", idx)
    keys = text_keys(20)
    blocks = {TAG: block_keys(ids, BS)}
    # ladder: 8 blocks matched, of 10 -> 16 of the request's 20 text keys
    assert snap.depths(keys, ["lb-b"], blocks) == {"lb-b": 16}
    # We forwarded the whole prompt to lb-b and lb-c, and lb-b's text summary says all:
    # for lb-b its exact summary wins; lb-c (no exact summary) keeps its trie depth.
    snap.insert(keys, "lb-b")
    snap.insert(keys[:5], "lb-c")
    snap.insert_summary("lb-b", build_summary([keys]))
    assert snap.depths(keys, ["lb-b", "lb-c"], blocks) == {"lb-b": 16, "lb-c": 5}
    assert snap.match(keys, ["lb-b", "lb-c"], blocks) == (16, ("lb-b",))
    # Without block keys (or for another tag) the text view answers, as before.
    assert snap.depths(keys, ["lb-b"]) == {"lb-b": 20}
    assert snap.depths(keys, ["lb-b"], {("other", BS): block_keys(ids, BS)}) == {"lb-b": 20}
    assert snap.depths(keys, ["lb-b"], {(SKYMESH_KEY, 8): block_keys(ids, 8)}) == {"lb-b": 20}
    # The engines cleared: the next summary is empty, and lb-b holds nothing.
    idx.clear()
    snap.insert_block_summaries("lb-b", [(SKYMESH_KEY, BS, build_block_summary([idx]),
                                          BLOCK_DEPTHS)])
    assert snap.exact_of("lb-b") == {TAG: 0}
    assert snap.depths(keys, ["lb-b", "lb-c"], blocks) == {"lb-c": 5}
    # A summary without blocks (an old peer, or its events went stale) drops the exact
    # view: the text view speaks for lb-b again.
    snap.insert_block_summaries("lb-b", [])
    assert snap.exact_of("lb-b") == {}
    assert snap.depths(keys, ["lb-b"], blocks) == {"lb-b": 20}
    snap.insert_block_summaries("lb-b", [(SKYMESH_KEY, BS, [1], BLOCK_DEPTHS)])
    snap.retain(["lb-c"])
    assert snap.exact_of("lb-b") == {} and snap.targets() == ["lb-c"]


def test_mixed_old_and_new_peers_under_the_peer_policy() -> None:
    """lb-old predates exact summaries (its trie's text summary says it holds the
    prompt: it did, before its engines evicted it); lb-new's engines hold it now."""
    idx = ReplicaBlockIndex()
    ids = toks(12, 1)  # 12 blocks: on the ladder, so the exact match is whole
    store(idx, ids, 10)
    keys = text_keys(20)  # lb-old's text summary: 16 of them (the ladder under 20)
    policy = PrefixTree(rng=random.Random(0))
    snap = policy.trie = snapshot_with("lb-new", idx)
    snap.insert_summary("lb-old", build_summary([keys]))
    snap.insert_summary("lb-new", build_summary([text_keys(3)]))
    peers = ["lb-old", "lb-new"]
    view = View().set(**{"lb-old": 0, "lb-new": 5})
    with_blocks = RouteRequest("r", prefix_keys=keys, block_keys={TAG: block_keys(ids, BS)})
    assert policy.select(with_blocks, peers, view) == "lb-new"
    assert policy.preferred(with_blocks, peers, view) == "lb-new"
    # A request without block keys (no live events here): the text summaries, as today.
    plain = RouteRequest("r", prefix_keys=keys)
    assert policy.select(plain, peers, view) == "lb-old"
    assert policy.preferred(plain, peers, view) == "lb-old"


# -- the balancer's side: what is summarised, and the keys kept on the request -------------
async def test_exact_groups_need_every_replica_of_a_key_live_and_keys_stay_on_route() -> None:
    clock = [10.0]
    feeds = KVFeeds(KVEventsConfig(heartbeat_s=60.0, stale_after_s=5.0),
                    clock=lambda: clock[0])
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    feeds.set_replicas([ReplicaConfig.model_validate(
        {"url": u, "kind": "skymesh",
         "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}}) for u in urls])
    tok = FallbackTokenizer()
    scorer = ExactScorer(feeds, load_tokenizer=lambda: tok)
    try:
        for u in urls:
            feeds._subs[u][1].last_heard = clock[0]
        assert feeds.exact_groups() == []  # live, but no block seen: no block size yet
        ia, ib = feeds.index(urls[0]), feeds.index(urls[1])
        assert ia is not None and ib is not None
        store(ia, toks(2, 1), 10)
        assert feeds.exact_groups() == [(SKYMESH_KEY, BS, [ia])]
        feeds._subs[urls[1]][1].last_heard = clock[0] - 30  # b's events stale
        assert feeds.exact_groups() == []  # part of the cache unknown: the trie's summary
        feeds._subs[urls[1]][1].last_heard = clock[0]

        body = b'{"model": "m", "messages": [{"role": "user", "content": "' + \
            b" ".join(b"word%d" % i for i in range(60)) + b'"}]}'
        intake = parse_request("chat", body, {})
        await scorer.annotate(RouteRequest("r"), intake)  # starts the tokenizer load
        await scorer.loaded()
        route = await scorer.annotate(RouteRequest("r"), intake)
        ids = tok.encode(intake.prompt_text)
        assert route.block_keys == {TAG: block_keys(ids, BS)}
        assert len(route.block_keys[TAG]) == route.exact_blocks > 0
    finally:
        await feeds.stop()
