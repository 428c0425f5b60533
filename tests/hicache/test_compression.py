"""KV compression (hicache_client/compression.py) and compressed page records (codec v3)."""

import struct

import pytest
import torch

from hicache_client.codec import COMPRESSED_VERSION, HEADER_BYTES, PageCodec, verify_record
from hicache_client.compression import COMPRESSIONS, get_compression
from hicache_client.errors import ConfigError, StorageCorrupt
from hicache_client.keys import namespace_seed

NS = bytes(range(32))
SHAPE = (2, 4, 3, 64)  # kv, tokens, heads, head_dim
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def kv_page(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SHAPE, generator=g) * 0.5).to(dtype)


def u8(t):
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def page_codec(compression, dtype="bfloat16"):
    return PageCodec(namespace=NS, dtype=dtype, shape=SHAPE, layout="page_first",
                     tokens_per_page=4, itemsize=DTYPES[dtype].itemsize, compression=compression)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", ["none", "lossless"])
def test_exact_compressions_are_bit_exact(name, dtype):
    pages = [kv_page(DTYPES[dtype], s) for s in range(3)]
    c = get_compression(name, dtype, threads=2)
    assert c.exact
    blobs = c.encode([u8(p) for p in pages], last_dim=64)
    outs = [torch.empty_like(p) for p in pages]
    c.decode_into(blobs, [u8(o) for o in outs], last_dim=64)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(pages, outs))
    c.close()


def test_lossless_stores_a_plane_raw_when_it_does_not_compress():
    # random bytes: neither plane compresses, so the blob is the raw bytes plus 4 + 2 * 5
    raw = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator()
                        .manual_seed(1)).numpy()
    blob = get_compression("lossless", "float16").encode([raw], last_dim=64)[0]
    assert len(blob) == 4096 + 4 + 2 * 5


@pytest.mark.parametrize("name,bound", [("fp8", 0.07), ("int4", 0.2)])
def test_lossy_compressions_bound_the_error(name, bound):
    p = kv_page()
    c = get_compression(name, "bfloat16")
    assert not c.exact and c.namespace_tag().startswith(name)
    out = torch.empty_like(p)
    c.decode_into(c.encode([u8(p)], last_dim=64), [u8(out)], last_dim=64)
    rel = ((out.float() - p.float()).abs().amax(-1) / p.float().abs().amax(-1)).max().item()
    assert 0 < rel < bound


def test_zero_page_round_trips_under_lossy():
    p = torch.zeros(SHAPE, dtype=torch.bfloat16)
    for name in ("fp8", "int4"):
        c = get_compression(name, "bfloat16")
        out = torch.ones_like(p)
        c.decode_into(c.encode([u8(p)], last_dim=64), [u8(out)], last_dim=64)
        assert torch.equal(out, p)


def test_unknown_name_and_unsupported_dtype_fail_at_start_up():
    with pytest.raises(ConfigError, match="unknown KV compression"):
        get_compression("zip", "bfloat16")
    for name in ("lossless", "fp8", "int4"):
        with pytest.raises(ConfigError, match="does not take pages of dtype 'uint8'"):
            PageCodec(namespace=NS, dtype="uint8", shape=(64,), layout="raw",
                      tokens_per_page=1, itemsize=1, compression=name)
    assert set(COMPRESSIONS) == {"none", "lossless", "fp8", "int4"}


@pytest.mark.parametrize("name", ["lossless", "fp8", "int4"])
def test_compressed_record_round_trip(name):
    c = page_codec(name)
    p = kv_page()
    rec = c.encode_compressed("k", u8(p))
    h = verify_record(rec, "k")
    assert h.version == COMPRESSED_VERSION and h.compression == COMPRESSIONS[name].id
    assert h.shape == SHAPE and h.payload_len == len(rec) - HEADER_BYTES < c.payload_bytes
    out = torch.empty_like(p)
    c.decode_into(rec, "k", u8(out))
    if name == "lossless":
        assert torch.equal(out, p)
    with pytest.raises(StorageCorrupt, match="compressed"):
        c.decode(rec, "k")


def test_exact_reader_reads_lossless_and_plain_but_never_lossy():
    p = kv_page()
    plain = page_codec("none")
    out = torch.empty_like(p)
    plain.decode_into(page_codec("lossless").encode_compressed("k", u8(p)), "k", u8(out))
    assert torch.equal(out, p)
    plain.decode_into(plain.encode("k", u8(p)), "k", u8(out))
    assert torch.equal(out, p)
    for lossy in ("fp8", "int4"):
        with pytest.raises(StorageCorrupt, match="lossy"):
            plain.decode_into(page_codec(lossy).encode_compressed("k", u8(p)), "k", u8(out))
    with pytest.raises(StorageCorrupt, match="lossy"):
        page_codec("fp8").decode_into(page_codec("int4").encode_compressed("k", u8(p)), "k",
                                      u8(out))


