"""Typed errors. Retry only the transient ones (`StorageUnavailable`)."""

from __future__ import annotations


class HiCacheError(Exception):
    """Base of every error raised by hicache and its backends."""


class ConfigError(HiCacheError, ValueError):
    """A configuration value is invalid; raised at start-up, never mid-run."""


class CapacityError(HiCacheError):
    """A pool cannot hold what was asked of it, even after eviction."""


class StorageError(HiCacheError):
    """An L3 backend operation failed."""


class StorageUnavailable(StorageError):
    """The backend cannot be reached now (connection refused, timeout). Transient: retry with backoff."""


class StorageCorrupt(StorageError):
    """A stored page record failed validation (magic, version, key, length or checksum)."""
