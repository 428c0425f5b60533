"""Sealed page records (`encryption_key`, hicache_client.remote.seal) against a real
`hicache-server`: pages round-trip through every client path (TCP frames, the connection's
region, the server's store, records in parts); what the server holds, serves and persists is
ciphertext; a record sealed under another key, altered, or moved under another key is a miss;
the server still clears sealed records by namespace."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_client.codec import HEADER_BYTES
from hicache_client.errors import ConfigError
from hicache_client.remote import protocol as P
from hicache_client.remote.backend import HiCacheServerBackend
from hicache_client.remote.seal import OVERHEAD, SEALED_MAGIC, Sealer
from tests.storage_backends.conftest import NAMESPACE, buffers
from tests.storage_backends.hicache_server_proc import (
    HiCacheServerProc,
    RawClient,
    client_of,
    hicache_server,
    pages,
)

KEY = "11" * 32
OTHER_KEY = "22" * 32
N = 8
PAYLOAD = 8192


@pytest.fixture
def server(tmp_path: Path) -> Iterator[HiCacheServerProc]:
    with hicache_server(tmp_path, persist_dir=tmp_path / "persist") as srv:
        yield srv


def sealed_client(server: HiCacheServerProc, key: str = KEY, **extra: object
                  ) -> HiCacheServerBackend:
    return client_of(server.url, encryption_key=key, **extra)


@pytest.mark.parametrize("path", [{"shm": False}, {"shm": True}], ids=["tcp", "shm"])
def test_sealed_pages_round_trip_and_the_server_holds_only_ciphertext(
        server: HiCacheServerProc, tmp_path: Path, path: dict[str, bool]) -> None:
    keys, recs = pages("sealed", N, PAYLOAD)
    b = sealed_client(server, **path)
    raw = RawClient(server.url)
    try:
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * N
        out = buffers(N, len(recs[0]))
        assert b.batch_get(keys, out) == [True] * N
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
        if path["shm"]:  # sealed straight into the store's slots, opened where they lie
            assert (b.arena.writes, b.arena.reads, b.arena.fallbacks) == (N, N, 0)
        # In parts (a header buffer and a payload region, as from a host pool).
        heads, bodies = buffers(N, HEADER_BYTES), buffers(N, PAYLOAD)
        assert b.batch_get_parts(keys, [(h, p) for h, p in zip(heads, bodies)]) == [True] * N
        assert [bytes(h) + bytes(p) for h, p in zip(heads, bodies)] == [bytes(r) for r in recs]
        k2, r2 = pages("sealed-parts", N, PAYLOAD)
        parts = [(memoryview(r)[:HEADER_BYTES], memoryview(r)[HEADER_BYTES:]) for r in r2]
        assert b.batch_set_parts(k2, parts) == [True] * N
        assert b.batch_get(k2, out) == [True] * N
        assert [bytes(o) for o in out] == [bytes(r) for r in r2]
        # What the server serves: the readable header (sealed magic), never the payload.
        stored = raw.get(keys)
        for rec, got in zip(recs, stored):
            assert got is not None and len(got) == len(rec) + OVERHEAD
            assert got[:4] == SEALED_MAGIC and got[4:120] == bytes(rec[4:120])
            assert bytes(rec[HEADER_BYTES:HEADER_BYTES + 64]) not in got
        if path["shm"]:  # the store's arena (/dev/shm) holds the records: only ciphertext
            mapped = raw.call(P.MapStoreRequest())
            assert isinstance(mapped, P.MapStoreReply) and mapped.name
            arena = (Path("/dev/shm") / mapped.name).read_bytes()
            assert SEALED_MAGIC + bytes(recs[0][4:64]) in arena  # the records are there
            for rec in (*recs, *r2):
                for at in range(HEADER_BYTES, len(rec) - 64, 2048):
                    assert bytes(rec[at:at + 64]) not in arena
        # The server clears sealed records by the namespace their header names.
        assert b.clear_namespace(NAMESPACE) == 2 * N
        assert b.batch_exists(keys) == 0
    finally:
        b.close()
        raw.close()


def test_the_persistence_directory_holds_only_ciphertext(
        server: HiCacheServerProc, tmp_path: Path) -> None:
    keys, recs = pages("disk", N, PAYLOAD)
    b = sealed_client(server)
    try:
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * N
    finally:
        b.close()
    server.stop()  # flushes the write-behind queue
    files = [p for p in (tmp_path / "persist").rglob("*") if p.is_file()
             and not p.name.endswith(".json")]
    assert len(files) == N
    blob = b"".join(p.read_bytes() for p in files)
    for rec in recs:
        assert bytes(rec[HEADER_BYTES:HEADER_BYTES + 64]) not in blob
        assert bytes(rec[-64:]) not in blob
    server.start()
    b = sealed_client(server)
    try:
        out = buffers(N, len(recs[0]))
        assert b.batch_get(keys, out) == [True] * N
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
    finally:
        b.close()


def test_another_key_a_plain_reader_and_altered_records_miss(server: HiCacheServerProc) -> None:
    keys, recs = pages("keys", N, PAYLOAD)
    b = sealed_client(server)
    other = sealed_client(server, OTHER_KEY)
    plain = client_of(server.url)
    raw = RawClient(server.url)
    try:
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * N
        out = buffers(N, len(recs[0]))
        # Under another key: no page opens; each is a miss, neither counted corrupt nor
        # deleted (a reader that lacks the key proves nothing about the record: issue 46).
        assert other.batch_get(keys[:2], out[:2]) == [False, False]
        assert other.stats().corrupt_pages == 0 and other.stats().get_hits == 0
        # A reader without the key sees sealed records as misses, never as pages.
        assert plain.batch_get(keys[2:4], out[2:4]) == [False, False]
        assert plain.stats().corrupt_pages == 0
        assert b.batch_get(keys[:4], out[:4]) == [True] * 4  # all still there for the owner
        # A sealed record moved under another key, or with a flipped bit, does not open.
        stored = raw.get(keys[4:6])
        assert all(s is not None for s in stored)
        moved, flipped = bytearray(stored[1] or b""), bytearray(stored[0] or b"")
        flipped[HEADER_BYTES + 100] ^= 1
        assert raw.set([keys[4], keys[5]], [bytes(moved), bytes(flipped)]) == [True, True]
        assert b.batch_get(keys[4:6], out[4:6]) == [False, False]
        # Kept: a bit flipped on the way (a man in the middle) must not delete the victim's
        # pages, and the server cannot tell that from a bit flipped at rest.
        assert raw.get(keys[4:6]) == [bytes(moved), bytes(flipped)]
        assert b.batch_get(keys[6:], out[6:]) == [True, True]
        assert [bytes(o) for o in out[6:]] == [bytes(r) for r in recs[6:]]
    finally:
        for c in (b, other, plain):
            c.close()
        raw.close()


@pytest.mark.parametrize("bad", ["zz" * 32, "11" * 16, "11" * 33])
def test_a_bad_key_is_a_config_error_naming_the_setting(bad: str) -> None:
    with pytest.raises(ConfigError, match="encryption_key must be 64 hex"):
        client_of("tcp://127.0.0.1:1", encryption_key=bad)


def test_the_backend_knows_the_seal_without_importing_it() -> None:
    from hicache_client.remote import backend

    assert (backend.SEALED_MAGIC, backend.SEAL_OVERHEAD) == (SEALED_MAGIC, OVERHEAD)


def test_seal_and_open_in_memory() -> None:
    keys, recs = pages("mem", 2, 1000)
    s = Sealer(bytes.fromhex(KEY))
    sealed = bytearray(len(recs[0]) + OVERHEAD)
    rec = memoryview(recs[0])
    s.seal_into(keys[0], rec[:HEADER_BYTES], rec[HEADER_BYTES:], memoryview(sealed))
    out = bytearray(len(recs[0]))
    assert s.open_into(keys[0], memoryview(sealed), memoryview(out)) is None
    assert out == recs[0]
    assert s.open_into(keys[1], memoryview(sealed), memoryview(out)) is not None
    with pytest.raises(ValueError):
        s.seal_into(keys[0], memoryview(bytes(HEADER_BYTES)), rec[HEADER_BYTES:],
                    memoryview(sealed))


def test_a_record_in_parts_is_sealed_where_it_lies_as_standard_gcm() -> None:
    """A payload in several parts (odd lengths) is sealed part by part into the same bytes
    GCM makes of it joined: the one-shot AEAD opens it, and so does `open_into`."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    keys, recs = pages("parts", 1, 5000)
    rec = memoryview(recs[0])
    cuts = [HEADER_BYTES, HEADER_BYTES + 1, HEADER_BYTES + 1777, HEADER_BYTES + 1793, len(rec)]
    parts = [rec[a:b] for a, b in zip(cuts, cuts[1:])]
    s = Sealer(bytes.fromhex(KEY))
    sealed = memoryview(bytearray(len(rec) + OVERHEAD))
    s.seal_into(keys[0], rec[:HEADER_BYTES], parts, sealed)
    nonce = bytes(sealed[HEADER_BYTES:HEADER_BYTES + 12])
    aad = bytes(sealed[:HEADER_BYTES]) + keys[0].encode()
    plain = AESGCM(bytes.fromhex(KEY)).decrypt(nonce, bytes(sealed[HEADER_BYTES + 12:]), aad)
    assert plain == bytes(rec[HEADER_BYTES:])
    out = bytearray(len(rec))
    assert s.open_into(keys[0], sealed, memoryview(out)) is None
    assert out == recs[0]
    with pytest.raises(ValueError, match="takes 156 bytes more"):
        s.seal_into(keys[0], rec[:HEADER_BYTES], parts[1:], sealed)


