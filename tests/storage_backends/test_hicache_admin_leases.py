"""Read leases on the data path of `hicache-server` (protocol 6): a record located for a read in
place (`shm_locate`) is neither evicted nor reused until its reader releases it
(`shm_release`), detaches, or the lease expires (`--read-lease-ms`). A slow reader (a raw
client holding a location) under eviction and overwrites: its bytes stay the record it located,
nothing leaks once the lease ends, and the backend releases what it locates."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hicache_client.remote import protocol as P
from hicache_client.remote.store import StoreMap
from tests.storage_backends.conftest import buffers, make_codec, make_keys
from tests.storage_backends.hicache_server_proc import HiCacheServerProc, RawClient

REC = 4096
CAPACITY = str(4 * REC)  # four records


def records(n: int, salt: int, version: int = 0) -> tuple[list[str], list[bytearray]]:
    codec = make_codec(REC - 128)
    keys = make_keys(n, salt=salt)
    return keys, [codec.encode(k, bytes([(i + version * 50) % 251 + 1]) * codec.payload_bytes)
                  for i, k in enumerate(keys)]


def stats(raw: RawClient) -> dict[str, int]:
    r = raw.call(P.StatsRequest())
    assert isinstance(r, P.StatsReply)
    return r.stats


def locate(raw: RawClient, arena_id: int, keys: list[str]) -> P.ShmLocateReply:
    r = raw.call(P.ShmLocateRequest(arena_id=arena_id, keys=keys))
    assert isinstance(r, P.ShmLocateReply)
    return r


def no_leak(s: dict[str, Any], pages: int) -> None:
    """Every arena slot is a page the store holds or a client's reservation for its next
    writes (none kept for a reader, none lost)."""
    assert s["read_leases"] == 0 and s["read_lease_held_slots"] == 0
    assert s["pages"] == pages and s["bytes"] == pages * REC
    assert s["arena_slots"] == pages + s["reserved_slots"]
    assert s["arena_bytes"] == (pages + s["reserved_slots"]) * REC


def test_a_slow_reader_keeps_its_record_until_it_releases_it(tmp_path: Path) -> None:
    srv = HiCacheServerProc(tmp_path, capacity=CAPACITY).start()
    b = srv.client()
    reader, other = RawClient(srv.url), RawClient(srv.url)
    try:
        keys, recs = records(4, salt=1)
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 4
        m = reader.call(P.MapStoreRequest())
        assert isinstance(m, P.MapStoreReply)
        store = StoreMap(m.name, m.size, m.arena_id)
        loc = locate(reader, m.arena_id, keys[:2])  # the reader is slow: it copies later
        assert stats(reader)["read_leases"] == 2
        # Capacity pressure: four new records evict the two unleased ones and two of their
        # own, never the leased pair.
        new_keys, new_recs = records(4, salt=2)
        assert b.batch_set(new_keys, [memoryview(r) for r in new_recs]) == [True] * 4
        assert b.batch_exists(keys[:2]) == 2
        assert [b.batch_exists([k]) for k in keys[2:]] == [0, 0]
        assert b.batch_exists(new_keys[2:]) == 2 and b.batch_exists(new_keys[:2]) == 0
        # An overwrite of a leased key: readers from now on get the new value; the slow
        # reader's slot is not reused, so its copy is still the record it located, whole.
        _, newer = records(2, salt=1, version=1)
        assert b.batch_set(keys[:1], [memoryview(newer[0])]) == [True]
        s = stats(reader)
        assert s["read_lease_held_slots"] == 1 and s["read_leases"] == 2
        dst = memoryview(bytearray(REC))
        for i in range(2):
            assert store.read(loc.offsets[i], REC, loc.gens[i], dst)
            assert bytes(dst) == bytes(recs[i])
        out = buffers(1, REC)
        assert b.batch_get(keys[:1], out) == [True] and bytes(out[0]) == bytes(newer[0])
        # A release by another connection ends nothing; the reader's own ends both.
        r = other.call(P.ShmReleaseRequest(arena_id=m.arena_id, offsets=loc.offsets))
        assert isinstance(r, P.ShmReleaseReply) and r.released == 0
        r = reader.call(P.ShmReleaseRequest(arena_id=m.arena_id, offsets=loc.offsets))
        assert isinstance(r, P.ShmReleaseReply) and r.released == 2
        assert not store.read(loc.offsets[0], REC, loc.gens[0], dst)  # the old slot is freed
        s = stats(reader)
        no_leak(s, pages=4)
        # (the third: the backend's own read of the new value, released after its copy)
        assert s["read_leases_released"] == 3 and s["read_lease_deferred_frees"] == 1
        # Released, the records are evicted like any others.
        more_keys, more = records(4, salt=3)
        assert b.batch_set(more_keys, [memoryview(r) for r in more]) == [True] * 4
        assert b.batch_exists(keys[:1]) == 0 and b.batch_exists(keys[1:2]) == 0
        no_leak(stats(reader), pages=4)
        store.close()
    finally:
        reader.close()
        other.close()
        b.close()
        srv.stop()


def test_a_lease_expires_and_a_full_store_refuses_rather_than_evict(tmp_path: Path) -> None:
    srv = HiCacheServerProc(tmp_path, capacity=CAPACITY, args=["--read-lease-ms", "300"]).start()
    b = srv.client()
    reader = RawClient(srv.url)
    try:
        keys, recs = records(4, salt=4)
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 4
        m = reader.call(P.MapStoreRequest())
        assert isinstance(m, P.MapStoreReply)
        loc = locate(reader, m.arena_id, keys)  # every page leased: nothing may be evicted
        new_keys, new_recs = records(1, salt=5)
        assert b.batch_set(new_keys, [memoryview(new_recs[0])]) == [False]
        assert b.server_stats()["rejected"] == 1
        assert b.batch_exists(keys) == 4
        b.delete(keys[:1])  # deleted under the lease: out of the map, its slot kept
        assert b.server_stats()["read_lease_held_slots"] == 1
        deadline = time.monotonic() + 30  # the lease is 0.3 s; bounded wait
        while time.monotonic() < deadline and stats(reader)["read_leases"]:
            time.sleep(0.1)
        s = stats(reader)
        assert s["read_leases_expired"] == 4 and s["read_leases_released"] == 0
        no_leak(s, pages=3)
        store = StoreMap(m.name, m.size, m.arena_id)
        assert not store.read(loc.offsets[0], REC, loc.gens[0], memoryview(bytearray(REC)))
        store.close()
        assert b.batch_set(new_keys, [memoryview(new_recs[0])]) == [True]
    finally:
        reader.close()
        b.close()
        srv.stop()


def test_the_backend_releases_what_it_reads_in_place(tmp_path: Path) -> None:
    srv = HiCacheServerProc(tmp_path, capacity=CAPACITY).start()
    b = srv.client()
    try:
        keys, recs = records(3, salt=6)
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 3
        out = buffers(3, REC)
        assert b.batch_get(keys, out) == [True] * 3
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
        assert b.arena.reads == 3
        # The release went on the same connection before this request: already counted.
        s = b.server_stats()
        assert s["read_leases"] == 0 and s["read_leases_released"] == 3
        no_leak(s, pages=3)
        # A detached connection's leases end with it.
        reader = RawClient(srv.url)
        m = reader.call(P.MapStoreRequest())
        assert isinstance(m, P.MapStoreReply)
        locate(reader, m.arena_id, keys)
        assert stats(reader)["read_leases"] == 3
        assert isinstance(reader.call(P.DetachShmRequest()), P.DetachShmReply)
        assert stats(reader)["read_leases"] == 0
        reader.close()
    finally:
        b.close()
        srv.stop()
