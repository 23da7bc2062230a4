"""Peering logic without sockets: versioning, liveness and RTT (fake clock), heartbeat
sessions (summary cadence, byte bound), prefix summaries, certificates, code generation."""

from __future__ import annotations

import random
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

import skymesh.mesh as mesh
from skymesh.cli import main as cli_main
from skymesh.mesh import certs, codegen
from skymesh.mesh.heartbeat import HeartbeatSession, HeartbeatTooLarge, WrongPeer, prefix_summary
from skymesh.mesh.proto import pb
from skymesh.mesh.state import Identity, Liveness, PeerState, Verdict
from skymesh.mesh.summary import DEFAULT_DEPTHS, PeerSnapshot, build_summary
from skymesh.prefix import PrefixTrie

_M64 = (1 << 64) - 1
INTERVAL = 0.2


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def chain(seq: list[int]) -> list[int]:
    """Chained keys: key i stands for the prefix seq[: i + 1]."""
    out, h = [], 0
    for x in seq:
        h = hash((h, x)) & _M64
        out.append(h)
    return out


def beat(sender: str = "lb-b", epoch: int = 1, seq: int = 1, *, echo_epoch: int = 0,
         echo_sent_ns: int = 0) -> pb.HeartbeatMsg:
    return pb.HeartbeatMsg(region="eu", balancer_id=sender, epoch=epoch, seq=seq,
                           interval_ms=int(INTERVAL * 1000), echo_epoch=echo_epoch,
                           echo_sent_ns=echo_sent_ns)


def state(clock: FakeClock, me: str = "lb-a", epoch: int = 100) -> PeerState:
    return PeerState(Identity("us", me, epoch), peers=["lb-b"], interval=INTERVAL,
                     clock=clock)


# -- versioning ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "steps"),
    [
        ("in order", [((1, 1), 0, "accepted"), ((1, 2), 0, "accepted"), ((1, 3), 0, "accepted")]),
        ("duplicate", [((1, 5), 0, "accepted"), ((1, 5), 0, "stale")]),
        ("reordered", [((1, 5), 0, "accepted"), ((1, 4), 0, "stale"), ((1, 6), 0, "accepted")]),
        ("restart: newer epoch, seq back at 1",
         [((1, 900), 0, "accepted"), ((2, 1), 0, "accepted"), ((1, 901), 0, "stale")]),
        ("older epoch while alive", [((5, 1), 0, "accepted"), ((4, 99), 0.1, "stale")]),
        # A peer DOWN whose restart got a smaller epoch (clock stepped back) is let in...
        ("older epoch after DOWN", [((5, 1), 0, "accepted"), ((4, 1), 1.0, "accepted")]),
        # ...but an old seq of the same epoch is stale even then.
        ("same epoch after DOWN", [((5, 9), 0, "accepted"), ((5, 3), 1.0, "stale")]),
    ],
)
def test_versioning(name: str, steps: list[tuple[tuple[int, int], float, str]]) -> None:
    clock = FakeClock()
    st = state(clock)
    for (epoch, seq), wait, want in steps:
        clock.advance(wait)
        assert st.observe(beat(epoch=epoch, seq=seq)).value == want, (name, epoch, seq)
    last = st.latest("lb-b")
    accepted = [v for v, _, w in steps if w == "accepted"][-1]
    assert last is not None and (last.epoch, last.seq) == accepted


def test_accepted_state_replaces_whole_and_self_is_ignored() -> None:
    clock = FakeClock()
    st = state(clock)
    m1 = beat(seq=1)
    m1.models.add(model="a", available_replicas=2)
    m1.models.add(model="b", available_replicas=1)
    st.observe(m1)
    m2 = beat(seq=2)
    m2.models.add(model="a", available_replicas=0)
    st.observe(m2)
    assert [m.model for m in st.view("lb-b").models] == ["a"]
    assert st.observe(beat(sender="lb-a", seq=99)) is Verdict.SELF


