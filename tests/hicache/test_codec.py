import struct
import zlib

import pytest
import xxhash

from hicache_client.codec import HEADER_BYTES, RECORD_VERSION, PageCodec, verify_record
from hicache_client.errors import StorageCorrupt

NS = bytes(range(32))

# A version-1 record (CRC32) as written by main before records were versioned to XXH3
# (commit 0e11c1e): PageCodec(namespace=NS, dtype="float16", shape=(2, 4), layout="page_first",
# tokens_per_page=4, itemsize=2).encode("ab" * 32, bytes(range(100, 116))).
V1_KEY = "ab" * 32
V1_PAYLOAD = bytes(range(100, 116))
V1_RECORD = bytes.fromhex(
    "484b565001008000000102030405060708090a0b0c0d0e0f1011121314151617"
    "18191a1b1c1d1e1f271a413bd339c5709fdceaec41f14f11e9fbfb5042d72d33"
    "1c65f32b284cd09a040000000202020002000000040000000000000000000000"
    "000000000000000000000000000000001000000000000000000000006870ddad"
    "6465666768696a6b6c6d6e6f70717273"
)


def v1_codec():
    return PageCodec(namespace=NS, dtype="float16", shape=(2, 4), layout="page_first",
                     tokens_per_page=4, itemsize=2)


def codec(shape=(2, 3, 4)):
    return PageCodec(namespace=NS, dtype="float16", shape=shape, layout="page_first",
                     tokens_per_page=4, itemsize=2)


def test_round_trip_and_header():
    c = codec()
    payload = bytes(range(48))
    rec = c.encode("k1", payload)
    assert len(rec) == c.record_bytes == HEADER_BYTES + 48
    assert bytes(c.decode(rec, "k1")) == payload
    h = verify_record(rec, "k1")
    assert (h.dtype, h.layout, h.shape, h.token_count, h.namespace) == (
        "float16", "page_first", (2, 3, 4), 4, NS)


def test_every_truncation_detected():
    c = codec()
    rec = c.encode("k", bytes(48))
    for n in range(len(rec)):
        with pytest.raises(StorageCorrupt):
            c.decode(rec[:n], "k")
    with pytest.raises(StorageCorrupt):
        c.decode(bytes(rec) + b"\0", "k")


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_flipped_byte_detected(mask):
    c = codec()
    rec = c.encode("k", bytes(range(48)))
    for i in range(len(rec)):
        bad = bytearray(rec)
        bad[i] ^= mask
        with pytest.raises(StorageCorrupt):
            c.decode(bad, "k")


def test_misplaced_record_and_foreign_format_detected():
    c = codec()
    rec = c.encode("k1", bytes(48))
    with pytest.raises(StorageCorrupt, match="another key"):
        c.decode(rec, "k2")
    other_ns = PageCodec(namespace=b"\1" * 32, dtype="float16", shape=(2, 3, 4),
                         layout="page_first", tokens_per_page=4, itemsize=2)
    with pytest.raises(StorageCorrupt, match="namespace"):
        c.decode(other_ns.encode("k1", bytes(48)), "k1")
    other_shape = codec(shape=(4, 3, 2))
    with pytest.raises(StorageCorrupt, match="format"):
        c.decode(other_shape.encode("k1", bytes(48)), "k1")


def test_payload_size_checked():
    with pytest.raises(ValueError):
        codec().encode("k", bytes(47))


def test_new_records_are_version_2_with_xxh3():
    c = codec()
    payload = bytes(range(48))
    rec = c.encode("k1", payload)
    version, = struct.unpack_from("<H", rec, 4)
    assert version == RECORD_VERSION == 2
    stored, = struct.unpack_from("<Q", rec, HEADER_BYTES - 8)
    assert stored == xxhash.xxh3_64_intdigest(bytes(rec[:HEADER_BYTES - 8]) + payload)
    assert verify_record(rec, "k1").version == 2


def test_version_1_record_still_reads():
    rec = V1_RECORD
    assert struct.unpack_from("<H", rec, 4) == (1,)
    stored, = struct.unpack_from("<I", rec, HEADER_BYTES - 4)
    assert stored == zlib.crc32(rec[HEADER_BYTES:], zlib.crc32(rec[:HEADER_BYTES - 4]))
    h = verify_record(rec, V1_KEY)
    assert (h.version, h.dtype, h.layout, h.shape, h.token_count, h.namespace) == (
        1, "float16", "page_first", (2, 4), 4, NS)
    assert bytes(v1_codec().decode(rec, V1_KEY)) == V1_PAYLOAD
    # The same page written today differs only in version and checksum.
    new = v1_codec().encode(V1_KEY, V1_PAYLOAD)
    assert new[6:HEADER_BYTES - 8] == rec[6:HEADER_BYTES - 8]
    assert new[HEADER_BYTES:] == rec[HEADER_BYTES:]


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_version_1_every_flipped_byte_detected(mask):
    for i in range(len(V1_RECORD)):
        bad = bytearray(V1_RECORD)
        bad[i] ^= mask
        with pytest.raises(StorageCorrupt):
            v1_codec().decode(bad, V1_KEY)


def test_version_1_every_truncation_detected():
    for n in range(len(V1_RECORD)):
        with pytest.raises(StorageCorrupt):
            verify_record(V1_RECORD[:n], V1_KEY)


def test_unknown_version_rejected():
    rec = codec().encode("k", bytes(48))
    for version in (0, 4, 0xFFFF):
        struct.pack_into("<H", rec, 4, version)
        with pytest.raises(StorageCorrupt, match="unsupported record version"):
            verify_record(rec, "k", checksum=False)


def test_checksum_false_skips_only_the_checksum():
    rec = codec().encode("k", bytes(48))
    rec[HEADER_BYTES + 3] ^= 1
    assert verify_record(rec, "k", checksum=False).payload_len == 48
    with pytest.raises(StorageCorrupt, match="checksum"):
        verify_record(rec, "k")
    with pytest.raises(StorageCorrupt, match="another key"):
        verify_record(rec, "k2", checksum=False)


def test_version_1_record_reads_through_a_backend():
    """A store filled before the XXH3 records keeps serving its pages."""
    from hicache.memory_backend import MemoryBackend
    from hicache_client.backend import StorageConfig

    b = MemoryBackend(StorageConfig(namespace=NS.hex()))
    b.raw_put(V1_KEY, V1_RECORD)
    out = [memoryview(bytearray(len(V1_RECORD)))]
    assert b.batch_get([V1_KEY], out) == [True]
    assert bytes(out[0]) == V1_RECORD
    assert (b.stats().get_hits, b.stats().corrupt_pages) == (1, 0)
    bad = bytearray(V1_RECORD)
    bad[HEADER_BYTES] ^= 1
    b.raw_put(V1_KEY, bytes(bad))
    assert b.batch_get([V1_KEY], out) == [False]
    assert b.stats().corrupt_pages == 1
