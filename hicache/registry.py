"""The backend registry: backend names -> factories (entry points, run-time registrations).

Backends are found through the ``hicache.storage_backends`` entry-point group and imported only
when asked for; `memory` (hicache.memory_backend) is also known by module path. A source tree
whose package metadata is not installed (run in place from ``PYTHONPATH``) has no entry points:
there the names the tree's `storage_backends` package lists (`storage_backends.BACKENDS`, looked up
by name, never imported from here otherwise) are found too. A name of the form `module:Class`
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
# The package whose `BACKENDS` table ("name" -> "module:attribute") stands in for entry points
# that are not installed (a source tree on PYTHONPATH).
SOURCE_TREE_PACKAGE = "storage_backends"

BackendFactory = Callable[[StorageConfig], StorageBackend]
_registered: dict[str, BackendFactory] = {}
_registry_lock = threading.Lock()


def register_backend(name: str, factory: BackendFactory) -> None:
    """Register a backend under `name` at run time (entry points are the normal way)."""
    with _registry_lock:
        _registered[name] = factory


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _source_tree() -> dict[str, str]:
    """`storage_backends.BACKENDS` when that package is importable (else nothing)."""
    try:
        table = importlib.import_module(SOURCE_TREE_PACKAGE).BACKENDS
    except (ImportError, AttributeError):
        return {}
    return dict(table)


def known_backends() -> list[str]:
    """Every backend name that `create_backend` accepts."""
    with _registry_lock:
        names = set(_registered)
    return sorted(names | set(_entry_points()) | set(_source_tree()) | set(_BUILTIN))


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
    tree = _source_tree() if name not in eps else {}
    if name not in eps and name not in tree:
        raise ConfigError(
            f"unknown storage backend {name!r}; known: {', '.join(known_backends())}"
        )
    try:
        factory: BackendFactory = eps[name].load() if name in eps else _load(tree[name])
    except ImportError as e:
        raise ConfigError(
            f"storage backend {name!r} is installed but cannot be imported ({e}); "
            f"install its extra: pip install 'hicache[{name}]'"
        ) from e
    return factory


def create_backend(name: str, config: StorageConfig) -> StorageBackend:
    """Build backend `name` (lazy import through the entry-point group)."""
    return get_backend_class(name)(config)
