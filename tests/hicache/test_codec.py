import pytest

from hicache.errors import StorageCorrupt
from hicache.storage import HEADER_BYTES, PageCodec, verify_record

NS = bytes(range(32))


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
