"""Construction helpers of a `HiRadixCache`: host pool size, page codec, L3 backend, and the
transfer controller over real pools or simulated bookkeeping."""

from __future__ import annotations

from hicache.config import HiCacheConfig
from hicache.controller import TensorTransfer, Transfer, TransferController
from hicache.pools import DeviceKVPool, HostKVPool, dtype_name
from hicache.prefetch import ProbingTransfer
from hicache.sim_storage import SimStorage, SimTransfer
from hicache.sync import SOLO, RankSync
from hicache_client.backend import StorageBackend, StorageConfig
from hicache_client.codec import PageCodec
from hicache_client.registry import create_backend


def host_pages_for(config: HiCacheConfig, device_pool: DeviceKVPool) -> int:
    """Host pages for `host_size_gb` when set, else `host_ratio` x the device pool."""
    if config.host_size_gb > 0:
        page_bytes = device_pool.bytes_per_token * config.page_size
        return max(1, int(config.host_size_gb * 1e9) // page_bytes)
    return max(1, int(device_pool.num_pages * config.host_ratio))


def make_codec(host_pool: HostKVPool, namespace: bytes, page_size: int) -> PageCodec:
    return PageCodec(
        namespace=namespace,
        dtype=dtype_name(host_pool.dtype),
        shape=host_pool.page_shape,
        layout=host_pool.layout,
        tokens_per_page=page_size,
        itemsize=host_pool.itemsize,
    )


def make_backend(
    name: str, extra: object, namespace: bytes, codec: PageCodec, sync: RankSync = SOLO
) -> StorageBackend:
    return create_backend(
        name,
        StorageConfig(
            extra=dict(extra or {}),  # type: ignore[call-overload]
            namespace=namespace.hex(),
            record_bytes=codec.record_bytes,
            tp_rank=sync.rank,
            tp_size=sync.size,
        ),
    )


def make_controller(
    config: HiCacheConfig,
    *,
    device_pool: DeviceKVPool | None,
    host_pool: HostKVPool | None,
    storage: StorageBackend | None,
    codec: PageCodec | None,
    sim_storage: SimStorage | None,
    sync: RankSync = SOLO,
    writes_storage: bool = True,
) -> TransferController:
    transfer: Transfer
    if config.simulated:
        transfer = SimTransfer(sim_storage)
        has_storage = sim_storage is not None
    else:
        assert device_pool is not None
        transfer = TensorTransfer(device_pool, host_pool, storage, codec)  # type: ignore[arg-type]
        has_storage = storage is not None
    return TransferController(
        ProbingTransfer(transfer),
        has_storage=has_storage,
        batch_pages=config.storage_batch_pages,
        retry_backoff_s=config.storage_retry_backoff,
        synchronous=config.synchronous or config.simulated,
        load_margin=config.load_margin,
        sync=sync,
        writes_storage=writes_storage,
    )