# -- liveness ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("silence", "want"),
    [(0.0, Liveness.ALIVE), (0.19, Liveness.ALIVE), (0.39, Liveness.ALIVE),
     (0.41, Liveness.SUSPECTED), (0.59, Liveness.SUSPECTED), (0.61, Liveness.DOWN),
     (60.0, Liveness.DOWN)],
)
def test_liveness_by_silence(silence: float, want: Liveness) -> None:
    clock = FakeClock()
    st = state(clock)
    st.observe(beat())
    clock.advance(silence)
    assert st.liveness("lb-b") is want
    assert ("lb-b" in st.usable()) is (want is not Liveness.DOWN)


def test_liveness_cycle_and_transitions() -> None:
    clock = FakeClock()
    st = state(clock)
    assert st.liveness("lb-b") is Liveness.DOWN  # never heard: not a candidate
    assert st.liveness("lb-zz") is Liveness.DOWN
    assert st.transitions() == []
    st.observe(beat(seq=1))
    assert st.transitions() == [("lb-b", Liveness.DOWN, Liveness.ALIVE)]
    clock.advance(0.5)
    assert st.transitions() == [("lb-b", Liveness.ALIVE, Liveness.SUSPECTED)]
    clock.advance(0.2)
    assert st.transitions() == [("lb-b", Liveness.SUSPECTED, Liveness.DOWN)]
    assert st.transitions() == []
    st.observe(beat(seq=2))  # the first good heartbeat brings it back
    assert st.liveness("lb-b") is Liveness.ALIVE
    assert st.transitions() == [("lb-b", Liveness.DOWN, Liveness.ALIVE)]
    st.observe(beat(seq=1))  # a stale one does not refresh liveness
    clock.advance(0.61)
    assert st.liveness("lb-b") is Liveness.DOWN


def test_liveness_uses_the_slower_of_the_two_intervals() -> None:
    clock = FakeClock()
    st = state(clock)
    st.observe(pb.HeartbeatMsg(balancer_id="lb-b", epoch=1, seq=1, interval_ms=1000))
    clock.advance(1.5)  # 7.5 of our intervals, 1.5 of the peer's
    assert st.liveness("lb-b") is Liveness.ALIVE
    clock.advance(1.0)
    assert st.liveness("lb-b") is Liveness.SUSPECTED


def test_parameters_are_validated() -> None:
    ident = Identity("us", "lb-a", 1)
    with pytest.raises(ValueError, match="interval"):
        PeerState(ident, interval=0)
    with pytest.raises(ValueError, match="suspect_after"):
        PeerState(ident, suspect_after=3, down_after=2)
    with pytest.raises(ValueError, match="rtt_alpha"):
        PeerState(ident, rtt_alpha=0)


# -- stamping and RTT ----------------------------------------------------------------------
def test_stamp_and_rtt_from_echo_with_unsynchronised_clocks() -> None:
    ca, cb = FakeClock(1000.0), FakeClock(5.0)  # the two clocks share nothing
    a = PeerState(Identity("us", "lb-a", 100), interval=INTERVAL, clock=ca, rtt_alpha=0.5)
    b = PeerState(Identity("eu", "lb-b", 200), interval=INTERVAL, clock=cb)
    m = a.stamp(pb.HeartbeatMsg(), "lb-b")
    assert (m.region, m.balancer_id, m.epoch, m.seq, m.interval_ms) == ("us", "lb-a", 100, 1, 200)
    assert m.echo_sent_ns == 0  # nothing to echo yet
    ca.advance(0.040)
    cb.advance(0.040)  # one-way 40 ms
    assert b.observe(m) is Verdict.ACCEPTED
    cb.advance(0.010)  # held 10 ms before the reply
    reply = b.stamp(pb.HeartbeatMsg(), "lb-a")
    assert (reply.echo_epoch, reply.echo_seq) == (100, 1)
    assert reply.echo_hold_ns == 10_000_000
    ca.advance(0.050)
    assert a.observe(reply) is Verdict.ACCEPTED
    assert a.rtt_s("lb-b") == pytest.approx(0.080, abs=1e-6)
    # second sample 0.120 -> EMA with alpha 0.5
    m2 = a.stamp(pb.HeartbeatMsg(), "lb-b")
    ca.advance(0.060)
    cb.advance(0.060)
    b.observe(m2)
    reply2 = b.stamp(pb.HeartbeatMsg(), "lb-a")
    ca.advance(0.060)
    a.observe(reply2)
    assert a.rtt_s("lb-b") == pytest.approx(0.100, abs=1e-6)
    assert a.view("lb-b").rtt_s == a.rtt_s("lb-b")
    assert m2.seq == 2


