"""Pool exhaustion, over-long prompts, retraction, aborts and chunked prefill."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from hicache_client.errors import CapacityError, ConfigError


def _prompts(n: int, length: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    head = [rnd.randrange(5, 1000) for _ in range(shared)]
    return [head + [rnd.randrange(5, 1000) for _ in range(length - shared)] for _ in range(n)]


def _run(model: Path, prompts: list[list[int]], new: int = 12, **kw: Any) -> tuple[list[Any], Any]:
    params = {"max_new_tokens": new, "ignore_eos": True}
    with Engine(model_path=str(model), page_size=4, **kw) as e:
        out = e.generate(input_ids=prompts, sampling_params=params)
        stats = e.cache_stats()
        if e.caching:
            e.wait_transfers(60)
            e.cache.check_integrity(outside_device_pages=0)
        else:
            assert stats["usage"]["device_pages_free"] == stats["usage"]["device_pages_total"]
    return [r["output_ids"] for r in out], stats


def test_over_long_and_oversized_prompts(tiny_model: Path) -> None:
    with Engine(model_path=str(tiny_model), page_size=4, context_length=64,
                max_total_tokens=32) as e:
        with pytest.raises(ValueError, match="the context length is 64"):
            e.add_request(input_ids=list(range(1, 70)))
        with pytest.raises(CapacityError, match="the device KV pool holds 32"):
            e.add_request(input_ids=list(range(1, 40)))
        with pytest.raises(ValueError, match="prompt is empty"):
            e.add_request(input_ids=[])
        with pytest.raises(ValueError, match="out of the vocabulary"):
            e.add_request(input_ids=[1, 10**6])
        # One bad prompt in a batch: nothing of the batch stays queued.
        with pytest.raises(ValueError, match="the context length is 64"):
            e.generate(input_ids=[[1, 2, 3], list(range(1, 70))])
        assert not e.has_unfinished()
        # max_new_tokens is clipped to the context; the request finishes by length.
        r = e.generate(input_ids=list(range(1, 20)), sampling_params={"max_new_tokens": 100,
                                                                        "ignore_eos": True})[0]
        assert r["meta_info"]["finish_reason"]["type"] in ("length", "abort")
        assert not e.has_unfinished()


def test_context_outgrows_pool_is_aborted_not_hung(tiny_model: Path) -> None:
    """Alone in a 32-token pool, a 24-token prompt asking for 40 tokens runs out: aborted with a
    message, the engine keeps serving."""
    with Engine(model_path=str(tiny_model), page_size=4, max_total_tokens=32) as e:
        r = e.generate(input_ids=list(range(1, 25)),
                       sampling_params={"max_new_tokens": 40, "ignore_eos": True})[0]
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert "cannot hold" in r["meta_info"]["finish_reason"]["message"]
        assert len(r["output_ids"]) == 32 - 24 + 1
        ok = e.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})[0]
        assert len(ok["output_ids"]) == 4


@pytest.mark.parametrize("mode", ["off", "device", "hierarchical"])
def test_retraction_keeps_outputs(tiny_model: Path, mode: str) -> None:
    """Ten requests of 60 + 40 tokens on a 192-token pool: admission reserves only part of the
    decode growth, so running requests outgrow the pool, are retracted and resumed; every one
    finishes, outputs equal a roomy engine's."""
    prompts = _prompts(10, 60, seed=1, shared=24)
    kw: dict[str, Any] = {"disable_radix_cache": True} if mode == "off" else {}
    if mode == "hierarchical":
        kw = {"enable_hierarchical_cache": True, "hicache_ratio": 4.0}
    expected, _ = _run(tiny_model, prompts, new=40, max_total_tokens=4096)
    got, stats = _run(tiny_model, prompts, new=40, max_total_tokens=192, **kw)
    assert got == expected
    # Deterministic scheduling: the exact retractions and hits of this workload per mode.
    retractions, device_hits, host_hits = {"off": (3, 0, 0), "device": (1, 216, 0),
                                           "hierarchical": (1, 216, 72)}[mode]
    assert stats["scheduler"]["retractions"] == retractions
    assert (stats["device_hit_tokens"], stats["host_hit_tokens"]) == (device_hits, host_hits)
    assert stats["scheduler"]["finished"] == 10


def test_chunked_prefill_and_schedule_policies(tiny_model: Path) -> None:
    prompts = _prompts(6, 90, seed=2, shared=40)
    expected, _ = _run(tiny_model, prompts, disable_radix_cache=True)
    # The 40 shared tokens (10 pages) hit for every request admitted after the first batch: 5 of
    # 6, or 4 of 6 when the first two are admitted together.
    for kw, hits in (({"chunked_prefill_size": 8}, 5 * 40),
                     ({"chunked_prefill_size": 20, "schedule_policy": "lpm"}, 5 * 40),
                     ({"schedule_policy": "lpm", "max_running_requests": 2}, 4 * 40)):
        got, stats = _run(tiny_model, prompts, **kw)
        assert got == expected, kw
        assert (stats["requests"], stats["device_hit_tokens"]) == (6, hits), kw


