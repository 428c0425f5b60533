"""Simulated mode: the same decisions as the real cache, and no tensor at all."""

from __future__ import annotations

import ast
import pathlib
import random

import pytest
import torch

import hicache
from hicache.simulation import simulate_request
from tests.hicache.factories import sim_cache, tensor_cache


def test_simulated_mode_allocates_no_tensor(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("simulated mode created a tensor")

    for name in ("zeros", "empty", "tensor", "as_tensor", "arange", "randn", "full", "ones"):
        monkeypatch.setattr(torch, name, forbidden)
    cache = sim_cache(page_size=4, device_pages=8, host_pages=16, storage_pages=64)
    rng = random.Random(0)
    for i in range(200):
        prompt = [rng.randrange(3)] * 8 + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        simulate_request(cache, str(i), prompt, [1, 2, 3])
        cache.check_integrity(0)
    s = cache.stats
    assert s.device_hit_tokens and s.host_hit_tokens and s.evicted_tokens


@pytest.mark.parametrize("admission", ["always", "reuse:2", "frequency:10"])
def test_simulated_and_real_caches_decide_the_same(admission):
    """Same request stream, synchronous real cache vs simulated: identical counters, under each
    L3 admission policy (hicache.admission)."""
    rng = random.Random(1)
    stream = []
    for i in range(150):
        prompt = [rng.randrange(4)] * 8 + [rng.randrange(6) for _ in range(rng.randrange(1, 24))]
        stream.append((str(i), prompt, [rng.randrange(6) for _ in range(rng.randrange(0, 6))]))
    sim = sim_cache(page_size=4, device_pages=10, host_pages=14, storage_pages=None,
                    storage_admission=admission)
    real = tensor_cache(page_size=4, device_pages=10, host_pages=14, synchronous=True,
                        storage_admission=admission)
    for rid, prompt, out in stream:
        a = simulate_request(sim, rid, prompt, out)
        b = simulate_request(real, rid, prompt, out)
        assert a == b, rid
    s, r = sim.stats.as_dict(), real.stats.as_dict()
    for k in ("prefetch_seconds", "storage_backup_seconds", "prefetch_bytes",
              "storage_backup_bytes"):
        s.pop(k), r.pop(k)
    assert s == r
    assert s["storage_hit_tokens"] > 0 and s["host_hit_tokens"] > 0
    assert (s["storage_declined_pages"] > 0) == (admission != "always")


def _hicache_imports() -> dict[str, set[str]]:
    """Every module of hicache/ and the modules (ours or not) it imports, TYPE_CHECKING
    imports included."""
    root = pathlib.Path(hicache.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in sorted(root.glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        graph[f"hicache.{path.stem}"] = names
    return graph


def test_core_imports_stay_inside():
    """hicache imports nothing from engine, storage_backends, tools or integrations (only its
    own modules and hicache_client, the contract it shares with every backend)."""
    graph = _hicache_imports()
    assert "hicache.hiradix" in graph and "hicache.prefetch" in graph
    for mod, names in graph.items():
        for n in names:
            top = n.split(".")[0]
            assert top not in {"engine", "storage_backends", "tools", "integrations"}, f"{mod}: {n}"
