"""`mooncake`: pages in a Mooncake distributed store (`mooncake.store.MooncakeDistributedStore`).

Mooncake keeps objects in *segments* of memory contributed by store clients (any client with a
non-zero `global_segment_size`, or a dedicated `mooncake_store_service`), located by the
`mooncake_master`. Data moves between the segment and the client's registered buffers with the
transfer engine (TCP here; RDMA on hosts with RDMA NICs).

Buffers: our `StorageBackend` API hands over memoryviews that can live anywhere, while Mooncake's
zero-copy `batch_upsert_from` / `batch_get_into` need memory registered with the transfer engine.
Registration is costly (with RDMA it pins and maps pages), so it must not happen per call. The
backend therefore keeps `staging_buffers` registered staging buffers of `staging_bytes` each,
registered once at start-up, and copies records in/out of them (one memcpy per page, far below
the network cost). A caller that owns a stable buffer (the engine's host KV pool) registers it
once with `register_memory(buf)`; views that lie inside a registered region then go straight to
Mooncake with no copy at all.

Semantics of the store that show through:
- A full segment evicts silently (by the master's high-watermark policy), and objects living in
  a client's segment vanish when that client exits: such pages are plain misses.
- A get may return fewer bytes than a record, or nothing, when the segment holding the object
  has gone: an empty or short read is a miss, not a corrupt record.
- Objects are leased for a short time after each read; `delete` removes with `force=True`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import queue
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from hicache_client.backend import StorageBackend, StorageConfig, byte_view
from hicache_client.backend_util import check_known_keys, leading_run
from hicache_client.backoff import Backoff
from hicache_client.errors import ConfigError, StorageError, StorageUnavailable

logger = logging.getLogger(__name__)

CONFIG_ENV = "HICACHE_MOONCAKE_CONFIG_PATH"
DEFAULT_GLOBAL_SEGMENT_SIZE = 4 << 30
DEFAULT_LOCAL_BUFFER_SIZE = 16 << 20
DEFAULT_STAGING_BYTES = 64 << 20
# Mooncake's error codes seen through the Python API (mooncake-store/include/types.h).
_OBJECT_NOT_FOUND = -704

# extra-config key -> (environment variable, default)
_SETTINGS: dict[str, tuple[str, Any]] = {
    "master_server_address": ("MOONCAKE_MASTER", None),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
    "protocol": ("MOONCAKE_PROTOCOL", "tcp"),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE", DEFAULT_GLOBAL_SEGMENT_SIZE),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE),
    "device_name": ("MOONCAKE_DEVICE", ""),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
    "staging_bytes": ("MOONCAKE_STAGING_BYTES", DEFAULT_STAGING_BYTES),
    "staging_buffers": ("MOONCAKE_STAGING_BUFFERS", 2),
}


@dataclass(frozen=True)
class MooncakeSettings:
    master_server_address: str
    metadata_server: str
    protocol: str
    global_segment_size: int
    local_buffer_size: int
    device_name: str
    local_hostname: str
    staging_bytes: int
    staging_buffers: int


def load_settings(config: StorageConfig) -> MooncakeSettings:
    """Extra config when it names the master; else the JSON file at `HICACHE_MOONCAKE_CONFIG_PATH`;
    else `MOONCAKE_*` environment variables. Missing keys take their defaults."""
    source: dict[str, Any]
    if config.extra.get("master_server_address"):
        source, origin = dict(config.extra), "extra config"
    elif os.environ.get(CONFIG_ENV):
        path = os.environ[CONFIG_ENV]
        try:
            source = {**json.loads(Path(path).read_text()), **config.extra}
        except (OSError, ValueError) as e:
            raise ConfigError(f"mooncake: cannot read {CONFIG_ENV}={path}: {e}") from e
        origin = path
    else:
        source = dict(config.extra)
        for key, (env, _default) in _SETTINGS.items():
            if key not in source and os.environ.get(env):
                source[key] = os.environ[env]
        origin = "MOONCAKE_* environment"
    check_known_keys(StorageConfig(extra=source), list(_SETTINGS), "mooncake")
    values: dict[str, Any] = {}
    for key, (_env, default) in _SETTINGS.items():
        raw = source.get(key, default)
        if raw is None:
            raise ConfigError(
                f"mooncake: no {key!r} (from {origin}); set extra config "
                f"'master_server_address', {CONFIG_ENV}, or MOONCAKE_MASTER"
            )
        try:
            values[key] = int(raw) if isinstance(default, int) else str(raw)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"mooncake: {key}: bad value {raw!r}") from e
    s = MooncakeSettings(**values)
    if s.staging_bytes <= 0 or s.staging_buffers < 1 or s.global_segment_size < 0:
        raise ConfigError(f"mooncake: bad sizes in {s}")
    return s


def _address(view: memoryview) -> int:
    """Address of the first byte of a contiguous buffer (read-only ones too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class MooncakeBackend(StorageBackend):
    """Page records as Mooncake objects named `{namespace[:16]}/{key}`."""

    name: ClassVar[str] = "mooncake"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.settings = s = load_settings(config)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ConfigError(
                f"mooncake backend needs the Mooncake wheel ({e}); "
                "pip install 'hicache[mooncake]' (and Debian's libibverbs1)"
            ) from e
        self._prefix = (config.namespace[:16] or "hicache") + "/"
        self._backoff = Backoff("mooncake", initial_s=0.1, max_s=5.0)
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            s.local_hostname,
            s.metadata_server,
            s.global_segment_size,
            s.local_buffer_size,
            s.protocol,
            s.device_name,
            s.master_server_address,
        )
        if rc != 0:
            raise StorageUnavailable(
                f"mooncake: setup against master {s.master_server_address} failed (code {rc})"
            )
        self._closed = False
        self._lock = threading.Lock()
        # Registered regions: (start address, length), for zero-copy of caller buffers.
        self._regions: list[tuple[int, int]] = []
        self._staging_maps: list[mmap.mmap] = []
        self._staging: queue.SimpleQueue[tuple[memoryview, int]] = queue.SimpleQueue()
        for _ in range(s.staging_buffers):
            mm = mmap.mmap(-1, s.staging_bytes)
            view = memoryview(mm)
            addr = self._register(view)
            self._staging_maps.append(mm)
            self._staging.put((view, addr))
        logger.info(
            "mooncake: client %s on master %s (%s, segment %d bytes, %d x %d staging bytes)",
            self._store.get_hostname(), s.master_server_address, s.protocol,
            s.global_segment_size, s.staging_buffers, s.staging_bytes,
        )

    # -- buffers ---------------------------------------------------------------------------

    def _register(self, view: memoryview) -> int:
        addr = _address(view)
        rc = self._store.register_buffer(addr, len(view))
        if rc != 0:
            raise StorageError(f"mooncake: register_buffer of {len(view)} bytes failed ({rc})")
        with self._lock:
            self._regions.append((addr, len(view)))
        return addr

    def register_memory(self, buf: memoryview | bytearray) -> None:
        """Register a stable caller buffer (e.g. the host KV pool) once: batch operations on
        views inside it then transfer with no copy. The buffer must outlive this backend."""
        self._register(byte_view(buf))

    def _registered(self, addr: int, size: int) -> bool:
        with self._lock:
            return any(a <= addr and addr + size <= a + n for a, n in self._regions)

    @contextmanager
    def _staging_buffer(self) -> Iterator[tuple[memoryview, int]]:
        buf = self._staging.get()
        try:
            yield buf
        finally:
            self._staging.put(buf)

    def _plan(self, views: Sequence[memoryview]) -> list[list[int]]:
        """Split page indices into groups that fit one staging buffer (a page that does not fit
        at all gets a group of its own and fails)."""
        groups: list[list[int]] = [[]]
        used = 0
        for i, v in enumerate(views):
            n = len(v)
            if groups[-1] and used + n > self.settings.staging_bytes:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += n
        return [g for g in groups if g]

    def _transfer(
        self, keys: Sequence[str], views: Sequence[memoryview], put: bool
    ) -> list[int]:
        """Mooncake result code / byte count per page, through registered memory."""
        result = [0] * len(keys)
        direct: list[int] = []
        staged: list[int] = []
        addrs: dict[int, int] = {}
        for i, v in enumerate(views):
            a = _address(v) if len(v) else 0
            if len(v) and self._registered(a, len(v)):
                addrs[i] = a
                direct.append(i)
            else:
                staged.append(i)
        # NOTE: upsert, not put: a put of an existing key is a no-op in Mooncake, which would
        # keep a stale or damaged object of that key forever.
        op = self._store.batch_upsert_from if put else self._store.batch_get_into
        if direct:
            codes = op([keys[i] for i in direct], [addrs[i] for i in direct],
                       [len(views[i]) for i in direct])
            for i, c in zip(direct, codes):
                result[i] = int(c)
        for group in self._plan([views[i] for i in staged]):
            idx = [staged[j] for j in group]
            sizes = [len(views[i]) for i in idx]
            if sum(sizes) > self.settings.staging_bytes:
                for i in idx:
                    result[i] = -1
                continue
            with self._staging_buffer() as (stage, base):
                offsets: list[int] = []
                off = 0
                for i, n in zip(idx, sizes):
                    offsets.append(off)
                    if put:
                        stage[off : off + n] = views[i]
                    off += n
                codes = op([keys[i] for i in idx], [base + o for o in offsets], sizes)
                for i, o, n, c in zip(idx, offsets, sizes, codes):
                    result[i] = int(c)
                    if not put and int(c) == n:
                        views[i][:] = stage[o : o + n]
        return result

    # -- StorageBackend --------------------------------------------------------------------

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return [self._prefix + k for k in keys]

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("mooncake: backend is closed")
        self._backoff.check()

    def _failed(self, what: str, detail: object) -> None:
        self._count(errors=1)
        self._backoff.failure(f"{what}: {detail}")
        raise StorageUnavailable(f"mooncake: {what} failed ({detail})")

    def _check_health(self, what: str, codes: Sequence[int]) -> None:
        """Every page of a batch failed: raise `StorageUnavailable` if the master is gone."""
        health = int(self._store.health_check())
        if health != 0:
            self._failed(what, f"codes {sorted(set(codes))}, health_check {health}")

    def batch_exists(self, keys: Sequence[str]) -> int:
        self._count(exists_calls=1)
        if not keys:
            return 0
        self._check_open()
        flags = self._store.batch_is_exist(self._keys(keys))
        n = leading_run([int(f) == 1 for f in flags])
        if n < len(flags) and int(flags[n]) < 0:
            self._failed("batch_is_exist", f"code {int(flags[n])}")
        self._backoff.success()
        return n

    def _get_into(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[int]:
        self._check_open()
        views = [byte_view(o) for o in out]
        names = self._keys(keys)
        codes = self._transfer(names, views, put=False)
        result: list[int] = []
        for name, c, v in zip(names, codes, views):
            if c == len(v):
                result.append(c)
            elif c == 0 or c == _OBJECT_NOT_FOUND:
                result.append(-1)  # NOTE: an empty read: the object's segment has gone
            else:
                # A short read, or "buffer too small": a wrong-size object (returned as its
                # size, so the caller drops it as corrupt) if the store still holds one;
                # otherwise the segment went away under the read: a plain miss.
                size = int(self._store.get_size(name))
                result.append(size if size > 0 and size != len(v) else -1)
        if codes and all(c < 0 and c != _OBJECT_NOT_FOUND for c in codes):
            self._check_health("batch_get_into", codes)
        self._backoff.success()
        return result

    def _set_from(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        self._check_open()
        views = [byte_view(v) for v in values]
        codes = self._transfer(self._keys(keys), views, put=True)
        ok = [c == 0 for c in codes]
        if not any(ok):
            # Usually "no space" (-200: every segment full and nothing evictable yet).
            logger.debug("mooncake: batch_upsert_from codes %s", sorted(set(codes)))
            self._check_health("batch_upsert_from", codes)
        self._backoff.success()
        return ok

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        self._check_open()
        codes = self._store.batch_remove(self._keys(keys), True)
        self._count(deleted_pages=sum(1 for c in codes if int(c) == 0))

    def clear(self) -> None:
        """Remove every object of this namespace (other namespaces on the store stay)."""
        self._check_open()
        rc = self._store.remove_by_regex("^" + re.escape(self._prefix), True)
        if rc < 0:
            self._failed("remove_by_regex", f"code {rc}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions = list(self._regions)
            self._regions.clear()
        for addr, _n in regions:
            self._store.unregister_buffer(addr)
        self._store.close()
        maps, self._staging_maps = self._staging_maps, []
        self._staging = queue.SimpleQueue()
        for mm in maps:
            # A view still referenced somewhere keeps its map: the GC frees it later.
            with contextlib.suppress(BufferError):
                mm.close()
