"""host_memory_mode="buffer_only": host memory stages pages between the device and L3 and caches
nothing (SGLang's --hicache-host-memory-mode buffer_only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hicache_client.errors import ConfigError
from tests.hicache.factories import run_request, sim_cache, tensor_cache
from tools.hitrate.cli import main

SEQ = list(range(100, 108))  # 4 pages of 2


def keys_in_l3(c) -> int:
    return len(c.sim_storage.keys)


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective",
                                          "write_back"])
def test_pages_reach_l3_and_leave_host_memory(write_policy):
    c = sim_cache(page_size=2, device_pages=8, host_pages=8, storage_pages=None,
                  host_memory_mode="buffer_only", write_policy=write_policy,
                  write_through_threshold=1)
    run_request(c, SEQ + [0])
    (node,) = list(c.tree.nodes())
    backed_up = write_policy != "write_back"
    assert (node.value is not None, node.host_value, node.stored) == (True, None, backed_up)
    assert keys_in_l3(c) == (4 if backed_up else 0)
    assert c.host_alloc.num_free == 8
    assert c.evict(8) == 8  # write_back stages it now; either way the node leaves the tree
    assert list(c.tree.nodes()) == [] and keys_in_l3(c) == 4 and c.host_alloc.num_free == 8
    c.check_integrity(0)
    # The next request gets the prefix from L3 through the buffer, which is empty afterwards.
    _, cached = run_request(c, SEQ + [0], rid="again")
    assert cached == 8 and c.stats.storage_hit_tokens == 8 and c.stats.host_hit_tokens == 0
    (node,) = list(c.tree.nodes())
    assert (node.value is not None, node.host_value, node.stored) == (True, None, True)
    assert c.host_alloc.num_free == 8
    c.check_integrity(0)


def test_stored_prefix_is_not_staged_again():
    c = sim_cache(page_size=2, device_pages=8, host_pages=8, storage_pages=None,
                  host_memory_mode="buffer_only")
    run_request(c, SEQ)
    run_request(c, SEQ + [1, 1])  # only the new page goes device -> host -> L3
    assert c.stats.backup_tokens == 10 and c.stats.storage_backup_pages == 5
    assert c.stats.storage_backup_skipped_pages == 0
    c.check_integrity(0)


def test_buffer_only_needs_host_and_storage_tiers():
    with pytest.raises(ConfigError, match="buffer_only needs"):
        sim_cache(host_memory_mode="buffer_only")
    with pytest.raises(ConfigError, match="host_memory_mode"):
        sim_cache(host_memory_mode="sometimes")


def test_real_pools_round_trip_through_the_buffer():
    c = tensor_cache(page_size=4, device_pages=8, host_pages=8, synchronous=True,
                     host_memory_mode="buffer_only")
    tokens = list(range(40, 56))
    pages, _ = run_request(c, tokens, fill=True)
    pool = c.device_pool
    computed = pool.kv[:, :, pool.slots(pages)].clone()
    assert c.evict(16) == 16 and list(c.tree.nodes()) == []
    pool.kv.fill_(3.0)
    c.prefetch("r", tokens + [0])
    acq = c.acquire(tokens + [0], request_id="r")
    assert (acq.cached_tokens, acq.storage_hit_tokens) == (16, 16)
    assert torch.equal(pool.kv[:, :, pool.slots(acq.device_pages)], computed)
    c.release(acq.node)
    assert c.host_alloc.num_free == 8
    c.check_integrity(0)
    c.close()


def test_hitrate_storage_without_host_models_the_buffer(tmp_path: Path, capsys) -> None:
    rows = [{"timestamp": i, "input_length": 16 * len(h), "output_length": 0, "hash_ids": h}
            for i, h in enumerate([[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]])]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(trace), "--block-size", "16", "--device", "3p", "--storage", "unbounded",
                 "--prefetch-threshold", "0", "--no-progress", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["result"]
    # A device of 3 pages holds one request: A and B miss, then each comes back whole from L3
    # (a Mooncake prompt is its blocks plus one unique token).
    assert (res["device_hit_tokens"], res["host_hit_tokens"]) == (0, 0)
    assert res["storage_hit_tokens"] == 2 * 48