@pytest.mark.parametrize("path", [{"shm": False}, {"shm": True}], ids=["tcp", "shm"])
def test_a_sealed_set_of_records_in_parts_makes_no_staging_copy(
        server: HiCacheServerProc, path: dict[str, bool]) -> None:
    """[header, K, V] (an SGLang page_first page) is sealed from its parts: nothing is
    gathered into a temporary first, and the pages read back."""
    keys, recs = pages("kv", N, PAYLOAD)
    half = HEADER_BYTES + PAYLOAD // 2
    parts = [(memoryview(r)[:HEADER_BYTES], memoryview(r)[HEADER_BYTES:half],
              memoryview(r)[half:]) for r in recs]
    b = sealed_client(server, **path)
    try:
        assert b.batch_set_parts(keys, parts) == [True] * N
        assert b._scratch_buffers.held() == 0
        out = buffers(N, len(recs[0]))
        assert b.batch_get(keys, out) == [True] * N
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
        if path["shm"]:
            assert b.arena.writes == N
    finally:
        b.close()


def test_the_checksum_travels_encrypted_and_older_records_still_open() -> None:
    """The sealed header holds the checksum XORed with a pad only the key makes (neither the
    plaintext checksum nor zero); changing it makes the record not open; a record sealed
    before (checksum field zero) opens with its checksum recomputed."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from hicache_client.codec import verify_record

    keys, recs = pages("sum", 1, 4096)
    s = Sealer(bytes.fromhex(KEY))
    rec = memoryview(recs[0])
    sealed = bytearray(len(rec) + OVERHEAD)
    s.seal_into(keys[0], rec[:HEADER_BYTES], rec[HEADER_BYTES:], memoryview(sealed))
    field = bytes(sealed[HEADER_BYTES - 8:HEADER_BYTES])
    assert field not in (bytes(8), bytes(rec[HEADER_BYTES - 8:HEADER_BYTES]))
    out = bytearray(len(rec))
    assert s.open_into(keys[0], memoryview(sealed), memoryview(out)) is None
    assert out == recs[0]
    verify_record(memoryview(out), keys[0])  # a valid record, checksum included
    altered = bytearray(sealed)
    altered[HEADER_BYTES - 1] ^= 1
    assert s.open_into(keys[0], memoryview(altered), memoryview(out)) == \
        "sealed record does not open under this encryption_key (or was altered)"
    # A record sealed with the checksum field zeroed (the format before): one pass more.
    old = bytearray(len(rec) + OVERHEAD)
    old[:HEADER_BYTES] = rec[:HEADER_BYTES]
    old[:4] = SEALED_MAGIC
    old[HEADER_BYTES - 8:HEADER_BYTES] = bytes(8)
    nonce = b"\x07" * 12
    old[HEADER_BYTES:HEADER_BYTES + 12] = nonce
    AESGCM(bytes.fromhex(KEY)).encrypt_into(nonce, rec[HEADER_BYTES:],
                                           bytes(old[:HEADER_BYTES]) + keys[0].encode(),
                                           memoryview(old)[HEADER_BYTES + 12:])
    out2 = bytearray(len(rec))
    assert s.open_into(keys[0], memoryview(old), memoryview(out2)) is None
    assert out2 == recs[0]


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "region"])
def test_a_sealed_batch_takes_as_many_requests_as_a_plain_one(tmp_path: Path, shm: bool) -> None:
    """The seal's bytes do not push records into requests of their own: with requests of two
    records' bytes, a batch of N sealed records is set and read through the connection's
    region, or over TCP, in N / 2 requests, as a plain batch is (two sealed records overflowed
    such a request, and a sealed batch went in N requests)."""
    rec = HEADER_BYTES + PAYLOAD
    sent: dict[str, tuple[int, int]] = {}
    with hicache_server(tmp_path, args=["--shm-store-bytes", "0"]) as srv:
        for space, key in (("plain", None), ("sealed", KEY)):
            keys, recs = pages(space, N, PAYLOAD)
            extra: dict[str, object] = {"shm": shm, "batch_bytes": 2 * rec, "shm_bytes": 16 * rec}
            if key is not None:
                extra["encryption_key"] = key
            b = client_of(srv.url, **extra)
            try:
                out = buffers(N, rec)
                # The connection, its region, the question of the server's store: settled.
                assert b.batch_get(keys, out) == [False] * N
                before = b.server_stats()["requests"]
                assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * N
                mid = b.server_stats()["requests"]
                assert b.batch_get(keys, out) == [True] * N
                assert [bytes(o) for o in out] == [bytes(r) for r in recs]
                sent[space] = (mid - before - 1, b.server_stats()["requests"] - mid - 1)
                assert b.arena.writes == b.arena.reads == 0  # not through the server's store
            finally:
                b.close()
    assert sent == {"plain": (N // 2, N // 2), "sealed": (N // 2, N // 2)}