def test_echo_of_a_past_life_is_ignored() -> None:
    clock = FakeClock()
    st = state(clock, epoch=100)
    st.observe(beat(seq=1, echo_epoch=99, echo_sent_ns=int(999.0 * 1e9)))
    assert st.rtt_s("lb-b") is None
    st.observe(beat(seq=2, echo_epoch=100, echo_sent_ns=int(2000.0 * 1e9)))
    assert st.rtt_s("lb-b") is None  # negative: a bogus echo, not a network


# -- heartbeat sessions --------------------------------------------------------------------
def _local(keys: list[int]) -> tuple[list[bool], Callable[[bool], pb.HeartbeatMsg]]:
    asked: list[bool] = []

    def local_summary(include_prefix: bool) -> pb.HeartbeatMsg:
        asked.append(include_prefix)
        msg = pb.HeartbeatMsg()
        msg.models.add(model="llama", available_replicas=1, total_replicas=4, queue_length=2)
        if include_prefix:
            msg.prefix.keys.extend(keys)
            msg.prefix.depths.extend(DEFAULT_DEPTHS)
        return msg

    return asked, local_summary


def test_session_sends_the_summary_when_due_and_changed() -> None:
    clock = FakeClock()
    st = state(clock)
    keys = [1, 2, 3]
    asked, local = _local(keys)
    s = HeartbeatSession(st, "lb-b", local, summary_interval=1.0, summary_refresh=5.0)
    has = []
    for _ in range(30):  # 6 s at 0.2 s
        has.append(s.outgoing().HasField("prefix"))
        clock.advance(0.2)
    assert has[0]  # the first message of a stream carries it
    assert sum(asked) == 6  # built once a second, not per heartbeat
    assert sum(has) == 2  # unchanged: only the first and the 5 s refresh
    keys.append(4)
    has = []
    for _ in range(10):
        has.append(s.outgoing().HasField("prefix"))
        clock.advance(0.2)
    assert sum(has) == 1  # changed: sent at the next due time
    assert s.sent == 40 and s.summaries_sent == 3


def test_session_trims_to_the_bound_and_rejects_oversized() -> None:
    clock = FakeClock()
    st = state(clock)
    _, local = _local(list(range(1, 3000)))
    s = HeartbeatSession(st, "lb-b", local, max_bytes=2048)
    out = s.outgoing()
    assert 1500 < out.ByteSize() <= 2048
    assert list(out.prefix.keys) == list(range(1, len(out.prefix.keys) + 1))  # oldest dropped
    big = beat(seq=1)
    big.prefix.keys.extend(range(1, 1000))
    with pytest.raises(HeartbeatTooLarge) as info:
        s.incoming(big)
    assert info.value.code.name == "RESOURCE_EXHAUSTED"
    assert st.latest("lb-b") is None
    with pytest.raises(WrongPeer):
        s.incoming(beat(sender="lb-c"))
    got: list[pb.HeartbeatMsg] = []
    s.on_heartbeat = got.append
    assert s.incoming(beat(seq=1)) is Verdict.ACCEPTED
    assert s.incoming(beat(seq=1)) is Verdict.STALE
    assert len(got) == 1  # only accepted heartbeats reach the callback


