"""Writes into the server's shared-memory store (protocol v4): a same-host client copies each
record straight into an arena slot the server reserved for it (`shm_reserve`), then the server
stores the slots (`shm_commit`). In-process: the reservation book (per connection, per key,
expiry, a share per connection) and the client's generation check before writing. Against a
real `hicache-server`: a record is invisible until committed, only its own connection commits a
reservation and only under its key, once; a detached connection's reservations are freed; a
server without a store, or that does not know the request, is written through the region."""

from __future__ import annotations

from pathlib import Path

from hicache_client.remote import protocol as P
from hicache_client.remote.store import StoreMap
from storage_backends.server.arena import BLOCK, Arena
from storage_backends.server.reservations import Reservations
from storage_backends.server.store import PageStore
from tests.storage_backends.hicache_server_proc import (
    OldProtocolServer,
    RawClient,
    hicache_server,
    pages,
)

PAYLOAD = (64 << 10) - 128  # 64 KiB records: 16 blocks each


def _book(blocks: int, per_conn: int, ttl_s: float = 30.0) -> tuple[Arena, PageStore, Reservations]:
    arena = Arena(blocks * BLOCK)
    store = PageStore(0, arena)
    return arena, store, Reservations(store.reserve, store.free, per_conn, ttl_s)


# -- in-process --------------------------------------------------------------------------------


def test_reservations_are_per_connection_and_bounded() -> None:
    arena, store, book = _book(16, per_conn=8 * BLOCK)
    try:
        a = book.reserve(b"A", [3 * BLOCK, 4 * BLOCK, 2 * BLOCK, 1], 1 << 20)
        # the third would take the connection past its 8 blocks; the fourth (1 byte: one
        # block) still fits
        assert [s is not None for s in a] == [True, True, False, True]
        assert book.reserve(b"A", [1], 1 << 20) == [None]  # 8 blocks held already
        # lengths the store does not take: empty, over the largest record
        assert book.reserve(b"B", [0, 2 * BLOCK], BLOCK) == [None, None]
        assert book.slots == 3 and arena.counters["arena_slots"] == 3
        s1 = a[0]
        assert s1 is not None
        assert book.take(b"B", s1.offset) is None  # another connection's
        assert book.take(b"A", s1.offset + BLOCK) is None  # not a reservation's start
        assert book.take(b"A", s1.offset) is s1
        assert book.take(b"A", s1.offset) is None  # once
        assert book.slots == 2
        assert store.put("k1", s1) == (True, [])
        assert store.view(store.get(["k1"])[0]).nbytes == 3 * BLOCK
        # Its blocks are B's to reserve again only after A gives them back.
        assert book.drop(b"A") == 2 and book.slots == 0
        assert arena.counters["arena_slots"] == 1  # k1, stored
    finally:
        arena.close()


def test_a_slot_the_store_refuses_is_freed() -> None:
    arena = Arena(8 * BLOCK)
    store = PageStore(2 * BLOCK, arena)  # holds no record over two blocks
    try:
        slot = store.reserve(3 * BLOCK)
        assert slot is not None and arena.counters["arena_slots"] == 1
        gen = slot.gen
        assert store.put("big", slot) == (False, [])
        assert arena.counters["arena_slots"] == 0 and arena.gen_of(slot.offset) != gen
        assert store.counters.rejected == 1 and store.pages == 0
    finally:
        arena.close()


def test_an_expired_reservation_is_freed_and_its_generation_changes() -> None:
    arena, _store, book = _book(8, per_conn=8 * BLOCK, ttl_s=5.0)
    try:
        (slot,) = book.reserve(b"A", [100], 1 << 20)
        assert slot is not None
        gen = slot.gen
        assert book.expire() == 0  # not yet
        m = StoreMap(arena.name, arena.size, arena.id)
        assert m.write(slot.offset, gen, memoryview(b"x" * 100))
        assert book.expire(now=1e12) == 1
        assert book.counters == {"reserved_slots": 0, "reserve_expired": 1}
        assert book.take(b"A", slot.offset) is None  # a late commit stores nothing
        # The blocks go to another record: the late writer finds a new generation, writes
        # nothing.
        other = arena.store(memoryview(b"y" * 100))
        assert other is not None and other.offset == slot.offset
        assert not m.write(slot.offset, gen, memoryview(b"x" * 100))
        assert bytes(arena.view(other)) == b"y" * 100
        # Outside the data or not at a block start: refused.
        for off in (arena.data_start - BLOCK, slot.offset + 1, arena.size):
            assert not m.write(off, other.gen, memoryview(b"z"))
        m.close()
    finally:
        arena.close()


# -- against a real server ---------------------------------------------------------------------


