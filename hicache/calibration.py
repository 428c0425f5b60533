"""Start-up calibration of the load-vs-recompute cost model (`hicache.costmodel`).

Until a quantity is measured the cost model assumes loading is cheaper than recomputing, so a
restarted engine used to load from a slow tier on its first requests. The engine measures its
prefill speed with a short forward (`ModelRunner.measure_prefill`); `calibrate_transfers` times
the load paths with the cache's own pools before the first request:

  host     a host -> device copy of probe pages (after one untimed copy), as a load does
  storage  the probe pages written under probe keys of this namespace and rank, then read back
           by the path a prefetch takes (`TransferController.timed_read`: pipelined over the
           readers), then deleted. Through a second instance of the backend, so that the
           serving instance's counters (and the tier's hit counts) hold only serving traffic.

Each measurement feeds the cost model's EWMA (so later loads refine it) and is recorded in
`CostModel.calibration`, reported with the cache's stats. A probe that fails is logged and
leaves its tier unmeasured (loaded until a real load measures it).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from hicache.controller import MIN_READ_PAGES
from hicache.ops import BackupOp, Transfer
from hicache.wiring import make_backend, make_controller

if TYPE_CHECKING:
    from hicache.hiradix import HiRadixCache

logger = logging.getLogger(__name__)

PROBE_BYTES = 64 << 20  # default probe size (at least MIN_PROBE_PAGES pages)
MIN_PROBE_PAGES = MIN_READ_PAGES + 1  # enough pages for the pipelined read path
_PROBE_TAG = b"hicache/calibration/v1\0"


def probe_keys(namespace: bytes, rank: int, n: int) -> list[str]:
    """Keys of the storage probe's records: in the cache's namespace, never a page key (those
    chain page tokens from the namespace seed)."""
    base = hashlib.sha256(_PROBE_TAG + namespace + rank.to_bytes(4, "little")).digest()
    return [hashlib.sha256(base + i.to_bytes(4, "little")).hexdigest() for i in range(n)]


def calibrate_transfers(cache: HiRadixCache, probe_bytes: int = PROBE_BYTES) -> dict[str, Any]:
    """Measure the host and (with a backend) the storage load path of `cache` into its cost
    model; returns what was measured (also in `cache.controller.cost.calibration`). Call it
    when no request is in flight (it borrows free device and host pages)."""
    controller = cache.controller
    cost = controller.cost
    if cost is None or cache.simulated or cache.host_pool is None or cache.device_pool is None:
        return {}
    page_bytes = cost.bytes_per_token * cache.page_size
    n = max(MIN_PROBE_PAGES, -(-probe_bytes // page_bytes))
    n = min(n, cache.host_alloc.num_free // 2, cache.device_alloc.num_free // 2)
    out: dict[str, Any] = {}
    if n < 1:
        return out
    dev = cache.device_alloc.alloc(n)
    host = cache.host_alloc.alloc(n)
    assert dev is not None and host is not None
    try:
        transfer = controller.transfer
        transfer.device_to_host(dev, host)  # probe contents (and the copy path warmed)
        transfer.quiet_host()
        device = cache.device_pool.device
        _h2d(transfer, host, dev, device)  # untimed: first-use costs stay out
        secs = _h2d(transfer, host, dev, device)
        cost.observe_load("host", n * page_bytes, secs)
        out.update(host_bytes=n * page_bytes, host_seconds=secs,
                   host_bytes_per_s=n * page_bytes / secs if secs > 0 else None)
        if cache.storage is not None and cache.config.storage_backend:
            out.update(_probe_storage(cache, host))
    except Exception as e:  # noqa: BLE001 - a failed probe leaves the tier unmeasured
        logger.warning("cost model calibration failed: %s: %s", type(e).__name__, e)
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        cache.device_alloc.free(dev)
        cache.host_alloc.free(host)
    cost.calibration.update(out)
    logger.info("cost model calibrated: %s", _fmt(cost.calibration))
    return out


def _h2d(transfer: Transfer, host: list[int], dev: list[int], device: torch.device) -> float:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    ctr = transfer.host_to_device(host, dev)
    if ctr is not None:
        ctr.wait_all()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _probe_storage(cache: HiRadixCache, host: list[int]) -> dict[str, Any]:
    """Write the probe records from `host`, read them back into `host` as a prefetch would,
    delete them; through a second backend instance (the serving one's counters untouched)."""
    cost = cache.controller.cost
    assert cost is not None and cache.codec is not None and cache.config.storage_backend
    keys = probe_keys(cache.namespace, cache.sync.rank, len(host))
    backend = make_backend(cache.config.storage_backend, cache.config.storage_extra_config,
                           cache.namespace, cache.codec, cache.sync)
    probe = make_controller(cache.config, device_pool=cache.device_pool,
                            host_pool=cache.host_pool, storage=backend, codec=cache.codec,
                            sim_storage=None)
    try:
        written = BackupOp(None, list(host), keys)
        probe.transfer.store(keys, host, written)
        if written.written != len(keys):
            return {"storage_error": f"{written.written} of {len(keys)} probe pages written"}
        op = probe.timed_read(keys, host)
        if op.error or op.completed != len(keys) or op.seconds <= 0:
            return {"storage_error": op.error or f"{op.completed} of {len(keys)} probe pages read"}
        cost.observe_load("storage", op.nbytes, op.seconds)
        return {"storage_bytes": op.nbytes, "storage_seconds": op.seconds,
                "storage_bytes_per_s": op.nbytes / op.seconds}
    finally:
        try:
            backend.delete(keys)
        finally:
            probe.close()
            backend.close()


def _fmt(c: dict[str, Any]) -> str:
    parts = []
    for k in ("prefill_tokens_per_s", "host_bytes_per_s", "storage_bytes_per_s"):
        if c.get(k):
            unit = " tok/s" if k.startswith("prefill") else " GB/s"
            v = c[k] if unit == " tok/s" else c[k] / 1e9
            parts.append(f"{k.split('_')[0]} {v:.3g}{unit}")
    return ", ".join(parts) or "nothing measured"
