"""MLA pools (`mla=True`: one latent per token and layer, `[1, L, slots, 1, D]`): shapes, page
payloads, device <-> host moves in every layout and io backend (the Triton `kernel` under the
interpreter the test session runs), records through the codec, and every tier of a cache."""

from __future__ import annotations

import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.hiradix import HiRadixCache
from hicache.memory_backend import MemoryBackend
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.transfer import PageMover
from hicache.wiring import make_codec
from hicache_client.backend import StorageConfig
from hicache_client.codec import verify_record
from hicache_client.errors import ConfigError
from hicache_client.units import kv_bytes_per_token
from tests.hicache.test_roundtrip import check_all_tiers
from tests.hicache.test_transfer import CASES, bits, random_kv

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
L, PS, D = 3, 4, 40  # layers, page size, latent width (e.g. kv_lora 32 + rope 8)


def mla_pool(dtype: torch.dtype = torch.float32, num_pages: int = 24) -> DeviceKVPool:
    pool = DeviceKVPool(num_pages=num_pages, page_size=PS, num_layers=L, kv_heads=1,
                        head_dim=D, dtype=dtype, mla=True)
    pool.kv.copy_(random_kv(tuple(pool.kv.shape), dtype, "cpu"))
    return pool


def test_device_pool_holds_one_latent() -> None:
    pool = mla_pool()
    assert pool.kv.shape == (1, L, 24 * PS, 1, D) and pool.planes == 1
    assert pool.k_buffer[2].data_ptr() == pool.v_buffer[2].data_ptr() == pool.kv[0, 2].data_ptr()
    assert pool.bytes_per_token == L * D * 4 == kv_bytes_per_token(L, 1, D, 4, mla=True)
    assert kv_bytes_per_token(L, 1, D, 4) == 2 * L * D * 4  # a K/V pool of that shape
    slots = pool.slots([3, 1], 6)
    latent = torch.randn(6, 1, D)
    pool.set_kv(1, slots, latent)
    assert torch.equal(pool.kv[0, 1, slots], latent)
    assert torch.equal(pool.page_tensor([3])[0, 1], latent[:4])
    with pytest.raises(ValueError, match="MLA pool takes the latent alone"):
        pool.set_kv(1, slots, latent, latent)
    kv = DeviceKVPool(num_pages=2, page_size=PS, num_layers=1, kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="K/V pool takes K and V"):
        kv.set_kv(0, kv.slots([0]), torch.zeros(4, 2, 4))
    with pytest.raises(ConfigError, match="one latent per token, not 2 heads"):
        DeviceKVPool(num_pages=2, page_size=PS, num_layers=1, kv_heads=2, head_dim=4, mla=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_layouts_and_payloads(layout: str) -> None:
    dev = mla_pool(torch.bfloat16)
    host = HostKVPool.like(dev, 10, layout=layout)
    assert host.mla and host.planes == 1
    want = {"layer_first": (1, L, PS, 1, D), "page_first": (PS, 1, L, 1, D),
            "page_first_direct": (1, L, PS, 1, D)}[layout]
    assert host.page_shape == want
    assert host.page_nbytes == L * PS * D * 2  # half a K/V page of the same width
    buf = {"layer_first": (1, L, 10 * PS, 1, D), "page_first": (10 * PS, 1, L, 1, D),
           "page_first_direct": (10, 1, L, PS, 1, D)}[layout]
    assert tuple(host.buffer.shape) == buf
    host.buffer.copy_(random_kv(buf, torch.bfloat16, "cpu"))
    payload = bytes(host.page_payload(7))
    assert len(payload) == host.page_nbytes
    assert payload == bits(host.page_major[7]).numpy().tobytes()
    host.set_page_payload(2, payload)
    assert torch.equal(bits(host.page_major[2]), bits(host.page_major[7]))
    out = torch.empty((3, host.page_nbytes), dtype=torch.uint8)
    host.gather_payloads([7, 0, 4], out)
    assert bytes(out[0].numpy()) == payload
    host.scatter_payloads([9, 8, 1], out)
    for a, b in ((9, 7), (8, 0), (1, 4)):
        assert torch.equal(bits(host.page_major[a]), bits(host.page_major[b]))
    # Records: the codec's shape is the page's; a record round-trips the payload.
    codec = make_codec(host, b"m" * 32, PS)
    assert codec.shape == want and codec.payload_bytes == host.page_nbytes
    rec = codec.encode("key-7", host.page_payload(7))
    assert len(rec) == codec.record_bytes == 128 + host.page_nbytes
    assert bytes(codec.decode(bytes(rec), "key-7")) == payload


def latent_page(pool: DeviceKVPool, page: int) -> torch.Tensor:
    """A device page as `[1, L, PS, 1, D]` bytes."""
    return bits(pool.page_tensor([page]))


def host_latent_page(host: HostKVPool, page: int) -> torch.Tensor:
    t = host.page_major[page]
    if host.layout == "page_first":
        t = t.permute(1, 2, 0, 3, 4)
    return bits(t)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("io", ["direct", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_host_round_trip(layout: str, io: str, dtype: torch.dtype) -> None:
    if io == "kernel":
        pytest.importorskip("triton")
    dev = mla_pool(dtype)
    host = HostKVPool.like(dev, 30, layout=layout, io_backend=io)
    mover = PageMover(dev, host, io)
    assert mover.io_backend == io
    original = dev.kv.clone()
    for dpages, hpages in CASES:
        mover.d2h(dpages, hpages).synchronize()
        for d, h in zip(dpages, hpages):
            assert torch.equal(host_latent_page(host, h), latent_page(dev, d)), (d, h)
        for layerwise in (False, True):
            targets = [p for p in range(24) if p not in dpages][: len(dpages)]
            dev.kv.zero_()
            ctr = mover.h2d(hpages, targets, layerwise=layerwise)
            ctr.wait_all()
            assert len(ctr.events) == (L if layerwise else 1)
            assert torch.equal(bits(dev.kv[:, :, dev.slots(targets)]),
                               bits(original[:, :, dev.slots(dpages)]))
            others = [p for p in range(24) if p not in targets]
            assert not bits(dev.kv[:, :, dev.slots(others)]).any()
            dev.kv.copy_(original)


def test_mixed_kinds_are_refused() -> None:
    dev = mla_pool()
    kv_host = HostKVPool(num_pages=4, page_size=PS, num_layers=L, kv_heads=1, head_dim=D)
    with pytest.raises(ValueError, match="differ in kind"):
        PageMover(dev, kv_host)
    with pytest.raises(ConfigError, match="one latent per token"):
        HostKVPool(num_pages=4, page_size=PS, num_layers=L, kv_heads=2, head_dim=D, mla=True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_every_tier_round_trip(layout: str, io_backend: str) -> None:
    """Latent pages survive device -> host -> L3 records -> host -> device bit for bit."""
    if io_backend == "kernel":
        pytest.importorskip("triton")
    config = HiCacheConfig(page_size=PS, mem_layout=layout, io_backend=io_backend,
                           synchronous=True, prefetch_threshold=0, load_back_threshold=0)
    pool = DeviceKVPool(num_pages=16, page_size=PS, num_layers=2, kv_heads=1, head_dim=D,
                        dtype=torch.bfloat16, mla=True)
    backend = MemoryBackend(StorageConfig(extra={"shared": f"mla-{layout}-{io_backend}"}))
    cache = HiRadixCache(config, device_pool=pool, num_host_pages=32, storage=backend)
    assert cache.host_pool is not None and cache.host_pool.mla
    assert cache.host_pool.page_nbytes == 2 * PS * D * 2
    check_all_tiers(cache, torch.bfloat16)
    store = backend._store.data
    assert len(store) == 6
    page = {"page_first": (PS, 1, 2, 1, D)}.get(layout, (1, 2, PS, 1, D))
    for key in store:  # each record names the latent page's shape, layout and dtype
        head = verify_record(store[key], key)
        assert (head.shape, head.layout, head.dtype) == (page, layout, "bfloat16")
        assert head.payload_len == 2 * PS * D * 2 == len(store[key]) - 128
