"""Factories for the hit-rate tool tests: small traces written as JSON lines."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MOONCAKE_TRACE = REPO / "traces" / "mooncake_conversation_trace.jsonl"


def write_jsonl(path: Path, rows: Sequence[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def mooncake_rows(
    reqs: Sequence[tuple[Sequence[int], int]], block_size: int, output: int = 0
) -> list[dict[str, Any]]:
    """One Mooncake record per (hash_ids, input_length); input_length 0 means full blocks."""
    return [
        {
            "timestamp": i,
            "input_length": n or block_size * len(h),
            "output_length": output,
            "hash_ids": list(h),
        }
        for i, (h, n) in enumerate(reqs)
    ]


@pytest.fixture
def mooncake_trace() -> Path:
    """The Mooncake conversation trace shipped in the repository (traces/README.md)."""
    assert MOONCAKE_TRACE.is_file(), f"the repository's trace is missing: {MOONCAKE_TRACE}"
    return MOONCAKE_TRACE


def prefix_trace(path: Path, *, seed: int, requests: int, roots: int, max_blocks: int,
                 one_offs: bool = False) -> Path:
    """A Mooncake trace (block 16, 5 output tokens) of `requests` random prefixes of `roots`
    shared chains (1 to `max_blocks - 1` blocks each); `one_offs`: each followed by a request
    of one block never seen again."""
    rng = random.Random(seed)
    reqs: list[tuple[list[int], int]] = []
    for _ in range(requests):
        root = rng.randrange(roots)
        reqs.append(([root * 100 + k for k in range(rng.randrange(1, max_blocks))], 0))
        if one_offs:
            reqs.append(([1000 + len(reqs)], 0))
    return write_jsonl(path, mooncake_rows(reqs, 16, output=5))
