"""Records held in several buffers (`batch_get_parts` / `batch_set_parts`): a record's header in
one buffer and its payload in the regions of a host pool page, read and written without being
assembled. The checks over parts agree with hicache_client.codec byte for byte; the `StorageBackend`
default (through a temporary per record) on the in-process `memory` backend; then the `hicache`
client against a real server: one copy each way through the server's store, a bad record judged
on its header before its payload is copied, a copy that raced a free sent the other way, the
region and TCP paths, repeated keys, a dead server, and exact counters throughout."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hicache.memory_backend import MemoryBackend
from hicache_client.backend import StorageBackend, StorageConfig
from hicache_client.codec import (
    HEADER_BYTES,
    PageCodec,
    RecordHeader,
    encode_record_header,
    verify_copied_parts,
    verify_record,
    verify_record_head,
    verify_record_parts,
)
from hicache_client.errors import StorageCorrupt
from hicache_client.remote import backend as hicache_backend
from hicache_client.remote import protocol as P
from hicache_client.remote.store import StoreMap
from storage_backends.server.arena import BLOCK, Arena
from tests.hicache.test_codec import V1_KEY, V1_RECORD
from tests.storage_backends.hicache_server_proc import (
    NAMESPACE,
    RawClient,
    codec,
    hicache_server,
    page_record,
    pages,
)

PAYLOAD = (64 << 10) - 128  # 64 KiB records
QUARTER = PAYLOAD // 4
# How a caller may cut a record: a header buffer then page regions (the plugin's shape), the
# header itself cut across buffers, and the whole record in one buffer.
SHAPES = {
    "head+4": [HEADER_BYTES, QUARTER, QUARTER, QUARTER, PAYLOAD - 3 * QUARTER],
    "cut-head": [64, 100, PAYLOAD - 36],
    "one": [HEADER_BYTES + PAYLOAD],
}
FILL = 0xA5  # what parts hold before a read: a part still all FILL was not written
REGION_ONLY = ["--shm-store-bytes", "0"]


def _parts(sizes: Sequence[int]) -> list[memoryview]:
    return [memoryview(bytearray([FILL]) * n) for n in sizes]


def _split(rec: bytes | bytearray, sizes: Sequence[int]) -> list[memoryview]:
    """`rec` copied into fresh parts of `sizes`."""
    out, off = [], 0
    for n in sizes:
        out.append(memoryview(bytearray(rec[off : off + n])))
        off += n
    assert off == len(rec)
    return out


def _joined(parts: Sequence[memoryview]) -> bytes:
    return b"".join(bytes(p) for p in parts)


def _untouched(parts: Sequence[memoryview]) -> bool:
    return all(bytes(p) == bytes([FILL]) * len(p) for p in parts)


def _other_format(key: str, payload: bytes) -> bytearray:
    """A valid record of `key` in our namespace, but a page of another format."""
    return PageCodec(namespace=NAMESPACE, dtype="float16", shape=(len(payload) // 2,),
                     layout="page_first", tokens_per_page=16, itemsize=2).encode(key, payload)


def _only_raw(key: str, header: RecordHeader) -> str | None:
    """An `accept` that takes only `raw` pages (`codec()`'s)."""
    return None if header.layout == "raw" else f"layout {header.layout}"


# -- checks over parts agree with hicache_client.codec ------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
def test_verify_parts_agrees_with_verify_record(version: int) -> None:
    if version == 2:
        key = "k" * 64
        rec = bytes(PageCodec(namespace=bytes(range(32)), dtype="float16", shape=(2, 4),
                              layout="page_first", tokens_per_page=4, itemsize=2
                              ).encode(key, bytes(range(100, 116))))
    else:
        key, rec = V1_KEY, V1_RECORD
    want = verify_record(rec, key)
    assert want.version == version
    for a in range(len(rec) + 1):  # every two-way cut, and three-way cuts around the header
        assert verify_record_parts(_split(rec, [a, len(rec) - a]), key) == want
        for b in (HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 1):
            if a <= b <= len(rec):
                assert verify_record_parts(_split(rec, [a, b - a, len(rec) - b]), key) == want
    for i in range(len(rec)):  # every flipped byte, every truncation: refused, as by the codec
        bad = bytearray(rec)
        bad[i] ^= 0x01
        with pytest.raises(StorageCorrupt):
            verify_record(bad, key)
        with pytest.raises(StorageCorrupt):
            verify_record_parts(_split(bad, [HEADER_BYTES, 5, len(rec) - HEADER_BYTES - 5]), key)
        with pytest.raises(StorageCorrupt):
            verify_record_parts(_split(rec[:i], [i]), key)
    with pytest.raises(StorageCorrupt, match="another key"):
        verify_record_parts(_split(rec, [len(rec)]), "x" * 64)
    # The header alone: every check but the checksum.
    assert verify_record_head(rec[:HEADER_BYTES], key, len(rec)) == want
    with pytest.raises(StorageCorrupt, match="header says"):
        verify_record_head(rec[:HEADER_BYTES], key, len(rec) + 1)
    with pytest.raises(StorageCorrupt, match="shorter than its header"):
        verify_record_head(rec[:HEADER_BYTES - 1], key, len(rec))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_verify_copied_parts_takes_only_the_judged_header_with_its_checksum(shape: str) -> None:
    """After a header was judged where it lay, the copy must start with exactly that header
    (a valid record of another format is not passed by its own checksum) and hold its checksum
    over the parts."""
    keys, recs = pages("copied", 1, PAYLOAD)
    rec = bytes(recs[0])
    head = rec[:HEADER_BYTES]
    version = verify_record_head(head, keys[0], len(rec)).version
    verify_copied_parts(_split(rec, SHAPES[shape]), head, version)
    other = bytes(_other_format(keys[0], rec[HEADER_BYTES:]))  # same payload, valid record
    assert verify_record_parts(_split(other, SHAPES[shape]), keys[0]).layout == "page_first"
    with pytest.raises(StorageCorrupt, match="header changed"):
        verify_copied_parts(_split(other, SHAPES[shape]), head, version)
    for i in (HEADER_BYTES, len(rec) // 2, len(rec) - 1):  # a payload byte: its checksum
        bad = bytearray(rec)
        bad[i] ^= 0x01
        with pytest.raises(StorageCorrupt, match="checksum"):
            verify_copied_parts(_split(bad, SHAPES[shape]), head, version)


def test_encode_header_writes_the_codec_record() -> None:
    c = codec(PAYLOAD)
    rng = random.Random(1)
    for sizes in ([PAYLOAD], [1, PAYLOAD - 1], [QUARTER] * 3 + [PAYLOAD - 3 * QUARTER]):
        payload = rng.randbytes(PAYLOAD)
        parts = _split(payload, sizes)
        head = memoryview(bytearray(HEADER_BYTES))
        encode_record_header(c, "key-1", parts, head)
        assert bytes(head) + payload == bytes(c.encode("key-1", payload))
    with pytest.raises(ValueError, match="page format needs"):
        encode_record_header(c, "k", [memoryview(bytearray(PAYLOAD - 1))], head)
    with pytest.raises(ValueError, match="a header is"):
        encode_record_header(c, "k", [memoryview(bytearray(PAYLOAD))], head[:-1])


def test_store_map_view_and_current_follow_the_generation() -> None:
    arena = Arena(8 * BLOCK)
    try:
        m = StoreMap(arena.name, arena.size, arena.id)
        slot = arena.store(memoryview(b"x" * 100))
        assert slot is not None
        v = m.view(slot.offset, 100, slot.gen)
        assert v is not None and bytes(v) == b"x" * 100 and m.current(slot.offset, slot.gen)
        assert m.view(slot.offset + 1, 100, slot.gen) is None  # not a block start
        assert m.view(slot.offset, 100, slot.gen + 1) is None  # another generation
        gen = slot.gen
        arena.free(slot)
        assert not m.current(slot.offset, gen) and m.view(slot.offset, 100, gen) is None
        # A record written from parts lands whole, in order.
        new = arena.reserve(7)
        assert new is not None
        parts = [memoryview(b"ab"), memoryview(b""), memoryview(b"cdefg")]
        assert m.write(new.offset, new.gen, parts) and bytes(arena.view(new)) == b"abcdefg"
        assert not m.write(new.offset, gen, parts)  # a stale reservation writes nothing
        del v
        m.close()
    finally:
        arena.close()


# -- the StorageBackend default: through a temporary per record --------------------------------


def _memory() -> MemoryBackend:
    return MemoryBackend(StorageConfig(extra={}, namespace=NAMESPACE.hex()))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_default_parts_go_through_temporaries(shape: str) -> None:
    sizes = SHAPES[shape]
    keys, recs = pages("default", 5, PAYLOAD)
    b = _memory()
    assert b.batch_set_parts(keys[:4], [_split(r, sizes) for r in recs[:4]]) == [True] * 4
    out = [memoryview(bytearray(len(r))) for r in recs[:4]]
    assert b.batch_get(keys[:4], out) == [True] * 4 and [bytes(o) for o in out] == recs[:4]
    flipped = bytearray(recs[1])
    flipped[-1] ^= 1
    b.batch_set([keys[1], keys[2], keys[3]], [memoryview(flipped),
                                              memoryview(_other_format(keys[2], b"\0" * 64)),
                                              memoryview(_other_format(keys[3], recs[3][128:]))])
    parts = [_parts(sizes) for _ in keys]
    got = b.batch_get_parts(keys, parts, accept=_only_raw)
    # 0 valid; 1 corrupt; 2 the wrong length; 3 refused by accept; 4 absent
    assert got == [True, False, False, False, False]
    assert _joined(parts[0]) == recs[0]
    assert all(_untouched(p) for p in parts[1:])  # a failed read leaves its parts alone
    s = b.stats()
    assert (s.get_pages, s.get_hits, s.bytes_read, s.corrupt_pages) == (9, 5, 5 * len(recs[0]), 3)
    assert (s.set_pages, s.set_failures, s.bytes_written) == (
        7, 0, 6 * len(recs[0]) + HEADER_BYTES + 64)
    assert b.batch_exists(keys[1:4]) == 0  # the corrupt and refused records were deleted
    assert b.batch_get_parts([], []) == [] and b.batch_set_parts([], []) == []
    with pytest.raises(ValueError, match="part lists"):
        b.batch_get_parts(keys, parts[:1])


def test_every_backend_has_the_parts_pair() -> None:
    """The pair is the ABC's (no backend needs to implement it)."""
    assert MemoryBackend.batch_get_parts is StorageBackend.batch_get_parts
    assert MemoryBackend._get_parts_checked is StorageBackend._get_parts_checked


# -- the hicache client against a real server --------------------------------------------------


def _st(b: Any) -> tuple[int, ...]:
    st = b.server_stats()
    return tuple(st[f"{path}_page_bytes_{d}"] for d in ("in", "out")
                 for path in ("store", "shm", "tcp"))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_one_copy_each_way_through_the_store(tmp_path: Path, shape: str) -> None:
    sizes = SHAPES[shape]
    keys, recs = pages(f"store-{shape}", 6, PAYLOAD)
    total = sum(len(r) for r in recs)
    with hicache_server(tmp_path) as srv:
        b = srv.client()
        assert b.batch_set_parts(keys, [_split(r, sizes) for r in recs]) == [True] * 6
        assert (b.arena.writes, b.arena.write_fallbacks) == (6, 0)
        parts = [_parts(sizes) for _ in keys]
        assert b.batch_get_parts(keys, parts) == [True] * 6
        assert [_joined(p) for p in parts] == recs
        assert (b.arena.reads, b.arena.fallbacks) == (6, 0)
        # No page byte through the region or TCP, either way.
        assert _st(b) == (total, 0, 0, total, 0, 0)
        s = b.stats()
        assert (s.set_pages, s.set_failures, s.bytes_written) == (6, 0, total)
        assert (s.get_pages, s.get_hits, s.bytes_read, s.corrupt_pages, s.errors) == (
            6, 6, total, 0, 0)
        # The single-buffer calls read and write the same records.
        out = [memoryview(bytearray(len(r))) for r in recs]
        assert b.batch_get(keys, out) == [True] * 6 and [bytes(o) for o in out] == recs
        b.close()


@pytest.mark.parametrize("fault", ["bit_flip", "other_key", "other_namespace", "wrong_length",
                                   "refused", "absent"])
def test_a_bad_record_in_the_store(tmp_path: Path, fault: str) -> None:
    """Judged on its header where it lies, a bad record is never copied into the parts; one
    whose header is right but whose payload fails the checksum is found bad only after its
    copy (the parts then hold it, and the caller is told False)."""
    keys, recs = pages("bad", 2, PAYLOAD)
    sizes = SHAPES["head+4"]
    rec = bytearray(recs[0])
    if fault == "bit_flip":
        rec[-1] ^= 0x01
    elif fault == "other_key":
        rec = bytearray(page_record(codec(PAYLOAD), "bad", 7))
    elif fault == "other_namespace":
        rec = PageCodec(namespace=b"\1" * 32, dtype="uint8", shape=(PAYLOAD,), layout="raw",
                        tokens_per_page=16, itemsize=1).encode(keys[0], recs[0][128:])
    elif fault == "wrong_length":
        rec = page_record(codec(PAYLOAD + BLOCK), "bad", 0)
    elif fault == "refused":
        rec = _other_format(keys[0], recs[0][128:])
    with hicache_server(tmp_path) as srv:
        b = srv.client()
        if fault != "absent":
            assert b.batch_set([keys[0]], [memoryview(rec)]) == [True]
        assert b.batch_set([keys[1]], [memoryview(recs[1])]) == [True]
        parts = [_parts(sizes), _parts(sizes)]
        assert b.batch_get_parts(keys, parts, accept=_only_raw) == [False, True]
        assert _joined(parts[1]) == recs[1]
        if fault == "bit_flip":
            assert _joined(parts[0]) == rec  # copied, then refused by its checksum
        else:
            assert _untouched(parts[0])
        s = b.stats()
        bad = fault != "absent"
        assert (s.get_pages, s.get_hits, s.corrupt_pages, s.errors) == (2, 1, int(bad), 0)
        assert (b.arena.reads, b.arena.fallbacks) == (2, 0)
        assert b.batch_exists(keys[:1]) == 0  # a bad record was deleted
        b.close()


def test_a_header_changed_during_the_copy_is_refused_though_its_record_is_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header is judged where it lies, before the copy. If the copy then holds another
    header (a writer that broke the arena's protocol, generation unchanged), the copy is not
    taken on its own checksum: here a valid record of the same key and payload but of a
    format `accept` refuses. A counted corrupt miss, deleted."""
    keys, recs = pages("swap", 1, PAYLOAD)
    other = bytes(_other_format(keys[0], recs[0][HEADER_BYTES:]))
    real_scatter = hicache_backend.scatter

    def scatter(src: memoryview, parts: Sequence[memoryview]) -> None:
        real_scatter(src, parts)
        parts[0][:] = other[:HEADER_BYTES]  # the "head+4" shape: part 0 is the header

    monkeypatch.setattr(hicache_backend, "scatter", scatter)
    with hicache_server(tmp_path) as srv:
        b = srv.client()
        assert b.batch_set(keys, [memoryview(recs[0])]) == [True]
        parts = [_parts(SHAPES["head+4"])]
        assert verify_record_parts(_split(other, SHAPES["head+4"]), keys[0]).layout == "page_first"
        assert b.batch_get_parts(keys, parts, accept=_only_raw) == [False]
        s = b.stats()
        assert (s.get_pages, s.get_hits, s.corrupt_pages) == (1, 0, 1)
        assert b.batch_exists(keys) == 0
        b.close()


@pytest.mark.parametrize("when", ["header", "payload"])
def test_a_copy_that_raced_a_free_is_read_the_other_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """The record's blocks were reused while its header (or its payload) was copied: what was
    read then (here a header that fails its checks, or a payload with a wrong byte) is not
    judged; the record is read through the region, checked there, and delivered valid, and
    nothing is counted corrupt or deleted."""
    keys, recs = pages(f"race-{when}", 3, PAYLOAD)
    sizes = SHAPES["head+4"]
    race = {"armed": True, "torn": False}
    real_current = StoreMap.current

    def current(self: StoreMap, offset: int, gen: int) -> bool:
        if race["torn"]:  # the generation the copy is checked against has changed
            race["torn"] = False
            return False
        return real_current(self, offset, gen)

    def tear() -> bool:
        fire = race["armed"]
        race["armed"] = False
        race["torn"] = race["torn"] or fire
        return fire

    if when == "header":
        real_head = hicache_backend.verify_record_head

        def head(h: bytes, key: str, length: int) -> RecordHeader:
            if tear():
                raise StorageCorrupt("a torn header")
            return real_head(h, key, length)

        monkeypatch.setattr(hicache_backend, "verify_record_head", head)
    else:
        real_scatter = hicache_backend.scatter

        def scatter(src: memoryview, parts: Sequence[memoryview]) -> None:
            real_scatter(src, parts)
            if tear():
                parts[-1][-1] ^= 0xFF  # another record's byte

        monkeypatch.setattr(hicache_backend, "scatter", scatter)
    monkeypatch.setattr(StoreMap, "current", current)
    with hicache_server(tmp_path) as srv:
        b = srv.client()
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 3
        parts = [_parts(sizes) for _ in keys]
        assert b.batch_get_parts(keys, parts) == [True] * 3
        assert race == {"armed": False, "torn": False}
        assert [_joined(p) for p in parts] == recs
        assert (b.arena.reads, b.arena.fallbacks) == (2, 1)
        st = b.server_stats()
        assert st["shm_page_bytes_out"] == len(recs[0]) and st["tcp_page_bytes_out"] == 0
        assert (b.stats().corrupt_pages, b.stats().get_hits) == (0, 3)
        assert b.batch_exists(keys) == 3
        b.close()


@pytest.mark.parametrize("lease_ms", ["1", "10000"], ids=["lease-expired", "leased"])
def test_a_record_gone_after_a_torn_copy_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lease_ms: str
) -> None:
    """The one case in which a False leaves bytes in the parts besides a bad checksum: a copy
    found torn after it was made, whose record is then gone. Those bytes are unchecked; the
    caller was told False. That needs the read's lease to have expired (1 ms) before the
    delete: under its lease (10 s) the deleted record's blocks are kept until the read ends,
    so the copy is whole and checked."""
    keys, recs = pages("gone", 1, PAYLOAD)
    sizes = SHAPES["head+4"]
    with hicache_server(tmp_path, args=["--read-lease-ms", lease_ms]) as srv:
        b = srv.client()
        raw = RawClient(srv.url)
        assert b.batch_set(keys, [memoryview(recs[0])]) == [True]
        real = StoreMap.current
        calls = {"n": 0}

        def torn_then_deleted(self: StoreMap, offset: int, gen: int) -> bool:
            calls["n"] += 1
            if calls["n"] == 2:  # after the payload copy: the record is freed now
                if lease_ms == "1":
                    time.sleep(0.02)  # the read's 1 ms lease is over: the delete frees it
                raw.call(P.DeleteRequest(keys=keys))
            return real(self, offset, gen)

        try:
            monkeypatch.setattr(StoreMap, "current", torn_then_deleted)
            parts = [_parts(sizes)]
            if lease_ms == "10000":
                assert b.batch_get_parts(keys, parts) == [True]
                assert _joined(parts[0]) == recs[0]
                assert (b.stats().get_hits, b.arena.fallbacks) == (1, 0)
                st = b.server_stats()  # the read's release freed the deleted record's blocks
                assert (st["pages"], st["read_leases"], st["read_lease_held_slots"]) == (0, 0, 0)
                assert st["arena_slots"] == st["reserved_slots"]
                return
            assert b.batch_get_parts(keys, parts) == [False]
            assert _joined(parts[0]) == recs[0]  # what was copied before the free
            s = b.stats()
            assert (s.get_hits, s.corrupt_pages, b.arena.fallbacks) == (0, 0, 1)
        finally:
            raw.close()
            b.close()


@pytest.mark.parametrize("path", ["region", "tcp"])
def test_the_region_and_tcp_paths(tmp_path: Path, path: str) -> None:
    keys, recs = pages(f"fallback-{path}", 5, PAYLOAD)
    total = sum(len(r) for r in recs)
    sizes = SHAPES["cut-head"]
    args = REGION_ONLY if path == "region" else []
    with hicache_server(tmp_path, args=args) as srv:
        b = srv.client(**({} if path == "region" else {"shm": False}))
        assert b.batch_set_parts(keys, [_split(r, sizes) for r in recs]) == [True] * 5
        flipped = bytearray(recs[4])
        flipped[-1] ^= 1
        assert b.batch_set([keys[4]], [memoryview(flipped)]) == [True]
        parts = [_parts(sizes) for _ in keys]
        assert b.batch_get_parts(keys, parts) == [True] * 4 + [False]
        assert [_joined(p) for p in parts[:4]] == recs[:4]
        assert _untouched(parts[4])  # checked in a temporary: never copied into the parts
        one = len(recs[0])
        if path == "region":
            assert _st(b) == (0, total + one, 0, 0, total, 0)
        else:
            assert _st(b) == (0, 0, total + one, 0, 0, total)
        assert (b.arena.reads, b.arena.writes) == (0, 0)
        s = b.stats()
        assert (s.get_pages, s.get_hits, s.corrupt_pages, s.errors) == (5, 4, 1, 0)
        b.close()


def test_a_record_larger_than_the_region_goes_as_one_frame(tmp_path: Path) -> None:
    keys, recs = pages("big", 2, PAYLOAD)
    with hicache_server(tmp_path, args=REGION_ONLY) as srv:
        b = srv.client(shm_bytes=16 << 10)  # smaller than a record
        assert b.batch_set_parts(keys, [_split(r, SHAPES["head+4"]) for r in recs]) == [True] * 2
        assert _st(b)[:3] == (0, 0, sum(len(r) for r in recs))
        raw = RawClient(srv.url)
        try:
            assert raw.get(keys) == [bytes(r) for r in recs]
        finally:
            raw.close()
        b.close()


def test_a_key_named_twice(tmp_path: Path) -> None:
    keys, recs = pages("twice", 2, PAYLOAD)
    sizes = SHAPES["head+4"]
    with hicache_server(tmp_path) as srv:
        b = srv.client()
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 2
        parts = [_parts(sizes) for _ in range(3)]
        assert b.batch_get_parts([keys[0], keys[1], keys[0]], parts) == [True] * 3
        assert [_joined(p) for p in parts] == [recs[0], recs[1], recs[0]]
        assert (b.stats().get_pages, b.stats().get_hits) == (3, 3)
        b.close()


def test_a_dead_server_is_a_counted_miss(tmp_path: Path) -> None:
    keys, recs = pages("dead", 3, PAYLOAD)
    sizes = SHAPES["head+4"]
    with hicache_server(tmp_path) as srv:
        b = srv.client(timeout_ms=500)
        assert b.batch_set_parts(keys, [_split(r, sizes) for r in recs]) == [True] * 3
        srv.kill()
        parts = [_parts(sizes) for _ in keys]
        assert b.batch_get_parts(keys, parts) == [False] * 3
        assert all(_untouched(p) for p in parts)
        assert b.batch_set_parts(keys, [_split(r, sizes) for r in recs]) == [False] * 3
        s = b.stats()
        assert (s.errors, s.get_pages, s.get_hits, s.set_pages, s.set_failures) == (2, 3, 0, 6, 3)
        b.close()
