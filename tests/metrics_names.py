"""Prometheus naming checks shared by the engine's and hicache-server's /metrics tests.

A counter's samples end in `_total`; a label's values must come from a bounded set: a test that
scrapes twice around a load (`check_bounded`) fails when a label's value set grows with requests,
and any label whose name or values look like a key, a request id or a digest fails at once.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

# Label names that carry a value per request or per page.
UNBOUNDED_NAMES = {"rid", "request_id", "key", "page", "digest", "id", "token", "prompt"}
# A value that looks like a digest, a uuid or a long number.
_IDLIKE = re.compile(r"^([0-9a-f]{16,}|[0-9a-f-]{32,36}|\d{6,})$")
# Units a name may end with (before _total/_bucket/...), or none for a count of things.
MAX_VALUES_PER_LABEL = 64


def labels_of(text: str) -> dict[tuple[str, str], set[str]]:
    """(metric family, label name) -> the values seen."""
    out: dict[tuple[str, str], set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            for k, v in sample.labels.items():
                if k in ("le", "quantile"):
                    continue
                out.setdefault((fam.name, k), set()).add(v)
    return out


def check_exposition(text: str, bounded_ids: tuple[str, ...] = ()) -> None:
    """Counters end in _total, no per-request or per-key label, no label past the bound.
    `bounded_ids`: labels whose values are digests from a bounded set (hicache-server's
    `namespace`: one per model/layout/tenant, not per request)."""
    for fam in text_string_to_metric_families(text):
        if fam.type == "counter":
            for sample in fam.samples:
                assert sample.name.endswith(("_total", "_created")), sample.name
    for (name, label), values in labels_of(text).items():
        assert label not in UNBOUNDED_NAMES, f"{name}: label {label!r} is per request/key"
        assert len(values) <= MAX_VALUES_PER_LABEL, f"{name}{{{label}}}: {len(values)} values"
        bad = [] if label in bounded_ids else [v for v in values if _IDLIKE.match(v)]
        assert not bad, f"{name}{{{label}}}: id-like values {bad[:3]}"


def check_bounded(before: str, after: str, allow_new: tuple[str, ...] = ()) -> None:
    """A label's value set may not grow between two scrapes around a load, except the labels
    in `allow_new` (a fixed set's members that appear once used: an op, a namespace written)."""
    a, b = labels_of(before), labels_of(after)
    for k, values in b.items():
        grown = values - a.get(k, set())
        assert not grown or k[1] in allow_new, f"{k[0]}{{{k[1]}}} grew by {sorted(grown)[:3]}"