def big_trie(n: int = 100_000, seed: int = 0) -> tuple[PrefixTrie, list[list[int]]]:
    rng = random.Random(seed)
    trie = PrefixTrie(n)
    paths = []
    while len(trie) < n:
        system = rng.randrange(30)
        path = chain([system] * 12 + [rng.randrange(1 << 40) for _ in range(rng.randrange(4, 80))])
        trie.insert(path, f"replica-{rng.randrange(8)}")
        paths.append(path)
    return trie, paths


def test_heartbeat_with_a_100k_node_trie_stays_under_the_bound() -> None:
    trie, paths = big_trie()
    assert len(trie) == 100_000
    clock = FakeClock()
    st = state(clock)

    def local(include_prefix: bool) -> pb.HeartbeatMsg:
        msg = pb.HeartbeatMsg()
        for i in range(8):
            msg.models.add(model=f"meta-llama/Llama-3.1-{i}B-Instruct", available_replicas=3,
                           total_replicas=8, queue_length=12, pending_prefill_tokens=123456,
                           outstanding_requests=4096)
        if include_prefix:
            msg.prefix.CopyFrom(prefix_summary(trie))
        return msg

    s = HeartbeatSession(st, "lb-b", local)
    msg = s.outgoing()
    assert len(msg.prefix.keys) == 512
    assert msg.ByteSize() <= 16 * 1024
    assert len(msg.prefix.SerializeToString()) <= 4 * 1024 + 64
    # and the receiver matches the most recent paths through it
    snap = PeerSnapshot()
    snap.insert_summary("lb-b", msg.prefix.keys, msg.prefix.depths)
    for path in paths[-20:]:
        depth, peers = snap.match(path, ["lb-b"])
        assert peers == ("lb-b",) and depth >= len(path) / 1.5


# -- prefix summaries ----------------------------------------------------------------------
def test_build_summary_from_paths_samples_the_ladder_most_recent_first() -> None:
    p1, p2 = chain(list(range(10))), chain([99, *range(1, 30)])
    keys = build_summary([p2, p1], max_keys=100, depths=(1, 2, 4, 8, 16))
    assert keys == [p2[15], p2[7], p2[3], p2[1], p2[0], p1[7], p1[3], p1[1], p1[0]]
    assert build_summary([p2, p1], max_keys=3, depths=(1, 2, 4, 8, 16)) == keys[:3]
    assert build_summary([p1], max_keys=0) == []


def test_build_summary_from_a_trie_prefers_recent_runs_and_their_ancestors() -> None:
    trie = PrefixTrie()
    system = chain([7] * 8)
    old = chain([7] * 8 + [1] * 8)
    new = chain([7] * 8 + [2] * 24)
    trie.insert(old, "r1")
    trie.insert(new, "r2")
    keys = build_summary(trie, max_keys=5, depths=(1, 2, 4, 8, 16, 32))
    # newest run's ladder keys (depths 16, 32 beyond the shared 8), then the shared part
    assert keys == [new[31], new[15], system[7], system[3], system[1]]
    trie.match(old, ["r1"])  # using the old one makes it the most recent
    assert build_summary(trie, max_keys=1, depths=(1, 2, 4, 8, 16, 32)) == [old[15]]
    # the adapter reads the trie's segments: pin the contract it relies on
    seg = next(iter(trie._segments))
    assert {"keys", "start", "parent", "stamp"} <= set(type(seg).__slots__)


def test_peer_snapshot_combines_forwarded_history_and_summaries() -> None:
    snap = PeerSnapshot()
    a = chain(list(range(40)))
    b = chain([5, *range(1, 40)])
    snap.insert(a[:10], "lb-b")  # we forwarded 10 blocks of a to lb-b
    snap.insert_summary("lb-c", build_summary([a]), DEFAULT_DEPTHS)  # lb-c holds all of a
    assert snap.depths(a, ["lb-b", "lb-c"]) == {"lb-b": 10, "lb-c": 32}  # ladder: 32 <= 40
    assert snap.match(a, ["lb-b", "lb-c"]) == (32, ("lb-c",))
    assert snap.match(a, ["lb-b"]) == (10, ("lb-b",))
    assert snap.depth_groups(a[:8], ["lb-c", "lb-b"]) == [(8, ("lb-c", "lb-b"))]
    assert snap.match(b, ["lb-b", "lb-c"]) == (0, ())
    assert snap.match([], ["lb-c"]) == (0, ())
    # a new summary replaces the old one whole
    snap.insert_summary("lb-c", build_summary([b]))
    assert snap.match(a, ["lb-c"]) == (0, ())
    assert snap.match(b, ["lb-c"])[1] == ("lb-c",)
    assert snap.targets() == ["lb-b", "lb-c"]
    assert snap.size_of("lb-b") == 10
    snap.retain(["lb-b"])
    assert snap.targets() == ["lb-b"] and snap.summary_of("lb-c") == frozenset()
    snap.remove_target("lb-b")
    assert snap.targets() == [] and len(snap) == 0


