"""One corrupt-page count: what the L3 backend drops is what the cache reports."""

from __future__ import annotations

from pathlib import Path

import torch

from hicache_client.codec import HEADER_BYTES
from tests.hicache.factories import tensor_cache

TOKENS = list(range(300, 332))  # 8 pages of 4


def file_cache(root: Path):
    return tensor_cache(storage=False, synchronous=True, storage_backend="file",
                        storage_extra_config={"path": str(root)})


def test_cache_reports_the_backends_corrupt_pages(tmp_path: Path) -> None:
    writer = file_cache(tmp_path)
    pages = writer.alloc_device(8)
    pool = writer.device_pool
    pool.kv[:, :, pool.slots(pages)] = torch.randn(pool.kv[:, :, pool.slots(pages)].shape)
    writer.insert(TOKENS, pages)
    writer.flush()
    keys = writer.storage_keys(next(iter(writer.tree.nodes())))
    assert writer.stats.storage_backup_pages == 8
    writer.close()

    reader = file_cache(tmp_path)
    backend = reader.storage
    for k in (keys[3], keys[6]):  # flip a payload bit of two records on disk
        path = backend.path_of(k)  # type: ignore[union-attr]
        data = bytearray(path.read_bytes())
        data[HEADER_BYTES + 5] ^= 0x10
        path.write_bytes(data)
    assert reader.prefetch("r", TOKENS) == 32
    acq = reader.acquire(TOKENS, request_id="r")
    assert acq.storage_hit_tokens == 12  # pages 0-2; page 3 is corrupt, the read stops there
    reader.release(acq.node)
    # One batch read all 8 records: the backend dropped both bad ones, and the cache says so.
    st = backend.stats()  # type: ignore[union-attr]
    assert (st.corrupt_pages, st.deleted_pages) == (2, 2)
    assert reader.stats.corrupt_pages == 2
    assert reader.stats.as_dict()["corrupt_pages"] == 2
    reader.check_integrity(0)
    reader.close()
