"""The engine's miss-attribution counters and the label hygiene of /metrics."""

from __future__ import annotations

from engine.server.metrics import ServerMetrics
from hicache.attribution import MISS_CAUSES
from hicache.stats import CacheStats
from tests.metrics_names import check_exposition


def test_miss_tokens_by_cause_beside_the_hit_counters() -> None:
    s = CacheStats()
    s.prompt_outcomes["never_seen"] = 12
    s.prompt_outcomes["evicted_device"] = 4
    s.prompt_outcomes["device_hit"] = 8
    m = ServerMetrics()
    m.update({**s.as_dict(), "usage": {"page_size": 4}})
    text = m.render().decode()
    assert 'hicache:miss_tokens_total{cause="never_seen"} 12.0' in text
    assert 'hicache:miss_tokens_total{cause="evicted_device"} 4.0' in text
    assert sum(f'cause="{c}"' in text for c in MISS_CAUSES) == len(MISS_CAUSES)
    check_exposition(text)
