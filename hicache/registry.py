"""The backend registry: backend names -> factories (entry points, run-time registrations).

Backends are found through the ``hicache.storage_backends`` entry-point group and imported only
when asked for; `memory` (hicache.memory_backend) is also known by module path, so it works
from a source tree whose package metadata is not installed. A name of the form `module:Class`
loads that class directly (a third-party backend without an entry point).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from importlib import metadata

from hicache.backend import StorageBackend, StorageConfig
from hicache.errors import ConfigError

ENTRY_POINT_GROUP = "hicache.storage_backends"
# Built-in backends by "module:attribute" (imported lazily; no import edge to them here).
_BUILTIN = {"memory": "hicache.memory_backend:MemoryBackend"}

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
    return sorted(names | set(_entry_points()) | set(_BUILTIN))


def _load(spec: str) -> BackendFactory:
    module, _, attr = spec.partition(":")
    factory: BackendFactory = getattr(importlib.import_module(module), attr)
    return factory


def get_backend_class(name: str) -> BackendFactory:
    """The factory of backend `name`: a registered or entry-point name, or `module:Class` for a
    backend class no entry point names (as SGLang's `dynamic` backend loads one by module path
    and class name)."""
    with _registry_lock:
        if name in _registered:
            return _registered[name]
    if name in _BUILTIN:
        return _load(_BUILTIN[name])
    if ":" in name:
        try:
            return _load(name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"storage backend {name!r} cannot be loaded: {e}") from e
    eps = _entry_points()
    if name not in eps:
        raise ConfigError(
            f"unknown storage backend {name!r}; known: {', '.join(known_backends())}"
        )
    try:
        factory: BackendFactory = eps[name].load()
    except ImportError as e:
        raise ConfigError(
            f"storage backend {name!r} is installed but cannot be imported ({e}); "
            f"install its extra: pip install 'hicache[{name}]'"
        ) from e
    return factory


def create_backend(name: str, config: StorageConfig) -> StorageBackend:
    """Build backend `name` (lazy import through the entry-point group)."""
    return get_backend_class(name)(config)