def _map(raw: RawClient) -> tuple[P.MapStoreReply, StoreMap]:
    m = raw.call(P.MapStoreRequest())
    assert isinstance(m, P.MapStoreReply)
    return m, StoreMap(m.name, m.size, m.arena_id)


def _reserve(raw: RawClient, arena_id: int, lengths: list[int]) -> P.Message:
    r = raw.call(P.ShmReserveRequest(arena_id=arena_id, lengths=lengths))
    assert r is not None
    return r


def _commit(raw: RawClient, arena_id: int, keys: list[str], offsets: list[int],
            reserve: list[int] | None = None) -> P.ShmCommitReply:
    r = raw.call(P.ShmCommitRequest(arena_id=arena_id, keys=keys, offsets=offsets,
                                    reserve=reserve or []))
    assert isinstance(r, P.ShmCommitReply), r
    return r


def test_reserve_write_commit(tmp_path: Path) -> None:
    keys, recs = pages("w", 5, PAYLOAD)
    n = len(recs[0])
    with hicache_server(tmp_path) as srv:
        a, other = RawClient(srv.url), RawClient(srv.url)
        try:
            m, store = _map(a)
            r = _reserve(a, m.arena_id, [n, n, n, 0])
            assert isinstance(r, P.ShmReserveReply) and r.expires_ms == 30000
            assert [o >= 0 for o in r.offsets] == [True, True, True, False]
            for off, gen, rec in zip(r.offsets, r.gens, recs[:3]):
                assert store.write(off, gen, memoryview(rec))
            # Reserved and written, not committed: no reader is told of them.
            assert a.call(P.ExistsRequest(keys=keys)) == P.ExistsReply(request_id=a.rid, count=0)
            assert a.stats()["reserved_slots"] == 3
            # Another connection cannot commit them, nor this one a place it did not reserve.
            assert _commit(other, m.arena_id, keys[:1], r.offsets[:1]).stored == [False]
            assert _commit(a, m.arena_id, keys[:1], [r.offsets[0] + BLOCK]).stored == [False]
            # The commit reserves room for the next batch in the same round trip.
            done = _commit(a, m.arena_id, keys[:3], r.offsets[:3], reserve=[n, n])
            assert done.stored == [True] * 3 and min(done.offsets) >= 0
            assert _commit(a, m.arena_id, keys[:1], r.offsets[:1]).stored == [False]  # once
            # Any client reads what was written, exactly.
            assert other.get(keys[:3]) == [bytes(x) for x in recs[:3]]
            st = a.stats()
            assert (st["pages"], st["arena_slots"], st["reserved_slots"]) == (3, 5, 2)
            assert (st["store_page_bytes_in"], st["shm_page_bytes_in"]) == (3 * n, 0)
            for off, gen, rec in zip(done.offsets, done.gens, recs[3:]):
                assert store.write(off, gen, memoryview(rec))
            assert _commit(a, m.arena_id, keys[3:], done.offsets).stored == [True] * 2
            assert other.get(keys) == [bytes(x) for x in recs]
            # A stale arena id is refused (the server restarted: map again).
            for req in (P.ShmReserveRequest(arena_id=m.arena_id + 2, lengths=[1]),
                        P.ShmCommitRequest(arena_id=m.arena_id + 2, keys=["x"], offsets=[0])):
                e = a.call(req)
                assert isinstance(e, P.ErrorReply) and e.code == P.ErrorCode.NO_SHM
            # A record over the frame limit gets no slot.
            pong = a.call(P.PingRequest())
            assert isinstance(pong, P.PingReply)
            big = _reserve(a, m.arena_id, [pong.max_frame_bytes + 1])
            assert isinstance(big, P.ShmReserveReply) and big.offsets == [-1]
            store.close()
        finally:
            a.close()
            other.close()


def test_a_slot_committed_unwritten_is_never_its_old_record(tmp_path: Path) -> None:
    """A (buggy) client that commits a slot it did not write must not resurrect the record
    that had those blocks before: every slot handed out starts cleared, so the record fails its
    check (a counted miss)."""
    (key,), (rec,) = pages("unwritten", 1, PAYLOAD)
    with hicache_server(tmp_path) as srv:
        raw, b = RawClient(srv.url), srv.client()
        try:
            m, store = _map(raw)
            r = _reserve(raw, m.arena_id, [len(rec)])
            assert isinstance(r, P.ShmReserveReply)
            assert store.write(r.offsets[0], r.gens[0], memoryview(rec))
            assert _commit(raw, m.arena_id, [key], r.offsets).stored == [True]
            b.delete([key])  # its blocks are free again, its bytes still there
            again = _reserve(raw, m.arena_id, [len(rec)])
            assert isinstance(again, P.ShmReserveReply) and again.offsets == r.offsets
            assert _commit(raw, m.arena_id, [key], again.offsets).stored == [True]
            out = memoryview(bytearray(len(rec)))
            assert b.batch_get([key], [out]) == [False]
            assert b.stats().corrupt_pages == 1
            store.close()
        finally:
            raw.close()
            b.close()


