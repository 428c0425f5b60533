"""The engine's request log replayed through the tool reproduces the engine's hit counters."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tools.hitrate.cli import main

engine_mod = pytest.importorskip(
    "engine.engine", reason="the engine (engine.engine) is not built yet"
)

PAGE = 16


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts over a few shared system prefixes and follow-ups (token ids < 256)."""
    systems = [[rng.randrange(5, 250) for _ in range(rng.choice([40, 70]))] for _ in range(3)]
    out: list[list[int]] = []
    for _ in range(n):
        if out and rng.random() < 0.4:
            base = rng.choice(out)
        else:
            base = rng.choice(systems)
        out.append(base + [rng.randrange(5, 250) for _ in range(rng.randrange(3, 30))])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("max_total_tokens", [4096, 384])
def test_replayed_log_matches_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], max_total_tokens: int
) -> None:
    log = tmp_path / "requests.jsonl"
    eng = engine_mod.Engine(
        device="cpu",
        page_size=PAGE,
        max_total_tokens=max_total_tokens,
        request_log=str(log),
        max_running_requests=1,
        hicache_synchronous=True,
    )
    rng = random.Random(5)
    reported = 0
    try:
        for ids in _prompts(rng, 24):
            (res,) = eng.generate(
                input_ids=ids, sampling_params={"max_new_tokens": 6, "temperature": 0.0}
            )
            reported += res["meta_info"]["cached_tokens"]
        stats = eng.cache.stats
    finally:
        close = getattr(eng, "close", None) or getattr(eng, "shutdown", None)
        if close is not None:
            close()
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(rows) == 24 and sum(r["cached_tokens"] for r in rows) == reported
    assert reported > 0
    assert (
        main(
            [
                str(log),
                "--json",
                "--no-progress",
                "--page-size",
                str(PAGE),
                "--device",
                f"{max_total_tokens // PAGE}p",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["trace"]["format"] == "engine"
    measured: dict[str, int] = {}
    for r in rows:
        for k, v in r["cache_outcomes"].items():
            measured[k] = measured.get(k, 0) + v
    assert doc["engine"] == {
        "cached_tokens": reported,
        "simulated_hit_tokens": reported,
        "mismatched_requests": 0,
        "outcomes": measured,
        "predicted_outcomes": None,  # (pages mode)
    }
    # Replayed token by token, the predicted attribution is the engine's, cause by cause.
    args = [str(log), "--json", "--no-progress", "--page-size", str(PAGE),
            "--device", f"{max_total_tokens // PAGE}p", "--replay-mode", "tokens"]
    assert main(args) == 0
    eng_doc = json.loads(capsys.readouterr().out)["engine"]
    assert eng_doc["predicted_outcomes"] == eng_doc["outcomes"] == measured
    assert doc["result"]["device_hit_tokens"] == stats.device_hit_tokens