def test_lossy_compression_is_its_own_namespace():
    base = dict(model_fingerprint="m", dtype="bfloat16", page_size=4, layout="page_first")
    plain = namespace_seed(**base)
    assert namespace_seed(**base, compression="") == plain
    assert namespace_seed(**base, compression=get_compression("lossless", "bfloat16")
                          .namespace_tag()) == plain
    fp8 = namespace_seed(**base, compression=get_compression("fp8", "bfloat16").namespace_tag())
    int4 = namespace_seed(**base, compression=get_compression("int4", "bfloat16").namespace_tag())
    assert len({plain, fp8, int4}) == 3


@pytest.mark.parametrize("name", ["lossless", "fp8", "int4"])
def test_truncated_and_flipped_compressed_records_are_misses(name):
    c = page_codec(name)
    rec = bytearray(c.encode_compressed("k", u8(kv_page())))
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    for n in range(0, len(rec), max(1, len(rec) // 97)):
        with pytest.raises(StorageCorrupt):
            c.decode_into(bytes(rec[:n]), "k", u8(out))
    for i in range(0, len(rec), max(1, len(rec) // 131)):
        bad = bytearray(rec)
        bad[i] ^= 0x40
        with pytest.raises(StorageCorrupt):
            c.decode_into(bytes(bad), "k", u8(out))


def _resealed(c, rec, body):
    """`rec`'s header over a new body, its checksum recomputed (damage the checksum misses)."""
    from hicache_client.codec import checksum_v2

    head = bytearray(rec[:HEADER_BYTES])
    struct.pack_into("<Q", head, HEADER_BYTES - 16, len(body))
    struct.pack_into("<Q", head, HEADER_BYTES - 8, checksum_v2(head, body))
    return bytes(head) + body


def test_checksummed_but_undecodable_blobs_are_misses():
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    for name in ("lossless", "fp8", "int4"):
        c = page_codec(name)
        rec = c.encode_compressed("k", u8(kv_page()))
        body = bytes(rec[HEADER_BYTES:])
        for bad in (body[:-7], body + b"\0", body[:1] + bytes([body[1] ^ 1]) + body[2:]):
            with pytest.raises(StorageCorrupt):
                c.decode_into(_resealed(c, rec, bad), "k", u8(out))


@pytest.mark.parametrize("scale", [float("nan"), 0.0, float("inf")])
def test_nan_or_zero_scales_are_misses(scale):
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    c = page_codec("fp8")
    rec = c.encode_compressed("k", u8(kv_page()))
    body = bytearray(rec[HEADER_BYTES:])
    struct.pack_into("<e", body, 4, scale)  # the first row's fp16 scale
    with pytest.raises(StorageCorrupt, match="scale"):
        c.decode_into(_resealed(c, rec, bytes(body)), "k", u8(out))


def test_unknown_compression_id_is_a_miss():
    c = page_codec("lossless")
    rec = bytearray(c.encode_compressed("k", u8(kv_page())))
    rec[4 + 2 + 2 + 32 + 32 + 4 + 3] = 77  # the header's compression byte
    from hicache_client.codec import checksum_v2

    struct.pack_into("<Q", rec, HEADER_BYTES - 8, checksum_v2(rec, rec[HEADER_BYTES:]))
    with pytest.raises(StorageCorrupt, match="compression 77"):
        c.decode_into(bytes(rec), "k", u8(torch.empty(SHAPE, dtype=torch.bfloat16)))


def test_hitrate_storage_bytes_per_token_follow_the_codec():
    import argparse

    from tools.hitrate.inputs import storage_kv_bytes

    def ns(**kw):
        return argparse.Namespace(**{"codec": None, "codec_ratio": None, **kw})

    assert storage_kv_bytes(ns(), 1000.0) == 1000.0
    assert storage_kv_bytes(ns(codec="none"), 1000.0) == 1000.0
    assert storage_kv_bytes(ns(codec_ratio=4.0), 1000.0) == 250.0
    from hicache_client.compression import MEASURED_RATIO

    assert storage_kv_bytes(ns(codec="lossless"), 1000.0) == 1000.0 / MEASURED_RATIO["lossless"]
    for bad in (ns(codec="zip"), ns(codec="fp8", codec_ratio=2.0), ns(codec_ratio=0.0)):
        with pytest.raises(ConfigError):
            storage_kv_bytes(bad, 1000.0)
