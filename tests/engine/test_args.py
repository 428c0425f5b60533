"""`EngineArgs` validation and its mapping onto `HiCacheConfig`."""

from __future__ import annotations

import pytest

from engine.args import EngineArgs
from hicache.config import DEFAULT_PAGE_SIZE
from hicache_client.errors import ConfigError


def test_defaults_follow_sglang() -> None:
    a = EngineArgs()
    assert a.page_size == DEFAULT_PAGE_SIZE
    assert (a.hicache_ratio, a.hicache_size, a.hicache_write_policy) == (2.0, 0.0, "write_through")
    assert (a.hicache_io_backend, a.hicache_mem_layout) == ("direct", "layer_first")
    assert a.hicache_storage_prefetch_policy == "timeout"
    assert (a.radix_eviction_policy, a.schedule_policy) == ("lru", "fcfs")
    assert not a.enable_hierarchical_cache and not a.disable_radix_cache


def test_to_hicache_config() -> None:
    a = EngineArgs(
        page_size=16,
        enable_hierarchical_cache=True,
        hicache_ratio=3.0,
        hicache_write_policy="write_back",
        hicache_mem_layout="page_first",
        hicache_storage_backend="file",
        hicache_storage_backend_extra_config='{"path": "/x", "prefetch_threshold": 64}',
        hicache_storage_prefetch_policy="timeout",
        radix_eviction_policy="slru",
        radix_eviction_policy_config={"protected_threshold": 3},
    )
    c = a.to_hicache_config()
    assert (c.page_size, c.host_ratio, c.write_policy, c.mem_layout) == (
        16, 3.0, "write_back", "page_first")
    assert c.storage_backend == "file"
    assert dict(c.storage_extra_config) == {"path": "/x"}
    assert c.prefetch_threshold == 64
    assert c.prefetch_policy == "timeout"
    assert (c.eviction_policy, dict(c.eviction_config)) == ("slru", {"protected_threshold": 3})
    # Without the hierarchical cache there is no storage tier.
    assert EngineArgs().to_hicache_config().storage_backend is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"page_size": 0}, "page_size must be >= 1"),
        ({"dtype": "int8"}, "unknown dtype 'int8'"),
        ({"attention_backend": "flashinfer"}, "unknown attention_backend 'flashinfer'"),
        ({"schedule_policy": "lifo"}, "unknown schedule_policy 'lifo'"),
        ({"hicache_write_policy": "write_around"}, "unknown hicache_write_policy"),
        ({"hicache_mem_layout": "page_last"}, "unknown hicache_mem_layout"),
        ({"hicache_io_backend": "dma"}, "unknown hicache_io_backend"),
        ({"hicache_storage_prefetch_policy": "never"}, "unknown hicache_storage_prefetch_policy"),
        ({"hicache_ratio": 0}, "hicache_ratio must be > 0"),
        ({"hicache_storage_backend": "file"}, "needs enable_hierarchical_cache"),
        ({"disable_radix_cache": True, "enable_hierarchical_cache": True}, "exclude each other"),
        ({"hicache_storage_backend_extra_config": "{bad"}, "not valid JSON"),
        ({"hicache_storage_backend_extra_config": "[1]"}, "must be a JSON object"),
        ({"radix_eviction_policy": "random"}, "random"),
        ({"radix_eviction_policy": "slru", "radix_eviction_policy_config": {"nope": 1}}, "nope"),
        ({"max_total_tokens": 8, "page_size": 32}, "at least one page"),
        ({"chunked_prefill_size": 4, "page_size": 32}, "chunked_prefill_size"),
        ({"context_length": 1}, "context_length"),
        ({"port": 0}, "port"),
    ],
)
def test_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineArgs(**kwargs)  # type: ignore[arg-type]


def test_every_field_is_documented() -> None:
    """The CLI turns the comment above each field into --help text."""
    import inspect

    import engine.args as mod

    src = inspect.getsource(mod.EngineArgs)
    lines = src.splitlines()
    for name in EngineArgs.field_names():
        idx = next(i for i, ln in enumerate(lines) if ln.strip().startswith(f"{name}:"))
        assert lines[idx - 1].strip().startswith("#"), name
