"""Shared pieces of the reliability tests: a tiny random-weight model, engines on it, the
caching-off reference every output is compared with, and small waiting helpers."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from tests.engine.conftest import make_checkpoint

PAGE_SIZE = 4
# Every reliability engine decodes this way: greedy, fixed length, so outputs compare exactly.
SAMPLING: dict[str, Any] = {"max_new_tokens": 4, "ignore_eos": True}
VOCAB = 1000


def make_prompts(n: int, seed: int, *, length: int = 40, shared: int = 16) -> list[list[int]]:
    """`n` prompts of `length` token ids; each group of four shares a `shared`-token prefix
    (so the tree splits and pages are reused within a batch)."""
    rnd = random.Random(seed)
    prefixes = [[rnd.randrange(5, VOCAB) for _ in range(shared)] for _ in range((n + 3) // 4)]
    return [
        prefixes[i // 4] + [rnd.randrange(5, VOCAB) for _ in range(length - shared)]
        for i in range(n)
    ]


def engine_kwargs(model: Path, **kw: Any) -> dict[str, Any]:
    """Engine settings of these tests: CPU, 4-token pages, a small device pool, and storage
    prefetches the scheduler waits for (so a page present in L3 is deterministically a hit)."""
    out: dict[str, Any] = {
        "model_path": str(model),
        "page_size": PAGE_SIZE,
        "max_total_tokens": 1024,
        "device": "cpu",
        "dtype": "float32",
    }
    if kw.get("enable_hierarchical_cache"):
        out["hicache_storage_prefetch_policy"] = "wait_complete"
    out.update(kw)
    return out


def storage_engine(model: Path, backend: str, extra: dict[str, Any], **kw: Any) -> Engine:
    """An engine with host and L3 tiers on `backend`; every storage prefetch is started."""
    return Engine(
        **engine_kwargs(
            model,
            enable_hierarchical_cache=True,
            hicache_storage_backend=backend,
            hicache_storage_backend_extra_config={
                "prefetch_threshold": 0, "load_back_threshold": 0, **extra
            },
            **kw,
        )
    )


def outputs(engine: Engine, prompts: Sequence[Sequence[int]],
            extra_key: str | None = None) -> list[list[int]]:
    res = engine.generate(input_ids=[list(p) for p in prompts], sampling_params=SAMPLING,
                          extra_key=extra_key)
    return [r["output_ids"] for r in res]


def threads_alive(engine: Engine) -> list[bool]:
    """Liveness of every background transfer thread of the engine's cache."""
    return [t.is_alive() for t in engine.cache.controller._threads]


def stat(engine: Engine, name: str) -> float:
    return float(engine.cache_stats()[name])


def storage_stat(engine: Engine, name: str) -> int:
    st = engine.cache_stats()["storage"]
    assert st is not None
    return int(st[name])


def settle(engine: Engine) -> None:
    """Wait for every background transfer, then drop L1 and L2 (L3 keeps its pages)."""
    engine.wait_transfers(120)
    assert engine.flush_cache()


class Reference:
    """Greedy outputs of the same model with caching off (the oracle), memoised per prompt."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._memo: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        todo = [list(p) for p in prompts if tuple(p) not in self._memo]
        if todo:
            for p, out in zip(todo, outputs(self.engine, todo)):
                self._memo[tuple(p)] = out
        return [self._memo[tuple(p)] for p in prompts]

    def assert_matches(self, engine: Engine, prompts: Sequence[Sequence[int]],
                       extra_key: str | None = None) -> None:
        """`engine`'s greedy outputs for `prompts` (under `extra_key`) equal caching off."""
        assert outputs(engine, prompts, extra_key=extra_key) == self(prompts)


@pytest.fixture(autouse=True, scope="session")
def _demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The tiny model borrows the demo model's tokenizer: build that in a temp dir, never in the
    user's ~/.cache."""
    if "HICACHE_DEMO_MODEL_DIR" not in os.environ:
        os.environ["HICACHE_DEMO_MODEL_DIR"] = str(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture(scope="session")
def tiny_model(_demo_model_dir: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama, 2 layers, hidden 64, vocab 1024, random weights (with the demo tokenizer)."""
    return make_checkpoint(tmp_path_factory.mktemp("reliability-ckpt"), "llama")


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> Iterator[Reference]:
    with Engine(**engine_kwargs(tiny_model, disable_radix_cache=True)) as eng:
        yield Reference(eng)
