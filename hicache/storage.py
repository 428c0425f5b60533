"""The L3 storage API in one import: the backend ABC, page records and the registry.

The pieces live in their own modules (none of which imports this one):

- hicache.backend: `StorageConfig`, `BackendStats`, the `StorageBackend` ABC;
- hicache.codec: `PageCodec` and `verify_record` (versioned, checksummed page records);
- hicache.registry: `register_backend`, `create_backend`, `known_backends`.

`from hicache.storage import X` keeps working for every name below.
"""

from __future__ import annotations

from hicache.backend import BackendStats, Checked, StorageBackend, StorageConfig
from hicache.codec import (
    DTYPE_CODES,
    HEADER_BYTES,
    LAYOUT_CODES,
    READ_VERSIONS,
    RECORD_MAGIC,
    RECORD_VERSION,
    PageCodec,
    RecordHeader,
    key_digest,
    verify_record,
)
from hicache.registry import (
    ENTRY_POINT_GROUP,
    BackendFactory,
    create_backend,
    get_backend_class,
    known_backends,
    register_backend,
)

__all__ = [
    "DTYPE_CODES",
    "ENTRY_POINT_GROUP",
    "HEADER_BYTES",
    "LAYOUT_CODES",
    "READ_VERSIONS",
    "RECORD_MAGIC",
    "RECORD_VERSION",
    "BackendFactory",
    "BackendStats",
    "Checked",
    "PageCodec",
    "RecordHeader",
    "StorageBackend",
    "StorageConfig",
    "create_backend",
    "get_backend_class",
    "key_digest",
    "known_backends",
    "register_backend",
    "verify_record",
]
