"""MLA at TP >= 2 on every backend: rank 1 reads what rank 0 wrote.

An MLA model's ranks hold the same latent KV, so the engine gives them one namespace (the seed
is derived with rank 0, `engine.engine`) and only rank 0 writes; every rank's backend still gets
its real `tp_rank` / `tp_size` in `StorageConfig`. A backend that put that rank into its keys
(as `lmcache` once did) would make every MLA read on rank >= 1 a miss. Runs against every
harness of the contract suite (`harness_<name>.py`), each a real component.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.storage_backends.conftest import HarnessPool, Store, assert_reads_back, make_pages
from tests.storage_backends.harness import discover

HARNESSES = discover()


@pytest.fixture(params=[pytest.param(h, id=h.name, marks=h.marks) for h in HARNESSES])
def store(request: pytest.FixtureRequest, harness_pool: HarnessPool) -> Iterator[Store]:
    s = Store(harness=request.param, factory=harness_pool.factory(request.param))
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("tp_size", [2, 4])
def test_every_rank_reads_what_rank_0_wrote(store: Store, tp_size: int) -> None:
    codec, keys, recs = make_pages(3000, 5, salt=900 + tp_size)
    ranks = [store.new(tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
    assert [b.config.tp_rank for b in ranks] == list(range(tp_size))
    assert ranks[1].batch_exists(keys) == 0
    assert ranks[0].batch_set(keys, [memoryview(r) for r in recs]) == [True] * 5
    for b in ranks:
        assert b.batch_exists(keys) == 5
        assert_reads_back(b, codec, keys, recs)
    # And the other way round: a page rank 1 wrote (MHA-style writers) is rank 0's too.
    codec2, keys2, recs2 = make_pages(3000, 2, salt=950 + tp_size)
    assert ranks[-1].batch_set(keys2, [memoryview(r) for r in recs2]) == [True] * 2
    assert ranks[0].batch_exists(keys2) == 2
    assert_reads_back(ranks[0], codec2, keys2, recs2)
