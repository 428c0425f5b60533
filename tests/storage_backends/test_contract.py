"""The L3 contract, run against every backend that ships a `harness_<name>.py`.

Each harness is started once per session; each test gets a cleared store. A new backend joins
by adding its harness module: nothing here names a backend.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from hicache_client.codec import HEADER_BYTES
from tests.storage_backends.conftest import (
    OTHER_NAMESPACE,
    HarnessPool,
    Store,
    assert_reads_back,
    buffers,
    make_codec,
    make_keys,
    make_pages,
    make_records,
)
from tests.storage_backends.harness import discover

HARNESSES = discover()


@pytest.fixture(params=[pytest.param(h, id=h.name, marks=h.marks) for h in HARNESSES])
def store(request: pytest.FixtureRequest, harness_pool: HarnessPool) -> Iterator[Store]:
    s = Store(harness=request.param, factory=harness_pool.factory(request.param))
    s.new().clear()
    try:
        yield s
    finally:
        s.close()


def _as_views(records: list[bytearray]) -> list[memoryview]:
    return [memoryview(r) for r in records]


# ---------------------------------------------------------------------------------------------


def test_discover_finds_the_reference_backend() -> None:
    names = [h.name for h in HARNESSES]
    assert "memory" in names
    assert names == sorted(names)
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("payload", [1, 4096 - HEADER_BYTES, 64 * 1024, 1024 * 1024])
def test_round_trip_is_bit_identical(store: Store, payload: int) -> None:
    b = store.new()
    codec = make_codec(payload)
    keys = make_keys(3, salt=payload)
    recs = make_records(codec, keys, seed=payload)
    assert b.batch_set(keys, _as_views(recs)) == [True, True, True]
    out = buffers(3, codec.record_bytes)
    assert b.batch_get(keys, out) == [True, True, True]
    for o, r in zip(out, recs):
        assert bytes(o) == bytes(r)
    for k, o in zip(keys, out):
        assert bytes(codec.decode(o, k)) == bytes(codec.decode(recs[keys.index(k)], k))


def test_exists_returns_the_leading_run(store: Store) -> None:
    b = store.new()
    codec, keys, recs = make_pages(100, 6)
    present = [0, 1, 3, 5]
    assert b.batch_set([keys[i] for i in present], _as_views([recs[i] for i in present])) == [
        True
    ] * 4
    assert b.batch_exists(keys) == 2
    assert b.batch_exists(keys[:2]) == 2
    assert b.batch_exists(keys[:1]) == 1
    assert b.batch_exists(keys[2:]) == 0
    assert b.batch_exists(keys[3:]) == 1
    assert b.batch_exists([keys[5], keys[3], keys[0], keys[1]]) == 4
    assert b.batch_exists([keys[5], keys[4], keys[0]]) == 1
    assert b.batch_exists([keys[4]] + keys) == 0


def test_partial_batch_get(store: Store) -> None:
    b = store.new()
    codec, keys, recs = make_pages(1000, 5, salt=1)
    assert b.batch_set([keys[0], keys[2], keys[4]], _as_views([recs[0], recs[2], recs[4]])) == [
        True,
        True,
        True,
    ]
    out = buffers(5, codec.record_bytes)
    assert b.batch_get(keys, out) == [True, False, True, False, True]
    for i in (0, 2, 4):
        assert bytes(out[i]) == bytes(recs[i])
    # The hits of a partial batch are the same as those of a full one.
    out2 = buffers(2, codec.record_bytes)
    assert b.batch_get([keys[4], keys[1]], out2) == [True, False]
    assert bytes(out2[0]) == bytes(recs[4])


def test_missing_keys_are_misses(store: Store) -> None:
    b = store.new()
    keys = make_keys(4, salt=2)
    before = b.stats()
    assert b.batch_get(keys, buffers(4, 300)) == [False] * 4
    assert b.batch_exists(keys) == 0
    after = b.stats()
    assert after.get_pages - before.get_pages == 4
    assert after.get_hits - before.get_hits == 0
    assert after.corrupt_pages == before.corrupt_pages
    assert after.errors == before.errors


def test_overwrite_is_idempotent(store: Store) -> None:
    b = store.new()
    codec, keys, recs = make_pages(5000, 3, salt=3)
    assert b.batch_set(keys, _as_views(recs)) == [True] * 3
    pages = b.stats().stored_pages
    assert b.batch_set(keys, _as_views(recs)) == [True] * 3
    assert b.batch_set(keys[1:2], _as_views(recs[1:2])) == [True]
    assert b.batch_exists(keys) == 3
    assert_reads_back(b, codec, keys, recs)
    if pages >= 0:
        assert b.stats().stored_pages == pages


def test_delete(store: Store) -> None:
    b = store.new()
    codec, keys, recs = make_pages(200, 4, salt=4)
    assert b.batch_set(keys, _as_views(recs)) == [True] * 4
    b.delete([keys[1], make_keys(1, salt=99)[0]])  # a missing key is not an error
    assert b.batch_exists(keys) == 1
    assert b.batch_exists(keys[2:]) == 2
    out = buffers(4, codec.record_bytes)
    assert b.batch_get(keys, out) == [True, False, True, True]
    b.delete(keys)
    assert b.batch_exists(keys) == 0
    assert b.batch_exists(keys[3:]) == 0
    b.delete([])


def test_clear(store: Store) -> None:
    b = store.new()
    codec = make_codec(200)
    keys = make_keys(5, salt=5)
    assert b.batch_set(keys, _as_views(make_records(codec, keys))) == [True] * 5
    b.clear()
    assert b.batch_exists(keys) == 0
    assert b.batch_get(keys, buffers(5, codec.record_bytes)) == [False] * 5
    assert b.batch_exists(keys[4:]) == 0
    # Usable after a clear.
    assert b.batch_set(keys[:1], _as_views(make_records(codec, keys[:1]))) == [True]
    assert b.batch_exists(keys) == 1


def test_two_instances_share_pages(store: Store) -> None:
    a, c = store.new(), store.new()
    codec, keys, recs = make_pages(3000, 4, salt=6)
    assert a.batch_set(keys[:3], _as_views(recs[:3])) == [True] * 3
    assert c.batch_exists(keys) == 3
    out = buffers(4, codec.record_bytes)
    assert c.batch_get(keys, out) == [True, True, True, False]
    assert [bytes(o) for o in out[:3]] == [bytes(r) for r in recs[:3]]
    assert c.batch_set(keys[3:], _as_views(recs[3:])) == [True]
    assert a.batch_exists(keys) == 4
    c.delete(keys[:1])
    assert a.batch_exists(keys) == 0
    assert a.batch_get(keys[:2], buffers(2, codec.record_bytes)) == [False, True]
    a.clear()
    assert c.batch_exists(keys[1:]) == 0


def test_record_of_another_namespace_is_never_returned(store: Store) -> None:
    b = store.new()
    theirs = make_codec(400, namespace=OTHER_NAMESPACE)
    keys = make_keys(2, salt=7)
    store.put_raw(keys[0], bytes(make_records(theirs, keys[:1])[0]))
    ours = make_records(make_codec(400), keys[1:])[0]
    assert b.batch_set(keys[1:], [memoryview(ours)]) == [True]
    before = b.stats()
    out = buffers(2, theirs.record_bytes)
    assert b.batch_get(keys, out) == [False, True]
    assert bytes(out[1]) == bytes(ours)
    after = b.stats()
    assert after.corrupt_pages - before.corrupt_pages == 1
    assert after.get_hits - before.get_hits == 1
    if store.harness.deletes_corrupt:
        assert b.batch_exists(keys) == 0
        assert b.batch_exists(keys[1:]) == 1


def _corrupt(kind: str, key: str, other_key: str) -> tuple[bytes, int]:
    """A bad record stored under `key`, and the buffer size a reader asks with."""
    codec = make_codec(2048)
    good = make_records(codec, [key])[0]
    n = codec.record_bytes
    if kind == "payload-bit-flip":
        good[HEADER_BYTES + 1000] ^= 0x10
        return bytes(good), n
    if kind == "header-bit-flip":
        good[70] ^= 0x01  # inside the key digest
        return bytes(good), n
    if kind == "truncated":
        return bytes(good[: n - 1]), n
    if kind == "too-long":
        return bytes(good) + b"\0", n
    if kind == "another-keys-record":
        return bytes(make_records(codec, [other_key])[0]), n
    if kind == "garbage":
        return b"\xff" * n, n
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    ["payload-bit-flip", "header-bit-flip", "truncated", "too-long", "another-keys-record",
     "garbage"],
)
def test_corrupt_record_is_a_counted_miss_and_removed(store: Store, kind: str) -> None:
    b = store.new()
    keys = make_keys(3, salt=8)
    raw, size = _corrupt(kind, keys[0], keys[2])
    store.put_raw(keys[0], raw)
    good = make_records(make_codec(2048), keys[1:2])[0]
    assert b.batch_set(keys[1:2], [memoryview(good)]) == [True]
    assert b.batch_exists(keys[:2]) == 2
    before = b.stats()
    out = buffers(2, size)
    assert b.batch_get(keys[:2], out) == [False, True]
    assert bytes(out[1]) == bytes(good)
    after = b.stats()
    assert after.corrupt_pages - before.corrupt_pages == 1
    assert after.get_pages - before.get_pages == 2
    assert after.get_hits - before.get_hits == 1
    if store.harness.deletes_corrupt:
        assert b.batch_exists(keys[:1]) == 0
        assert b.batch_exists(keys[1:2]) == 1
        # A second read is a plain miss now, not another corrupt page.
        assert b.batch_get(keys[:1], buffers(1, size)) == [False]
        assert b.stats().corrupt_pages == after.corrupt_pages


def test_empty_batches(store: Store) -> None:
    b = store.new()
    before = b.stats()
    assert b.batch_exists([]) == 0
    assert b.batch_get([], []) == []
    assert b.batch_set([], []) == []
    b.delete([])
    after = b.stats()
    assert after.get_pages == before.get_pages
    assert after.set_pages == before.set_pages
    assert after.errors == before.errors


def test_mismatched_lengths_raise(store: Store) -> None:
    b = store.new()
    keys = make_keys(2, salt=9)
    with pytest.raises(ValueError):
        b.batch_get(keys, buffers(1, 10))


def test_stats_counters(store: Store) -> None:
    b = store.new()
    codec, keys, recs = make_pages(1024, 4, salt=10)
    s0 = b.stats()
    assert b.batch_set(keys[:3], _as_views(recs[:3])) == [True] * 3
    s1 = b.stats()
    assert s1.set_pages - s0.set_pages == 3
    assert s1.set_failures - s0.set_failures == 0
    assert s1.bytes_written - s0.bytes_written == 3 * codec.record_bytes
    if s1.stored_pages >= 0:
        assert s1.stored_pages == 3
    if s1.stored_bytes >= 0:
        assert s1.stored_bytes == 3 * codec.record_bytes
    assert b.batch_exists(keys) == 3
    assert b.batch_exists(keys[3:]) == 0
    s2 = b.stats()
    assert s2.exists_calls - s1.exists_calls == 2
    assert b.batch_get(keys, buffers(4, codec.record_bytes)) == [True, True, True, False]
    s3 = b.stats()
    assert s3.get_pages - s2.get_pages == 4
    assert s3.get_hits - s2.get_hits == 3
    assert s3.bytes_read - s2.bytes_read == 3 * codec.record_bytes
    assert s3.corrupt_pages == s0.corrupt_pages
    assert s3.errors == s0.errors
    b.delete(keys[:1])
    s4 = b.stats()
    assert s4.deleted_pages - s3.deleted_pages == 1
    if s4.stored_pages >= 0:
        assert s4.stored_pages == 2


def test_large_batch(store: Store) -> None:
    b = store.new()
    codec, keys, recs = make_pages(4096, 128, salt=11)
    assert b.batch_set(keys, _as_views(recs)) == [True] * 128
    assert b.batch_exists(keys) == 128
    assert_reads_back(b, codec, keys, recs)


def test_concurrent_threads_on_one_object(store: Store) -> None:
    b = store.new()
    codec = make_codec(4000)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            keys = make_keys(16, salt=100 + t)
            recs = make_records(codec, keys, seed=t)
            for i in range(0, 16, 4):
                assert b.batch_set(keys[i : i + 4], _as_views(recs[i : i + 4])) == [True] * 4
                out = buffers(4, codec.record_bytes)
                assert b.batch_get(keys[i : i + 4], out) == [True] * 4
                assert [bytes(o) for o in out] == [bytes(r) for r in recs[i : i + 4]]
            assert b.batch_exists(keys) == 16
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert b.stats().corrupt_pages == 0
