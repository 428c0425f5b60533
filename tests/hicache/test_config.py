import pytest

from hicache.config import HiCacheConfig
from hicache.eviction import EVICTION_POLICIES, make_policy
from hicache_client.backend import StorageConfig
from hicache_client.errors import ConfigError
from hicache_client.registry import create_backend, known_backends


@pytest.mark.parametrize("kwargs,msg", [
    (dict(page_size=0), "page_size"),
    (dict(write_policy="write_sideways"), "write_policy"),
    (dict(prefetch_policy="never"), "prefetch_policy"),
    (dict(mem_layout="diagonal"), "mem_layout"),
    (dict(io_backend="magic"), "io_backend"),
    (dict(eviction_policy="random"), "eviction policy"),
    (dict(eviction_policy="slru", eviction_config={"protected_treshold": 2}), "unknown slru"),
    (dict(eviction_policy="lru", eviction_config={"x": 1}), "unknown lru"),
    (dict(eviction_policy="slru", eviction_config={"protected_threshold": 0}), ">= 1"),
    (dict(host_ratio=0), "host_ratio"),
    (dict(prefetch_max_host_share=0), "prefetch_max_host_share"),
    (dict(prefetch_max_host_share=1.5), "prefetch_max_host_share"),
])
def test_bad_config_is_a_start_up_error(kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        HiCacheConfig(**kwargs)


def test_policies_registered():
    assert set(EVICTION_POLICIES) == {"lru", "lfu", "slru", "priority", "fifo", "mru"}
    assert make_policy("slru", {"protected_threshold": 3}).protected_threshold == 3


def test_prefetch_timeout_budget():
    c = HiCacheConfig(prefetch_timeout_base=0.5, prefetch_timeout_per_ki_token=0.25)
    assert c.prefetch_timeout(2048) == pytest.approx(1.0)


def test_unknown_backend_lists_known():
    with pytest.raises(ConfigError) as e:
        create_backend("floppy", StorageConfig())
    for name in ("file", "memory", "redis"):
        assert name in str(e.value)
    assert "memory" in known_backends()


def test_each_backend_is_declared_once_and_installed_as_declared():
    """The pyproject files' entry points are the one list of backends: each name is declared by
    exactly one distribution, and the installed metadata holds exactly those."""
    from importlib import metadata
    from pathlib import Path

    import tomllib

    from hicache_client import registry

    root = Path(__file__).parents[2]
    tables = [tomllib.loads((root / rel).read_text())["project"]["entry-points"]
              [registry.ENTRY_POINT_GROUP] for rel in registry._SOURCE_TREE_PYPROJECTS]
    assert [sorted(t) for t in tables] == [
        ["file", "hf3fs", "lmcache", "memory", "mooncake", "redis"], ["hicache"]]
    installed = {ep.name: ep.value
                 for ep in metadata.entry_points(group=registry.ENTRY_POINT_GROUP)}
    assert installed == {**tables[0], **tables[1]}
    assert registry._source_tree() == installed


class _NoMetadata:
    @staticmethod
    def entry_points(group: str) -> list[object]:
        return []


def test_backends_found_by_name_without_installed_metadata(monkeypatch: pytest.MonkeyPatch):
    """A source tree run in place (no entry points installed: the H200 run of issue 29 failed
    every `file`-backed engine test on 'unknown storage backend') finds the tree's backends in
    its pyproject files."""
    from hicache_client import registry
    from storage_backends.file_backend import FileBackend

    monkeypatch.setattr(registry, "metadata", _NoMetadata)
    monkeypatch.setattr(registry, "_registered", {})  # (other tests' run-time registrations)
    assert registry.get_backend_class("file") is FileBackend
    assert registry.known_backends() == sorted(
        ["file", "hf3fs", "hicache", "lmcache", "memory", "mooncake", "redis"])
    monkeypatch.setattr(registry, "_SOURCE_TREE_PYPROJECTS", ())
    registry._source_tree.cache_clear()
    try:
        with pytest.raises(ConfigError, match="unknown storage backend 'file'; known: $"):
            registry.get_backend_class("file")
    finally:
        registry._source_tree.cache_clear()
