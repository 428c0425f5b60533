"""A second engine on the same file store serves an earlier session's prefix from L3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from tests.engine.workload import make_sessions, run_sessions

pytestmark = pytest.mark.slow


def _args(model: Path, store: Path) -> dict[str, Any]:
    return {
        "model_path": str(model),
        "page_size": 4,
        "max_total_tokens": 1024,
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "file",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"path": str(store), "prefetch_threshold": 8},
    }


def test_restart_serves_prefix_from_storage(tiny_model: Path, tmp_path: Path) -> None:
    store = tmp_path / "pages"
    sessions = make_sessions(6, seed=3, turns=(2, 2))
    with Engine(**_args(tiny_model, store)) as first:
        run_sessions(first, sessions)
        first.wait_transfers(timeout=60)
        written = first.cache_stats()["storage_backup_pages"]
    assert written > 0
    # The next turn of session 0, asked of a fresh engine (empty device and host pools).
    s = sessions[0]
    follow_up = s.history + [11, 12, 13, 14, 15, 16, 17]
    params = {"max_new_tokens": 8, "ignore_eos": True}
    with Engine(model_path=str(tiny_model), disable_radix_cache=True, page_size=4) as ref_engine:
        expected = ref_engine.generate(input_ids=follow_up, sampling_params=params)[0]
    with Engine(**_args(tiny_model, store)) as second:
        got = second.generate(input_ids=follow_up, sampling_params=params)[0]
        stats = second.cache_stats()
    assert got["output_ids"] == expected["output_ids"]
    history_pages = len(s.history) // 4
    assert stats["storage_hit_tokens"] == history_pages * 4
    assert stats["device_hit_tokens"] == stats["host_hit_tokens"] == 0
    assert got["meta_info"]["cached_tokens"] == history_pages * 4
    assert stats["storage"]["get_hits"] >= history_pages
    # Every token L3 held for it was reused (issue 31's outcome accounting).
    assert stats["storage_probed_tokens"] == history_pages * 4
    assert {k: v for k, v in stats["storage_hit_outcomes"].items() if v} == {
        "reused": history_pages * 4}


def test_default_engine_on_a_populated_store_serves_from_l3(tiny_model: Path,
                                                            tmp_path: Path) -> None:
    """Default settings (prefetch policy `timeout`, page size 32, threshold 256): the first
    request of a restarted engine is served from L3, not recomputed (issue 12)."""
    store = tmp_path / "pages"
    args = {"model_path": str(tiny_model), "enable_hierarchical_cache": True,
            "hicache_storage_backend": "file",
            "hicache_storage_backend_extra_config": {"path": str(store)}}
    prompt = [5 + (i * 37) % 900 for i in range(600)]
    params = {"max_new_tokens": 8, "ignore_eos": True}
    with Engine(**args) as first:
        first.generate(input_ids=prompt, sampling_params=params)
        first.wait_transfers(timeout=60)
        assert first.cache_stats()["storage_backup_pages"] == 608 // 32
    follow_up = prompt + [11, 12, 13, 14, 15, 16, 17]
    with Engine(model_path=str(tiny_model), disable_radix_cache=True) as ref_engine:
        expected = ref_engine.generate(input_ids=follow_up, sampling_params=params)[0]
    with Engine(**args) as second:
        assert second.args.hicache_storage_prefetch_policy == "timeout"
        got = second.generate(input_ids=follow_up, sampling_params=params)[0]
        stats = second.cache_stats()
    assert got["output_ids"] == expected["output_ids"]
    # The 18 full pages of the prompt the lookup covers (606 tokens) come from L3.
    assert stats["storage_hit_tokens"] == got["meta_info"]["cached_tokens"] == 18 * 32
    assert stats["device_hit_tokens"] == stats["host_hit_tokens"] == 0