def test_peer_snapshot_caps_a_summary() -> None:
    snap = PeerSnapshot(max_summary_keys=10)
    snap.insert_summary("lb-b", range(1, 1000))
    assert len(snap.summary_of("lb-b")) == 10


# -- certificates --------------------------------------------------------------------------
def test_certs_ca_and_balancer(tmp_path: Path) -> None:
    crt, key = certs.create_ca(tmp_path)
    files = certs.issue_cert(tmp_path, "lb-us", ips=["127.0.0.1", "10.0.0.5"], dns=["lb.example"])
    for k in (key, files.key):
        assert stat.S_IMODE(k.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "lb-us"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["lb-us", "lb.example"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1",
                                                                          "10.0.0.5"]
    ca = x509.load_pem_x509_certificate(crt.read_bytes())
    cert.verify_directly_issued_by(ca)
    with pytest.raises(certs.CertError, match="already exists"):
        certs.create_ca(tmp_path)
    with pytest.raises(certs.CertError, match="invalid balancer id"):
        certs.issue_cert(tmp_path, "../evil")
    with pytest.raises(certs.CertError, match="no CA"):
        certs.issue_cert(tmp_path / "empty", "lb-eu")


def test_certs_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pki"
    assert cli_main(["certs", "--out", str(out), "--ca", "--name", "lb-us", "--name",
                     "lb-eu"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "ca.key", "lb-eu.crt",
                                                     "lb-eu.key", "lb-us.crt", "lb-us.key"]
    assert cli_main(["certs", "--out", str(out), "--ca"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["certs", "--out", str(out), "--name", "lb-ap"]) == 0
    assert cli_main(["certs", "--out", str(out)]) == 2


# -- package surface and code generation ---------------------------------------------------
def test_public_surface_is_pinned() -> None:
    assert mesh.__all__ == sorted(mesh._EXPORTS)
    for name in mesh.__all__:
        assert getattr(mesh, name) is not None
    with pytest.raises(AttributeError):
        _ = mesh.NoSuchThing


def test_stubs_are_fresh_and_importable_as_a_package() -> None:
    assert codegen.is_fresh()
    assert pb.HeartbeatMsg.__module__ == "skymesh.mesh.gen.skymesh.v1.peering_pb2"
    assert pb.HeartbeatMsg.DESCRIPTOR.full_name == "skymesh.v1.HeartbeatMsg"


def test_model_loads_cross_the_wire_and_an_old_sender_reads_as_unknown() -> None:
    from skymesh.balancer.mesh_link import add_model_loads, read_model_loads
    from skymesh.policies.peers import ModelLoad

    sent = {"a": ModelLoad(2, 4, 1, 512, outstanding=0),
            "b": ModelLoad(0, 3, 7, 0, outstanding=41)}
    msg = pb.HeartbeatMsg()
    add_model_loads(msg, sent)
    back = read_model_loads(pb.HeartbeatMsg.FromString(msg.SerializeToString()))
    assert back == sent  # an idle region's 0 survives as 0, not as "unknown"
    old = pb.HeartbeatMsg()
    old.models.add(model="a", available_replicas=2, total_replicas=4, queue_length=1)
    assert read_model_loads(old)["a"].outstanding is None
