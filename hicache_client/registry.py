"""The backend registry: backend names -> factories (entry points, run-time registrations).

Backends are found through the ``hicache.storage_backends`` entry-point group, which each
distribution declares in its pyproject.toml (the client: `hicache`; the main one: `memory`,
`file`, `redis`, `mooncake`, `lmcache`, `hf3fs`), and imported only when asked for. That
declaration is the only list: a source tree whose package metadata is not installed (run in
place from ``PYTHONPATH``) reads the same tables from its pyproject files. A name of the form
`module:Class` loads that class directly (a third-party backend without an entry point).
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from hicache_client.backend import StorageBackend, StorageConfig
from hicache_client.errors import ConfigError

ENTRY_POINT_GROUP = "hicache.storage_backends"
# The distributions' own declarations of that group, read where the package metadata is not
# installed (a source tree run in place from PYTHONPATH): the same table, never a second one.
_SOURCE_TREE_PYPROJECTS = ("pyproject.toml", "clients/hicache-client/pyproject.toml")

BackendFactory = Callable[[StorageConfig], StorageBackend]
_registered: dict[str, BackendFactory] = {}
_registry_lock = threading.Lock()


def register_backend(name: str, factory: BackendFactory) -> None:
    """Register a backend under `name` at run time (entry points are the normal way)."""
    with _registry_lock:
        _registered[name] = factory


def _entry_points() -> dict[str, str]:
    """Backend name -> "module:attribute": the installed entry points, over the same tables
    read from the source tree's pyproject files (found only when this package runs from a
    checkout; they fill in what was never installed)."""
    eps = {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return {**_source_tree(), **eps}


@functools.cache
def _source_tree() -> dict[str, str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: a source tree must be installed to find backends by name
        return {}
    root = Path(__file__).resolve().parents[1]
    table: dict[str, str] = {}
    for rel in _SOURCE_TREE_PYPROJECTS:
        path = root / rel
        if path.is_file():
            project = tomllib.loads(path.read_text()).get("project", {})
            table.update(project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {}))
    return table


def known_backends() -> list[str]:
    """Every backend name that `create_backend` accepts."""
    with _registry_lock:
        names = set(_registered)
    return sorted(names | set(_entry_points()))


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
    if ":" in name:
        try:
            return _load(name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"storage backend {name!r} cannot be loaded: {e}") from e
    spec = _entry_points().get(name)
    if spec is None:
        raise ConfigError(
            f"unknown storage backend {name!r}; known: {', '.join(known_backends())}"
        )
    try:
        factory = _load(spec)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"storage backend {name!r} is installed but cannot be imported ({e}); "
            f"install its extra: pip install 'hicache[{name}]'"
        ) from e
    return factory


def create_backend(name: str, config: StorageConfig) -> StorageBackend:
    """Build backend `name` (lazy import through the entry-point group)."""
    return get_backend_class(name)(config)
