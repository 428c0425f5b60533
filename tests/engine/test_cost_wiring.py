"""The engine's load-vs-recompute decision (issue 12 item 6, issue 30 item 5): with a deliberately
slow L3 (a throttled wrapper around a real file backend) a restarted engine, which measured L3 at
start-up, recomputes a stored prefix instead of waiting for it from its very first request on,
and its greedy outputs equal caching off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from hicache_client.registry import register_backend
from storage_backends.file_backend import FileBackend
from tests.hicache.test_transfer_cost import ThrottledBackend

pytestmark = pytest.mark.slow

PARAMS = {"max_new_tokens": 6, "ignore_eos": True}


def _prompt(seed: int, n: int = 66) -> list[int]:
    return [seed + (i * (seed + 12)) % 900 for i in range(n)]


def _args(model: Path, store: Path, backend: str) -> dict[str, Any]:
    return {
        "model_path": str(model),
        "page_size": 4,
        "max_total_tokens": 1024,
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": backend,
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"path": str(store), "prefetch_threshold": 8},
    }


def test_slow_l3_is_recomputed_with_equal_outputs(tiny_model: Path, tmp_path: Path) -> None:
    store = tmp_path / "pages"
    first, second = _prompt(7), _prompt(11)
    with Engine(**_args(tiny_model, store, "file")) as writer:
        for p in (first, second):
            writer.generate(input_ids=p, sampling_params=PARAMS)
        writer.wait_transfers(timeout=60)
        assert writer.cache_stats()["storage_backup_pages"] == 2 * (72 // 4)
    with Engine(model_path=str(tiny_model), disable_radix_cache=True, page_size=4) as ref:
        expected = [ref.generate(input_ids=p, sampling_params=PARAMS)[0]["output_ids"]
                    for p in (first, second)]
    # 20 KB/s: loading a token's KV from L3 takes far longer than computing it.
    register_backend(
        "throttled-file", lambda cfg: ThrottledBackend(FileBackend(cfg), 20_000.0)
    )
    with Engine(**_args(tiny_model, store, "throttled-file")) as eng:
        cal = eng.cache_stats()["cost_model"]["calibration"]
        # The start-up probe measured the throttle (at most 20 KB/s on each of the 4 parallel
        # readers), through a second backend instance: the serving one has read nothing.
        assert cal["storage_bytes_per_s"] <= 4 * 20_000.0
        assert eng.cache_stats()["storage"]["get_pages"] == 0
        got1 = eng.generate(input_ids=first, sampling_params=PARAMS)[0]
        s1 = eng.cache_stats()
        got2 = eng.generate(input_ids=second, sampling_params=PARAMS)[0]
        s2 = eng.cache_stats()
    assert [got1["output_ids"], got2["output_ids"]] == expected
    # The first request after the start already recomputes its stored prefix.
    assert s1["storage_hit_tokens"] == 0 and got1["meta_info"]["cached_tokens"] == 0
    assert s1["prefetch_skipped"] == 1 and s1["storage"]["get_pages"] == 0
    assert s2["storage_hit_tokens"] == 0 and got2["meta_info"]["cached_tokens"] == 0
    assert s2["prefetch_skipped"] == 2
