"""A short L3 gap (below SGLang's 256-token prefetch floor) on a shared store.

Round robin brings a user back to an engine that already holds the start of the conversation (the
system prompt and older turns) but not the last turns, which another engine computed and wrote to
the shared L3. Such a gap is often shorter than 256 tokens. With `prefetch_threshold` unset the
engine loads it from L3 when its cost model (measured prefill speed against measured L3 and host
bandwidth) says loading saves at least `PREFETCH_MIN_SAVING_S`; a `prefetch_threshold` the user
sets is a hard floor. Greedy outputs equal caching off either way.

Engines run in-process on one file store (what the engines share is the store). The prefill speed
the cost model sees is fed to the engine as a slow one (`observe_prefill`, the call its scheduler
makes after every prefill forward) so that the decision does not depend on how fast this machine
computes the demo model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.engine import Engine

PAGE = 32
SYSTEM = [100 + (i * 7) % 700 for i in range(4 * PAGE)]  # 128 tokens, held by the second engine
HISTORY = [200 + (i * 13) % 600 for i in range(5 * PAGE)]  # 160 tokens: the gap (< 256)
NEW = [300 + (i * 11) % 500 for i in range(PAGE)]  # the new message: nowhere yet
PARAMS = {"max_new_tokens": 8, "ignore_eos": True}


def _args(store: Path, **extra: Any) -> dict[str, Any]:
    return {"page_size": PAGE, "max_total_tokens": 2048, "enable_hierarchical_cache": True,
            "hicache_storage_backend": "file",
            "hicache_storage_prefetch_policy": "wait_complete",
            "hicache_storage_backend_extra_config": {"path": str(store), **extra}}


def _out(eng: Engine, ids: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = eng.generate(input_ids=ids, sampling_params=PARAMS)[0]
    return out


def _second_engine(store: Path, **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """An engine that holds SYSTEM on its device, then serves SYSTEM + HISTORY + NEW while its
    cost model believes prefill runs at 100 tokens/s (the 160-token gap: 1.6 s to compute)."""
    with Engine(**_args(store, **extra)) as eng:
        _out(eng, SYSTEM)
        for _ in range(20):  # the EWMA forgets the real speed measured by the request above
            eng.cache.controller.observe_prefill(100, 1.0)
        got = _out(eng, SYSTEM + HISTORY + NEW)
        return got, eng.cache_stats()


def test_short_gap_is_loaded_from_l3_with_equal_outputs(tmp_path: Path) -> None:
    store = tmp_path / "pages"
    prompt = SYSTEM + HISTORY + NEW
    with Engine(**_args(store)) as first:  # the engine that served the previous turns
        _out(first, SYSTEM + HISTORY)
        first.wait_transfers(timeout=60)
        assert first.cache_stats()["storage_backup_pages"] == (len(SYSTEM) + len(HISTORY)) // PAGE
    with Engine(page_size=PAGE, disable_radix_cache=True) as ref:
        expected = _out(ref, prompt)["output_ids"]

    got, stats = _second_engine(store)  # prefetch_threshold unset
    assert got["output_ids"] == expected
    assert got["meta_info"]["cached_tokens"] == len(SYSTEM) + len(HISTORY)
    assert stats["storage_hit_tokens"] == len(HISTORY)
    assert stats["prefetch_started"] == 1

    got, stats = _second_engine(store, prefetch_threshold=256)  # the user's floor: honoured
    assert got["output_ids"] == expected
    assert got["meta_info"]["cached_tokens"] == len(SYSTEM)
    assert stats["storage_hit_tokens"] == 0
    assert stats["prefetch_started"] == 0
