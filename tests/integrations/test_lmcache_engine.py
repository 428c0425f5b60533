"""Our connector under LMCache's own engine: `LMCacheEngine.store` / `lookup` / `retrieve`
(LMCache's token database, storage manager, `RemoteBackend` for plugin `hicache`, its async put
path and batched get path) against a real `hicache-server`, on CPU tensors.

The layer driven: `LMCacheEngineBuilder.get_or_create(...)` + `post_init()`, then the engine's
public `store(tokens)`, `lookup(tokens)`, `retrieve(tokens)`. The serving engine's paged KV is a
plain CPU tensor and `CPUKVConnector` copies it to and from LMCache's chunks (the GPU connector's
job, whose CUDA kernels do not run here). Each reading engine is a fresh one with no local hot
cache, so every hit it gets came from the server.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.integrations.lmcache_fixtures import (
    ADAPTER,
    CHUNK,
    PLUGIN,
    engine,
    engine_config,
    hicache_connector,
    kv_cache,
    metadata,
    same_bits,
    skip_without_lmcache,
    wait_puts,
)
from tests.procs import wait_until
from tests.storage_backends.hicache_server_proc import hicache_server

pytestmark = [pytest.mark.lmcache, skip_without_lmcache]

TOKENS = 2 * CHUNK + 8  # two full chunks and a partial one
CHUNKS = 3


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with hicache_server(tmp_path_factory.mktemp("hicache-lmcache"), capacity="256MiB") as srv:
        yield f"hicache://127.0.0.1:{srv.port}"


def prompt(first: int) -> torch.Tensor:
    return torch.arange(first, first + TOKENS)


def test_store_then_another_engine_retrieves_byte_exact(url: str) -> None:
    md = metadata()
    kv = kv_cache(TOKENS + 8, seed=1, md=md)
    tokens = prompt(1000)
    with engine(engine_config(url), md, kv) as writer:
        writer.store(tokens)
        wait_puts(writer, CHUNKS)
        st = hicache_connector(writer).stats()
        assert (st["chunks_put"], st["chunks_stored"], st["set_pages"], st["errors"]) == (3, 3, 3, 0)

    out = torch.zeros_like(kv)
    with engine(engine_config(url), md, out) as reader:
        assert reader.lookup(tokens) == TOKENS
        mask = reader.retrieve(tokens)
        assert bool(mask.all()) and len(mask) == TOKENS
        assert same_bits(out[:, :, :TOKENS], kv[:, :, :TOKENS])
        assert not out[:, :, TOKENS:].any()  # nothing written past the prompt
        assert reader.lookup(prompt(5000)) == 0  # never stored
        st = hicache_connector(reader).stats()
        assert (st["chunks_asked"], st["chunks_hit"], st["corrupt_pages"], st["errors"],
                st["foreign_records"]) == (3, 3, 0, 0, 0)


def test_workers_and_models_are_isolated(url: str) -> None:
    """Two tensor-parallel ranks store different KV for the same tokens: each reads back its
    own; another model name or KV dtype finds nothing."""
    tokens = prompt(2000)
    mds = [metadata(worker_id=w, world_size=2) for w in (0, 1)]
    kvs = [kv_cache(TOKENS, seed=10 + w, md=mds[w]) for w in (0, 1)]
    for md, kv in zip(mds, kvs):
        with engine(engine_config(url), md, kv) as writer:
            writer.store(tokens)
            wait_puts(writer, CHUNKS)
            assert hicache_connector(writer).stats()["chunks_stored"] == CHUNKS

    for md, kv, other in zip(mds, kvs, reversed(kvs)):
        out = torch.zeros_like(kv)
        with engine(engine_config(url), md, out) as reader:
            assert bool(reader.retrieve(tokens).all())
            assert same_bits(out, kv) and not same_bits(out, other)

    for md in (metadata(model="another-model"), metadata(dtype=torch.bfloat16)):
        out = torch.zeros(kvs[0].shape, dtype=md.kv_dtype)
        with engine(engine_config(url), md, out) as stranger:
            assert stranger.lookup(tokens) == 0
            assert not stranger.retrieve(tokens).any() and not out.any()
            st = hicache_connector(stranger).stats()
            assert st["chunks_hit"] == 0 and st["foreign_records"] == 0


def test_mla_one_writer_every_worker_reads(url: str) -> None:
    """MLA: the KV is the same on every rank. Worker 0 writes; worker 1's stores are skipped by
    the connector itself (LMCache's own remapping of worker ids turned off to show it), and
    worker 1 reads worker 0's chunks, with and without LMCache's remapping."""
    tokens = prompt(3000)
    own_path = {"save_only_first_rank": False, "remote_enable_mla_worker_id_as0": False}
    md0, md1 = (metadata(worker_id=w, world_size=2, use_mla=True) for w in (0, 1))
    kv0 = kv_cache(TOKENS, seed=20, md=md0)
    with engine(engine_config(url, own_path), md0, kv0) as w0:
        w0.store(tokens)
        wait_puts(w0, CHUNKS)
        st = hicache_connector(w0).stats()
        assert (st["chunks_stored"], st["chunks_skipped_mla"]) == (CHUNKS, 0)

    kv1 = kv_cache(TOKENS, seed=21, md=md1)  # what a buggy rank 1 would hold
    with engine(engine_config(url, own_path), md1, kv1) as w1:
        w1.store(tokens)
        wait_puts(w1, CHUNKS)
        st = hicache_connector(w1).stats()
        assert (st["chunks_put"], st["chunks_skipped_mla"], st["set_pages"]) == (CHUNKS, CHUNKS, 0)

    for extra in (own_path, {"save_only_first_rank": False}):  # ours alone; LMCache's remap on
        out = torch.zeros_like(kv0)
        with engine(engine_config(url, extra), md1, out) as reader:
            assert reader.lookup(tokens) == TOKENS
            assert bool(reader.retrieve(tokens).all())
            assert same_bits(out, kv0)
            assert hicache_connector(reader).stats()["chunks_hit"] == CHUNKS


def test_legacy_remote_url(url: str) -> None:
    """`remote_url: hicache://...` with the plugin listed only to load the adapter (no URL
    key): LMCache's legacy `RemoteBackend` does the work; the plugin's own backend cannot
    connect (no address) and stays inert, so nothing is stored twice."""
    from lmcache.v1.config import LMCacheEngineConfig

    def config() -> object:
        return LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, save_unfull_chunk=True,
            remote_serde="naive", remote_url=url, remote_storage_plugins=[PLUGIN],
            extra_config=dict(ADAPTER))

    md = metadata()
    kv = kv_cache(TOKENS, seed=40, md=md)
    tokens = prompt(4000)
    with engine(config(), md, kv) as writer:
        backends = writer.storage_manager.storage_backends
        assert backends[f"RemoteBackend-{PLUGIN}"].connection is None
        legacy = backends["RemoteBackend"].connection.getWrappedConnector()
        writer.store(tokens)
        wait_until(lambda: legacy.stats()["chunks_stored"] == CHUNKS, timeout=20.0, interval=0.02)
    out = torch.zeros_like(kv)
    with engine(config(), md, out) as reader:
        assert bool(reader.retrieve(tokens).all()) and same_bits(out, kv)