def test_a_detached_connection_gives_its_reservations_back(tmp_path: Path) -> None:
    with hicache_server(tmp_path) as srv:
        raw = RawClient(srv.url)
        try:
            m, store = _map(raw)
            r = _reserve(raw, m.arena_id, [BLOCK, BLOCK])
            assert isinstance(r, P.ShmReserveReply) and min(r.offsets) >= 0
            assert raw.stats()["reserved_slots"] == 2
            assert isinstance(raw.call(P.DetachShmRequest()), P.DetachShmReply)
            st = raw.stats()
            assert (st["reserved_slots"], st["arena_slots"]) == (0, 0)
            assert _commit(raw, m.arena_id, ["a"], r.offsets[:1]).stored == [False]
            store.close()
        finally:
            raw.close()


def test_the_client_reserves_once_and_then_with_each_commit(tmp_path: Path) -> None:
    """Batches of alike records: the first batch reserves (a round trip), every later one uses
    the room its predecessor's commit reserved; the records are all written in place."""
    keys, recs = pages("ahead", 12, PAYLOAD)
    with hicache_server(tmp_path) as srv:
        b = srv.client()
        assert b.batch_set(keys[:4], [memoryview(r) for r in recs[:4]]) == [True] * 4
        before = b.server_stats()["requests"]
        for i in (4, 8):  # one request each: the commit
            assert b.batch_set(keys[i:i + 4], [memoryview(r) for r in recs[i:i + 4]]) == [True] * 4
        st = b.server_stats()
        assert st["requests"] - before == 2 + 1  # two commits, and this stats request
        assert (b.arena.writes, b.arena.write_fallbacks) == (12, 0)
        assert (st["pages"], st["reserved_slots"], st["shm_page_bytes_in"]) == (12, 4, 0)
        assert st["store_page_bytes_in"] == 12 * len(recs[0])
        out = [memoryview(bytearray(len(r))) for r in recs]
        assert b.batch_get(keys, out) == [True] * 12 and [bytes(o) for o in out] == recs
        b.close()
        # Closing detaches: the reservations held for a next batch are given back.
        raw = RawClient(srv.url)
        try:
            assert raw.stats()["reserved_slots"] == 0
        finally:
            raw.close()


def test_without_a_store_sets_go_through_the_region(tmp_path: Path) -> None:
    keys, recs = pages("nostore", 4, PAYLOAD)
    with hicache_server(tmp_path, args=["--shm-store-bytes", "0"]) as srv:
        raw = RawClient(srv.url)
        try:
            e = _reserve(raw, 1, [1])
            assert isinstance(e, P.ErrorReply) and e.code == P.ErrorCode.NO_SHM
        finally:
            raw.close()
        b = srv.client()
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 4
        assert (b.arena.writes, b.arena.write_fallbacks) == (0, 0)
        st = b.server_stats()
        assert (st["shm_page_bytes_in"], st["store_page_bytes_in"]) == (4 * len(recs[0]), 0)
        out = [memoryview(bytearray(len(r))) for r in recs]
        assert b.batch_get(keys, out) == [True] * 4 and [bytes(o) for o in out] == recs
        b.close()


def test_new_client_on_a_version_3_server_writes_through_the_region(tmp_path: Path) -> None:
    keys, recs = pages("v3", 6, PAYLOAD)
    srv = OldProtocolServer(tmp_path, (1, 2, 3)).start()
    try:
        b = srv.client()
        assert b.batch_set(keys[:3], [memoryview(r) for r in recs[:3]]) == [True] * 3
        assert b.arena.writes_wanted is False  # asked once, refused: not asked again
        assert b.batch_set(keys[3:], [memoryview(r) for r in recs[3:]]) == [True] * 3
        st = b.server_stats()
        assert (st["shm_page_bytes_in"], st["store_page_bytes_in"]) == (6 * len(recs[0]), 0)
        # The store's reservation, and the client's namespace (protocol 6), each asked once.
        assert st["error_replies"] == 2
        out = [memoryview(bytearray(len(r))) for r in recs]
        assert b.batch_get(keys, out) == [True] * 6 and [bytes(o) for o in out] == recs
        assert (b.arena.reads, b.stats().errors) == (6, 0)  # reads in place still
        b.close()
    finally:
        srv.stop()