def test_abort_and_step_api(tiny_model: Path) -> None:
    with Engine(model_path=str(tiny_model), page_size=4, max_total_tokens=512) as e:
        keep = e.add_request(input_ids=list(range(5, 45)), sampling_params={"max_new_tokens": 6,
                                                                             "ignore_eos": True})
        gone = e.add_request(input_ids=list(range(50, 90)),
                             sampling_params={"max_new_tokens": 50, "ignore_eos": True})
        assert not e.abort("no-such-request")
        seen: dict[str, list[int]] = {keep: [], gone: []}
        finished: dict[str, Any] = {}
        steps = 0
        while e.has_unfinished():
            for u in e.step():
                seen[u["rid"]].extend(u["new_token_ids"])
                assert seen[u["rid"]] == u["output_ids"]
                if u["finished"]:
                    finished[u["rid"]] = u["meta_info"]
            steps += 1
            if steps == 3:
                assert e.abort(gone)
        assert finished[keep]["finish_reason"] == {"type": "length", "length": 6}
        assert finished[gone]["finish_reason"]["type"] == "abort"
        assert len(seen[keep]) == 6
        e.wait_transfers(60)
        e.cache.check_integrity(outside_device_pages=0)
        assert e.flush_cache()
        assert e.cache_stats()["usage"]["device_pages_free"] == 512 // 4


def test_engine_args_errors(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match="unknown schedule_policy 'random'"):
        Engine(model_path=str(tiny_model), schedule_policy="random")
    with pytest.raises(ConfigError, match="missing: no such file or directory"):
        Engine(model_path=str(tiny_model / "missing"))
    (tiny_model.parent / "empty").mkdir(exist_ok=True)
    with pytest.raises(ConfigError, match="no config.json"):
        Engine(model_path=str(tiny_model.parent / "empty"))
    with Engine(model_path=str(tiny_model), page_size=4) as e:
        e.add_request(input_ids=[1, 2, 3], rid="x")
        with pytest.raises(ValueError, match="already in use"):
            e.add_request(input_ids=[1, 2, 3], rid="x")


def test_abort_takes_effect_at_once_on_an_idle_engine(tiny_model: Path) -> None:
    """`abort` needs no `step()`: the request leaves the queues, its pages, locks and prefetch
    are given back, and its id can be reused at once (issue 18)."""
    params = {"max_new_tokens": 50, "ignore_eos": True}
    with Engine(model_path=str(tiny_model), page_size=4, max_total_tokens=512,
                enable_hierarchical_cache=True, hicache_storage_backend="memory",
                hicache_synchronous=True,
                hicache_storage_backend_extra_config={"prefetch_threshold": 0}) as e:
        warm = list(range(100, 140))  # 10 pages, written through to host and L3
        e.generate(input_ids=warm, sampling_params={"max_new_tokens": 1})
        e.wait_transfers(60)
        assert e.flush_cache()  # L1 and L2 dropped; L3 keeps the 10 pages
        run = e.add_request(input_ids=list(range(5, 45)), sampling_params=params, rid="run")
        e.step()  # prefilled: 40 tokens of K/V, one output token
        wait = e.add_request(input_ids=warm + [7, 7, 7, 7], sampling_params=params, rid="wait")
        sched = e.scheduler
        assert [r.rid for r in sched.running] == [run] and [r.rid for r in sched.waiting] == [wait]
        use = e.cache.usage()
        assert (use["pending_prefetches"], use["host_inflight_pages"]) == (1, 10)
        assert e.abort(run) and e.abort(wait)
        assert not e.abort(run)
        assert (list(sched.waiting), sched.running, sched.chunked, sched.reqs) == ([], [], None, {})
        assert not e.has_unfinished()
        use = e.cache.usage()
        # The computed 40 tokens of "run" are cached, unlocked; everything else is free.
        assert (use["device_cached_tokens"], use["device_evictable_tokens"]) == (40, 40)
        assert use["device_pages_free"] == 512 // 4 - 10
        assert (use["pending_prefetches"], use["host_inflight_pages"]) == (0, 0)
        e.cache.check_integrity(outside_device_pages=0)
        # The id is free at once; the old request's abort update is not delivered to the new one.
        again = e.add_request(input_ids=list(range(5, 45)),
                              sampling_params={"max_new_tokens": 3, "ignore_eos": True}, rid="run")
        updates: dict[str, list[Any]] = {}
        while e.has_unfinished():
            for u in e.step():
                updates.setdefault(u["rid"], []).append(u)
        assert updates[wait][-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert [u["finished"] for u in updates[again]][-1]
        assert all(u["meta_info"]["finish_reason"] in (None, {"type": "length", "length": 3})
                   for u in updates[again])
        assert len(updates[again][-1]["output_ids"]) == 3
        assert updates[again][0]["meta_info"]["cached_tokens"] == 36  # its own aborted prefix
