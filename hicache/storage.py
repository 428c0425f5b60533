"""The L3 storage interface: `StorageBackend`, `PageCodec` page records, and the backend registry.

Backends move opaque page *records* (bytes). `PageCodec` makes every record self-describing and
checksummed; `StorageBackend.batch_get` validates each record it returns, so a truncated,
bit-flipped or misplaced record is a counted miss (and deleted where the backend can), never KV
handed to a model.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any, ClassVar

from hicache.errors import ConfigError, StorageCorrupt

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hicache.storage_backends"


# --------------------------------------------------------------------------------------------
# Configuration and statistics
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StorageConfig:
    """What every backend constructor receives: `Backend(config)`."""

    # Backend-specific settings (`--hicache-storage-backend-extra-config`, a JSON object).
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Hex namespace seed of the owning cache; backends may use it as a key prefix. Keys are
    # already namespaced by construction (see hicache.keys), so this is for tidiness/ops only.
    namespace: str = ""
    # Size in bytes of one page record for this cache (0 when unknown).
    record_bytes: int = 0
    tp_rank: int = 0
    tp_size: int = 1

    def get(self, key: str, default: Any = None) -> Any:
        return self.extra.get(key, default)


@dataclass
class BackendStats:
    """Counters of one backend object. Units are in the names."""

    exists_calls: int = 0
    get_pages: int = 0  # pages asked for by batch_get
    get_hits: int = 0  # pages returned valid
    set_pages: int = 0  # pages asked to be stored
    set_failures: int = 0  # pages batch_set reported False for
    bytes_read: int = 0
    bytes_written: int = 0
    corrupt_pages: int = 0  # records that failed validation (dropped, deleted where possible)
    errors: int = 0  # failed operations (unreachable, I/O error, disk full...)
    deleted_pages: int = 0
    evicted_pages: int = 0  # pages the backend dropped to stay under its capacity
    stored_pages: int = -1  # pages currently held (-1: the backend cannot tell)
    stored_bytes: int = -1

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Page records
# --------------------------------------------------------------------------------------------

RECORD_MAGIC = b"HKVP"
RECORD_VERSION = 1
_MAX_DIMS = 8
# magic, version, header_len, namespace, key digest, token_count, dtype, layout, ndim, pad,
# shape[8], payload_len, reserved, crc32 (over the header before it and the payload).
_HEADER = struct.Struct(f"<4sHH32s32sIBBBB{_MAX_DIMS}IQ4sI")
HEADER_BYTES = _HEADER.size
_CRC_OFFSET = HEADER_BYTES - 4

DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float8_e4m3fn": 4,
    "float8_e5m2": 5,
    "uint8": 6,
    "int8": 7,
}
LAYOUT_CODES: dict[str, int] = {"layer_first": 1, "page_first": 2, "page_first_direct": 3, "raw": 4}


def key_digest(key: str) -> bytes:
    """The 32 bytes a record carries to name its key (a misplaced record is detected by it)."""
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class RecordHeader:
    namespace: bytes
    key_digest: bytes
    token_count: int
    dtype: str
    layout: str
    shape: tuple[int, ...]
    payload_len: int


def verify_record(record: memoryview | bytes, key: str, *, checksum: bool = True) -> RecordHeader:
    """Check a whole record (magic, version, length, key, checksum); return its header.

    Raises `StorageCorrupt` naming the first check that failed. Needs no knowledge of the page
    format, so every backend can validate what it reads. `checksum=False` skips only the CRC,
    for a record that `StorageBackend.batch_get` has just verified.
    """
    mv = memoryview(record).cast("B")
    if len(mv) < HEADER_BYTES:
        raise StorageCorrupt(f"record of {len(mv)} bytes is shorter than its header")
    (magic, version, header_len, ns, kd, tokens, dcode, lcode, ndim, _pad, *rest) = _HEADER.unpack(
        mv[:HEADER_BYTES]
    )
    shape_dims = rest[:_MAX_DIMS]
    payload_len, _reserved, crc = rest[_MAX_DIMS:]
    if magic != RECORD_MAGIC:
        raise StorageCorrupt(f"bad magic {magic!r}")
    if version != RECORD_VERSION:
        raise StorageCorrupt(f"unsupported record version {version}")
    if header_len != HEADER_BYTES:
        raise StorageCorrupt(f"bad header length {header_len}")
    if len(mv) != HEADER_BYTES + payload_len:
        raise StorageCorrupt(
            f"record is {len(mv)} bytes, header says {HEADER_BYTES + payload_len}"
        )
    if checksum:
        actual = zlib.crc32(mv[HEADER_BYTES:], zlib.crc32(mv[:_CRC_OFFSET]))
        if actual != crc:
            raise StorageCorrupt(
                f"checksum mismatch (stored {crc:#010x}, computed {actual:#010x})"
            )
    if kd != key_digest(key):
        raise StorageCorrupt(f"record belongs to another key than {key[:16]}...")
    dtypes = {v: k for k, v in DTYPE_CODES.items()}
    layouts = {v: k for k, v in LAYOUT_CODES.items()}
    if dcode not in dtypes or lcode not in layouts or ndim > _MAX_DIMS:
        raise StorageCorrupt("unknown dtype, layout or rank")
    return RecordHeader(
        namespace=ns,
        key_digest=kd,
        token_count=tokens,
        dtype=dtypes[dcode],
        layout=layouts[lcode],
        shape=tuple(shape_dims[:ndim]),
        payload_len=payload_len,
    )


class PageCodec:
    """Encodes and decodes the records of one page format (namespace, dtype, shape, layout).

    A record is a fixed 128-byte header followed by the page payload; the CRC32 in the header
    covers the header fields and the payload, so every single flipped byte and every truncation
    is detected.
    """

    def __init__(
        self,
        *,
        namespace: bytes,
        dtype: str,
        shape: Sequence[int],
        layout: str,
        tokens_per_page: int,
        itemsize: int,
    ) -> None:
        if len(namespace) != 32:
            raise ConfigError("namespace must be a 32-byte seed")
        if dtype not in DTYPE_CODES:
            raise ConfigError(f"dtype {dtype!r} has no record code; known: {sorted(DTYPE_CODES)}")
        if layout not in LAYOUT_CODES:
            raise ConfigError(f"layout {layout!r} has no record code")
        if len(shape) > _MAX_DIMS:
            raise ConfigError(f"page shape has more than {_MAX_DIMS} dims")
        self.namespace = namespace
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self.layout = layout
        self.tokens_per_page = tokens_per_page
        n = 1
        for d in self.shape:
            n *= d
        self.payload_bytes = n * itemsize
        self.record_bytes = HEADER_BYTES + self.payload_bytes

    def _header(self, key: str, payload_len: int) -> bytes:
        dims = list(self.shape) + [0] * (_MAX_DIMS - len(self.shape))
        return _HEADER.pack(
            RECORD_MAGIC,
            RECORD_VERSION,
            HEADER_BYTES,
            self.namespace,
            key_digest(key),
            self.tokens_per_page,
            DTYPE_CODES[self.dtype],
            LAYOUT_CODES[self.layout],
            len(self.shape),
            0,
            *dims,
            payload_len,
            b"\0\0\0\0",
            0,
        )

    def encode_into(self, key: str, payload: memoryview | bytes, out: memoryview) -> None:
        """Write the record for `payload` into `out` (exactly `record_bytes` long)."""
        p = memoryview(payload).cast("B")
        if len(p) != self.payload_bytes:
            raise ValueError(f"payload is {len(p)} bytes, page format needs {self.payload_bytes}")
        o = memoryview(out).cast("B")
        if len(o) != self.record_bytes:
            raise ValueError(f"out is {len(o)} bytes, a record is {self.record_bytes}")
        o[:HEADER_BYTES] = self._header(key, len(p))
        o[HEADER_BYTES:] = p
        crc = zlib.crc32(p, zlib.crc32(o[:_CRC_OFFSET]))
        o[_CRC_OFFSET:HEADER_BYTES] = struct.pack("<I", crc)

    def encode(self, key: str, payload: memoryview | bytes) -> bytearray:
        out = bytearray(self.record_bytes)
        self.encode_into(key, payload, memoryview(out))
        return out

    def decode(
        self, record: memoryview | bytes, key: str, *, checksum: bool = True
    ) -> memoryview:
        """Validate `record` as this format's page `key`; return a view of its payload.
        `checksum=False`: the record came from `StorageBackend.batch_get`, which checked it."""
        header = verify_record(record, key, checksum=checksum)
        if header.namespace != self.namespace:
            raise StorageCorrupt("record is from another namespace")
        if (header.dtype, header.layout, header.shape, header.token_count) != (
            self.dtype,
            self.layout,
            self.shape,
            self.tokens_per_page,
        ):
            raise StorageCorrupt(
                f"record format {header.dtype}/{header.layout}/{header.shape}/"
                f"{header.token_count} does not match {self.dtype}/{self.layout}/{self.shape}/"
                f"{self.tokens_per_page}"
            )
        return memoryview(record).cast("B")[HEADER_BYTES:]


# --------------------------------------------------------------------------------------------
# The backend interface
# --------------------------------------------------------------------------------------------


class StorageBackend(ABC):
    """An L3 page store shared by many cache instances.

    Contract (every backend, checked by tests/storage_backends/test_contract.py):
    - Methods are thread-safe: the cache's prefetch and backup threads call them concurrently.
    - `batch_exists(keys)` returns the length of the leading run of `keys` present.
    - `batch_get(keys, out)` fills `out[i]` with the record of `keys[i]` and returns, per key,
      whether a *valid* record was delivered. A missing key is False; a record that fails
      `verify_record` (or has another length than `out[i]`, or names another namespace than
      `config.namespace` when that is set) is False too, counted in
      `stats().corrupt_pages` and deleted. The contents of `out[i]` are unspecified when False.
    - `batch_set(keys, values)` stores each record all-or-nothing; returns per key whether it
      is now stored. Setting an existing key again is harmless (records of a key are identical).
    - A method that cannot do its work raises `StorageError` (`StorageUnavailable` when
      transient): it never returns None or a partial list.
    """

    name: ClassVar[str] = "abstract"

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self._stats = BackendStats()
        self._stats_lock = threading.Lock()
        self._warned_corrupt = False
        # Records whose header names another namespace are rejected when ours is known.
        self._namespace = bytes.fromhex(config.namespace) if config.namespace else b""

    # -- to implement ---------------------------------------------------------------------

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int: ...

    @abstractmethod
    def _get_into(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[int]:
        """Raw read. Per key: the stored value's length, or -1 when absent. The bytes are copied
        into `out[i]` only when that length equals `len(out[i])`."""

    @abstractmethod
    def batch_set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]: ...

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None: ...

    @abstractmethod
    def clear(self) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files. Idempotent."""

    # -- provided -------------------------------------------------------------------------

    def batch_get(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[bool]:
        if len(keys) != len(out):
            raise ValueError(f"{len(keys)} keys but {len(out)} buffers")
        if not keys:
            return []
        lengths = self._get_into(keys, out)
        if len(lengths) != len(keys):
            raise AssertionError(f"{type(self).__name__}._get_into returned {len(lengths)} results")
        ok: list[bool] = []
        bad: list[str] = []
        nbytes = 0
        for key, n, buf in zip(keys, lengths, out):
            if n < 0:
                ok.append(False)
                continue
            try:
                if n != len(memoryview(buf).cast("B")):
                    raise StorageCorrupt(f"stored record is {n} bytes, expected {len(buf)}")
                header = verify_record(buf, key)
                if self._namespace and header.namespace != self._namespace:
                    raise StorageCorrupt("record is from another namespace")
            except StorageCorrupt as e:
                bad.append(key)
                ok.append(False)
                if not self._warned_corrupt:
                    self._warned_corrupt = True
                    logger.warning("%s: dropping corrupt page %s: %s", self.name, key[:16], e)
                else:
                    logger.debug("%s: dropping corrupt page %s: %s", self.name, key[:16], e)
                continue
            ok.append(True)
            nbytes += n
        if bad:
            self.report_corrupt(bad)
        self._count(get_pages=len(keys), get_hits=sum(ok), bytes_read=nbytes)
        return ok

    def report_corrupt(self, keys: Sequence[str]) -> None:
        """Count `keys` as corrupt and delete them (a caller that found a bad record can call
        this too). Never raises: a failed delete is only logged."""
        self._count(corrupt_pages=len(keys))
        try:
            self.delete(keys)
        except Exception as e:  # noqa: BLE001 - deletion is best effort
            logger.debug("%s: could not delete corrupt pages: %s", self.name, e)

    def stats(self) -> BackendStats:
        with self._stats_lock:
            return BackendStats(**self._stats.as_dict())

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def _set_gauge(self, **values: int) -> None:
        with self._stats_lock:
            for k, v in values.items():
                setattr(self._stats, k, v)

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

BackendFactory = Callable[[StorageConfig], StorageBackend]
_registered: dict[str, BackendFactory] = {}
_registry_lock = threading.Lock()


def register_backend(name: str, factory: BackendFactory) -> None:
    """Register a backend under `name` at run time (entry points are the normal way)."""
    with _registry_lock:
        _registered[name] = factory


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_backends() -> list[str]:
    """Every backend name that `create_backend` accepts."""
    with _registry_lock:
        names = set(_registered)
    return sorted(names | set(_entry_points()) | {"memory"})


def get_backend_class(name: str) -> BackendFactory:
    with _registry_lock:
        if name in _registered:
            return _registered[name]
    if name == "memory":
        from hicache.memory_backend import MemoryBackend

        return MemoryBackend
    eps = _entry_points()
    if name not in eps:
        raise ConfigError(
            f"unknown storage backend {name!r}; known: {', '.join(known_backends())}"
        )
    try:
        factory = eps[name].load()
    except ImportError as e:
        raise ConfigError(
            f"storage backend {name!r} is installed but cannot be imported ({e}); "
            f"install its extra: pip install 'hicache[{name}]'"
        ) from e
    return factory


def create_backend(name: str, config: StorageConfig) -> StorageBackend:
    """Build backend `name` (lazy import through the entry-point group)."""
    return get_backend_class(name)(config)
