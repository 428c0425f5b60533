"""`lmcache` backend against a real LMCache standalone server on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_client.backend import StorageConfig
from hicache_client.errors import ConfigError, StorageUnavailable
from tests.procs import free_port
from tests.storage_backends.conftest import NumberedPages
from tests.storage_backends.harness import config
from tests.storage_backends.harness_lmcache import lmcache_server, lmcache_skip_reason

pytestmark = [
    pytest.mark.lmcache,
    pytest.mark.skipif(lmcache_skip_reason() is not None, reason=str(lmcache_skip_reason())),
]

PAGES = NumberedPages(3000)
CODEC, key, record, buffers = PAGES.codec, PAGES.key, PAGES.record, PAGES.buffers


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lmcache_server(tmp_path_factory.mktemp("lmcache")) as u:
        yield u


def backend(url: str, namespace: str = "00" * 32, **extra: object):  # noqa: ANN201
    from storage_backends.lmcache_backend import LMCacheBackend

    return LMCacheBackend(StorageConfig(extra={"url": url, **extra}, namespace=namespace))


def test_two_clients_share_pages(url: str) -> None:
    keys = [key(i) for i in range(100)]
    with backend(url) as a, backend(url) as b:
        a.clear()
        assert a.batch_set(keys, [memoryview(record(i)) for i in range(100)]) == [True] * 100
        PAGES.assert_first_stored(b, 100, missing=1000)
        s = b.stats()
        assert (s.get_pages, s.get_hits, s.bytes_read) == (101, 100, 100 * CODEC.record_bytes)


def test_delete_clear_and_namespaces(url: str) -> None:
    keys = [key(i) for i in range(5)]
    recs = [memoryview(record(i)) for i in range(5)]
    with backend(url) as a, backend(url) as b, backend(url, "11" * 32) as other:
        a.clear()
        other.clear()
        a.batch_set(keys, recs)
        assert other.batch_exists(keys) == 0  # another namespace never sees our pages
        a.delete([keys[2]])
        assert a.batch_exists(keys) == 2
        assert b.batch_exists(keys) == 2  # a delete is seen by every instance at once
        assert b.batch_get(keys[2:4], buffers(2)) == [False, True]
        a.batch_set([keys[2]], [recs[2]])  # stored again: present everywhere
        assert a.batch_exists(keys) == 5
        assert b.batch_get([keys[2]], buffers(1)) == [True]
        other.batch_set(keys[:1], recs[:1])
        b.clear()  # a new generation, seen by every instance at once
        assert a.batch_exists(keys) == 0
        assert a.batch_get(keys[:1], buffers(1)) == [False]
        assert other.batch_exists(keys[:1]) == 1


def test_corrupt_and_wrong_size_records_are_dropped(url: str) -> None:
    with backend(url) as a:
        bad = record(7)
        bad[500] ^= 0x10
        a.batch_set([key(7), key(8)], [memoryview(bad), memoryview(record(8)[:-1])])
        assert a.batch_get([key(7), key(8)], buffers(2)) == [False, False]
        assert a.stats().corrupt_pages == 2
        assert a.batch_exists([key(7)]) == 0
        # The connection stays usable after a drained wrong-size reply.
        a.batch_set([key(9)], [memoryview(record(9))])
        assert a.batch_get([key(9)], buffers(1)) == [True]


def test_server_down_is_unavailable_and_recovers(tmp_path: Path) -> None:
    port = free_port()
    with lmcache_server(tmp_path, port) as u:
        b = backend(u)
        b.batch_set([key(1)], [memoryview(record(1))])
    try:
        with pytest.raises(StorageUnavailable):
            b.batch_exists([key(1)])
        with pytest.raises(StorageUnavailable):  # fails fast while the breaker is open
            b.batch_exists([key(1)])
        assert b.stats().errors >= 1
        with lmcache_server(tmp_path, port):
            b._backoff.reset()
            assert b.batch_exists([key(1)]) == 0  # a restarted server is empty
            b.batch_set([key(1)], [memoryview(record(1))])
            assert b.batch_get([key(1)], buffers(1)) == [True]
    finally:
        b.close()


def test_config_errors() -> None:
    from storage_backends.lmcache_backend import LMCacheBackend

    with pytest.raises(ConfigError, match="lm://"):
        LMCacheBackend(config({"url": "redis://127.0.0.1:1"}))
    with pytest.raises(ConfigError, match="unknown extra config"):
        LMCacheBackend(config({"url": "lm://127.0.0.1:1", "bogus": 1}))
    with pytest.raises(StorageUnavailable):
        LMCacheBackend(config({"url": f"lm://127.0.0.1:{free_port()}"}))
