import pytest

from hicache.config import HiCacheConfig
from hicache.errors import ConfigError
from hicache.eviction import EVICTION_POLICIES, make_policy
from hicache.storage import StorageConfig, create_backend, known_backends


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


def test_source_tree_backends_equal_the_entry_points():
    """`storage_backends.BACKENDS` (the stand-in for uninstalled metadata) names exactly the
    distribution's entry points."""
    from pathlib import Path

    import tomllib

    import storage_backends

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    eps = dict(project["project"]["entry-points"]["hicache.storage_backends"])
    assert eps.pop("memory") == "hicache.memory_backend:MemoryBackend"
    assert eps == storage_backends.BACKENDS


def test_backends_found_by_name_without_installed_metadata(monkeypatch: pytest.MonkeyPatch):
    """A source tree run in place (no entry points installed: the H200 run of issue 29 failed
    every `file`-backed engine test on 'unknown storage backend') finds the tree's backends."""
    from hicache import registry
    from storage_backends.file_backend import FileBackend

    monkeypatch.setattr(registry, "_entry_points", dict)
    monkeypatch.setattr(registry, "_registered", {})  # (other tests' run-time registrations)
    assert registry.get_backend_class("file") is FileBackend
    assert registry.known_backends() == sorted(
        ["file", "hf3fs", "hicache", "lmcache", "memory", "mooncake", "redis"])
    monkeypatch.setattr(registry, "SOURCE_TREE_PACKAGE", "no_such_package")
    with pytest.raises(ConfigError, match="unknown storage backend 'file'; known: memory"):
        registry.get_backend_class("file")
