"""`redis` backend specifics against real redis-server processes (single node, unix socket,
3-node cluster): key naming, TTL, one round trip per batch, a dead / hung / restarted /
full server; plus the shared Backoff helper and config parsing (no server needed)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from hicache_client.backend import StorageConfig
from hicache_client.backend_util import as_bool, check_known_keys, leading_run, setting
from hicache_client.backoff import Backoff
from hicache_client.errors import ConfigError, StorageUnavailable
from storage_backends.redis_backend import RedisBackend, parse_cluster_url, redact
from tests.procs import free_port
from tests.storage_backends.conftest import (
    NAMESPACE,
    assert_all_miss,
    assert_reads_back,
    make_codec,
    make_keys,
    make_pages,
    make_records,
)
from tests.storage_backends.redis_servers import (
    HAVE_REDIS,
    SKIP_REASON,
    RedisCluster,
    RedisServer,
    make_test_certs,
    redis_cluster,
    redis_server,
)


def rb(url: str, namespace: bytes = NAMESPACE, **extra: object) -> RedisBackend:
    return RedisBackend(StorageConfig(extra={"url": url, **extra}, namespace=namespace.hex()))


def views(recs: list[bytearray]) -> list[memoryview]:
    return [memoryview(r) for r in recs]


def wait_until_up(b: RedisBackend, key: str, rec: bytearray, timeout: float = 30.0) -> int:
    """Retry a write until the backend has reconnected; returns the number of attempts."""
    deadline = time.monotonic() + timeout
    attempts = 0
    while time.monotonic() < deadline:
        attempts += 1
        if b.batch_set([key], [memoryview(rec)]) == [True]:
            return attempts
        time.sleep(0.05)
    raise AssertionError(f"backend did not reconnect within {timeout}s")


# -- the shared helpers (no server) ----------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_backoff_opens_doubles_caps_and_closes() -> None:
    clock = FakeClock()
    b = Backoff("svc", initial_s=1.0, max_s=4.0, jitter=0.0, clock=clock)
    b.check()
    assert not b.down
    assert b.failure(ConnectionError("refused")) == 1.0
    assert b.down and b.consecutive_failures == 1
    with pytest.raises(StorageUnavailable, match="refused"):
        b.check()
    clock.t += 1.0
    b.check()  # half-open: this caller probes
    with pytest.raises(StorageUnavailable):
        b.check()  # ...and nobody else meanwhile
    assert b.failure("again") == 2.0
    clock.t += 2.0
    b.check()
    assert b.failure("again") == 4.0
    clock.t += 4.0
    b.check()
    assert b.failure("again") == 4.0  # capped at max_s
    assert b.seconds_until_retry() == 4.0
    clock.t += 4.0
    b.check()
    b.success()
    assert not b.down and b.consecutive_failures == 0
    b.check()
    b.check()
    assert b.total_failures == 4
    assert b.total_rejected == 2


def test_backoff_attempt_and_call() -> None:
    clock = FakeClock()
    b = Backoff("svc", initial_s=0.5, jitter=0.0, clock=clock)
    assert b.call(lambda: 7) == 7

    def boom() -> int:
        raise ConnectionRefusedError("nope")

    with pytest.raises(StorageUnavailable, match="nope"):
        b.call(boom)
    assert b.down
    with pytest.raises(StorageUnavailable):
        b.call(lambda: 1)  # fails fast, fn not run
    clock.t += 0.5

    def bad() -> int:
        raise KeyError("not transient")

    with pytest.raises(KeyError):
        b.call(bad)  # passes through, frees the probe slot
    assert b.call(lambda: 2) == 2
    assert not b.down


def test_backoff_jitter_stays_in_bounds() -> None:
    b = Backoff("svc", initial_s=1.0, max_s=1.0, jitter=0.2)
    delays = [b.failure("x") for _ in range(50)]
    assert all(0.8 <= d <= 1.2 for d in delays)
    with pytest.raises(ConfigError):
        Backoff("svc", initial_s=2.0, max_s=1.0)


def test_config_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = StorageConfig(extra={"a": "3", "flag": "yes", "none": None})
    assert setting(cfg, "a", 0) == 3
    assert setting(cfg, "flag", False) is True
    assert setting(cfg, "none", 1.5) == 1.5
    monkeypatch.setenv("HC_TEST_B", "2.5")
    assert setting(cfg, "b", 1.0, env="HC_TEST_B") == 2.5
    monkeypatch.setenv("HC_TEST_A", "9")
    assert setting(cfg, "a", 0, env="HC_TEST_A") == 3  # extra wins over env
    with pytest.raises(ConfigError, match="a: bad value"):
        setting(StorageConfig(extra={"a": "x"}), "a", 0)
    assert [as_bool(v) for v in (True, 0, "on", "False", "")] == [True, False, True, False, False]
    with pytest.raises(ConfigError):
        as_bool("maybe")
    with pytest.raises(ConfigError, match=r"\['zz'\]"):
        check_known_keys(StorageConfig(extra={"a": 1, "zz": 2}), ["a"], "x")
    assert [leading_run(f) for f in ([], [1, 1, 0, 1], [0], [True, True])] == [0, 2, 0, 2]


def test_cluster_url_parsing_and_redaction() -> None:
    nodes, kw = parse_cluster_url("redis+cluster://u:p%40ss@10.0.0.1:7000,h2:7001,h3/")
    assert nodes == [("10.0.0.1", 7000), ("h2", 7001), ("h3", 6379)]
    assert kw == {"username": "u", "password": "p@ss"}
    nodes, kw = parse_cluster_url("rediss+cluster://:pw@h:1?ssl_cert_reqs=none")
    assert nodes == [("h", 1)]
    assert kw == {"password": "pw", "ssl": True, "ssl_cert_reqs": "none"}
    with pytest.raises(ConfigError):
        parse_cluster_url("redis+cluster://h:notaport")
    assert redact("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"


def test_redis_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_REDIS_URL", "redis://127.0.0.1:1/3")
    b = RedisBackend(StorageConfig(namespace="ab" * 32))
    assert b.url == "redis://127.0.0.1:1/3"
    assert b.key_prefix == "hicache:" + "ab" * 8 + ":"
    assert not b.cluster
    assert RedisBackend(StorageConfig()).key_prefix == "hicache:"
    assert rb("redis+cluster://127.0.0.1:1").cluster
    assert rb("redis://127.0.0.1:1", cluster=True).cluster
    with pytest.raises(ConfigError, match="url must start"):
        rb("http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="unknown extra config"):
        rb("redis://127.0.0.1:1", ttl=3)
    with pytest.raises(ConfigError):
        rb("redis://127.0.0.1:1", socket_timeout=0)


def test_nothing_listening_is_a_fast_counted_miss() -> None:
    """No server at all: every operation is a miss, counted; the breaker then skips the
    network entirely until its delay passes."""
    port = free_port()
    b = rb(f"redis://127.0.0.1:{port}/0", backoff_initial_s=60, backoff_max_s=60)
    codec = make_codec(100)
    keys = make_keys(3)
    assert b.batch_exists(keys) == 0
    assert not b.available
    assert_all_miss(b, codec, keys)
    assert b.batch_set(keys, views(make_records(codec, keys))) == [False] * 3
    with pytest.raises(StorageUnavailable):
        b.delete(keys)
    with pytest.raises(StorageUnavailable):
        b.clear()
    st = b.stats()
    assert (st.errors, st.set_failures, st.get_hits, st.get_pages) == (5, 3, 0, 3)
    assert b._backoff.total_failures == 1  # one real attempt; the rest failed fast
    b.close()
    b.close()


# -- a real single server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not HAVE_REDIS:
        pytest.skip(SKIP_REASON)
    with redis_server(tmp_path_factory.mktemp("redis"), unixsocket=True) as s:
        yield s


@pytest.mark.redis
def test_keys_are_prefixed_per_namespace(server: RedisServer) -> None:
    raw = redis.Redis(port=server.port)
    raw.flushall()
    ours, theirs = rb(server.url), rb(server.url, namespace=b"\x07" * 32)
    codec = make_codec(64)
    keys = make_keys(2)
    assert ours.batch_set(keys, views(make_records(codec, keys))) == [True, True]
    other = make_codec(64, namespace=b"\x07" * 32)
    assert theirs.batch_set(keys[:1], views(make_records(other, keys[:1]))) == [True]
    assert sorted(raw.keys()) == sorted(
        [f"hicache:{'00' * 8}:{k}".encode() for k in keys] + [f"hicache:{'07' * 8}:{keys[0]}".encode()]
    )
    assert raw.get(f"hicache:{'00' * 8}:{keys[0]}".encode()) == bytes(
        make_records(codec, keys[:1])[0]
    )
    ours.clear()
    assert raw.keys() == [f"hicache:{'07' * 8}:{keys[0]}".encode()]
    assert theirs.batch_exists(keys) == 1
    custom = rb(server.url, key_prefix="my*app[1]:")
    assert custom.batch_set(keys[:1], views(make_records(codec, keys[:1]))) == [True]
    custom.clear()  # glob characters in the prefix are escaped, nothing else goes
    assert raw.keys() == [f"hicache:{'07' * 8}:{keys[0]}".encode()]
    raw.close()


@pytest.mark.redis
def test_ttl(server: RedisServer) -> None:
    b = rb(server.url, ttl_s=100)
    codec = make_codec(64)
    keys = make_keys(1, salt=1)
    assert b.batch_set(keys, views(make_records(codec, keys))) == [True]
    assert 0 < b.ttl_ms(keys[0]) <= 100_000
    assert rb(server.url).batch_set(keys, views(make_records(codec, keys))) == [True]
    assert b.ttl_ms(keys[0]) == -1  # a write without TTL makes it persistent again
    short = rb(server.url, ttl_s=0.05)
    assert short.batch_set(keys, views(make_records(codec, keys))) == [True]
    deadline = time.monotonic() + 10
    while short.batch_exists(keys) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert short.batch_exists(keys) == 0


@pytest.mark.redis
def test_unix_socket(server: RedisServer) -> None:
    b = rb(server.unix_url)
    codec, keys, recs = make_pages(70000, 3, salt=2)
    assert b.batch_set(keys, views(recs)) == [True] * 3
    assert_reads_back(b, codec, keys, recs)
    assert rb(server.url).batch_exists(keys) == 3  # same server over TCP


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls(tmp_path: Path) -> None:
    """rediss:// against a TLS-only server, certificate checked against a test CA."""
    if not HAVE_REDIS:
        pytest.skip(SKIP_REASON)
    certs = make_test_certs(tmp_path / "certs")
    with redis_server(tmp_path / "r", tls=certs) as s:
        assert s.url.startswith("rediss://")
        b = rb(s.url)
        codec, keys, recs = make_pages(200_000, 3, salt=12)
        assert b.batch_set(keys, views(recs)) == [True] * 3
        assert b.batch_exists(keys) == 3
        assert_reads_back(b, codec, keys, recs)
        assert s.cli("DBSIZE").strip() == "3"
        # Plain TCP to a TLS port is a counted miss, not a crash.
        plain = rb(f"redis://127.0.0.1:{s.port}/0", socket_timeout=0.5)
        assert plain.batch_exists(keys) == 0
        assert plain.stats().errors == 1


@pytest.mark.redis
@pytest.mark.parametrize("zero_copy", [True, False])
def test_one_round_trip_per_batch(server: RedisServer, zero_copy: bool,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    b = rb(server.url, zero_copy_send=zero_copy)
    codec, keys, recs = make_pages(100_000, 16, salt=3)
    b.clear()  # connects, and starts empty
    assert b.batch_exists(keys) == 0  # loads the exists script
    sends: list[int] = []
    reads: list[int] = []
    pool = b.client().connection_pool
    conn = pool.get_connection()
    pool.release(conn)  # the one connection every batch below reuses
    conn_cls = type(conn)
    real_send = conn_cls.send_packed_command
    real_read = conn_cls.read_response

    def send(self: object, *a: object, **kw: object) -> object:
        sends.append(1)
        return real_send(self, *a, **kw)

    def read(self: object, *a: object, **kw: object) -> object:
        reads.append(1)
        return real_read(self, *a, **kw)

    monkeypatch.setattr(conn_cls, "send_packed_command", send)
    monkeypatch.setattr(conn_cls, "read_response", read)
    for op in ("set", "exists", "get"):
        sends.clear()
        if op == "set":
            assert b.batch_set(keys, views(recs)) == [True] * 16
        elif op == "exists":
            assert b.batch_exists(keys) == 16
        else:
            assert_reads_back(b, codec, keys, recs)
        assert len(sends) == 1, op  # the whole batch goes out in one write
    assert len(reads) == 16 + 1 + 1  # SET replies, one script reply, one MGET reply


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A started redis-server of this test alone (the test kills, stops or restarts it)."""
    if not HAVE_REDIS:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path / "r").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.redis
def test_server_killed_and_restarted(own_server: RedisServer) -> None:
    """A crashed server makes every page a counted miss without raising; once it is back on
    the same port the backend resumes by itself (pages held in memory are gone)."""
    server = own_server
    b = rb(server.url, socket_timeout=1.0, backoff_initial_s=0.05, backoff_max_s=0.5)
    codec, keys, recs = make_pages(50_000, 4, salt=4)
    assert b.batch_set(keys[:2], views(recs[:2])) == [True, True]
    assert b.batch_exists(keys) == 2
    server.kill()
    assert b.batch_exists(keys) == 0
    assert_all_miss(b, codec, keys)
    assert b.batch_set(keys[2:], views(recs[2:])) == [False, False]
    assert not b.available
    st = b.stats()
    assert (st.errors, st.set_failures, st.corrupt_pages) == (3, 2, 0)
    server.start()
    attempts = wait_until_up(b, keys[2], recs[2])
    assert attempts >= 1
    assert b.available
    assert b.batch_exists(keys) == 0  # the old pages died with the server
    assert b.batch_set(keys, views(recs)) == [True] * 4
    assert_reads_back(b, codec, keys, recs)
    assert b.stats().corrupt_pages == 0


@pytest.mark.redis
def test_hung_server_times_out_then_resumes(own_server: RedisServer) -> None:
    """A server that stops answering (SIGSTOP) costs one socket timeout, then fast misses;
    after SIGCONT the backend resumes."""
    server = own_server
    b = rb(server.url, socket_timeout=0.3, backoff_initial_s=0.05, backoff_max_s=0.2)
    codec, keys, recs = make_pages(1000, 2, salt=5)
    assert b.batch_set(keys, views(recs)) == [True, True]
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        assert b.batch_exists(keys) == 0
        assert_all_miss(b, codec, keys)
        assert b.stats().errors == 2
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while b.batch_exists(keys) != 2:
        assert time.monotonic() < deadline, "did not resume"
        time.sleep(0.05)
    assert_reads_back(b, codec, keys, recs)


@pytest.mark.redis
def test_server_started_after_backend(tmp_path: Path) -> None:
    if not HAVE_REDIS:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path / "r")
    b = rb(server.url, backoff_initial_s=0.05, backoff_max_s=0.2)
    codec, keys, recs = make_pages(1000, 1, salt=6)
    assert b.batch_exists(keys) == 0
    assert b.stats().errors == 1
    server.start()
    try:
        wait_until_up(b, keys[0], recs[0])
        assert b.batch_exists(keys) == 1
    finally:
        server.stop()


@pytest.mark.redis
def test_full_server_fails_single_pages_cleanly(tmp_path: Path) -> None:
    """maxmemory + noeviction: Redis refuses writes once full; those pages are counted
    failures, the earlier ones stay readable, nothing raises."""
    if not HAVE_REDIS:
        pytest.skip(SKIP_REASON)
    with redis_server(tmp_path / "r",
                      args=("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")) as s:
        b = rb(s.url)
        codec, keys, recs = make_pages(512 * 1024, 16, salt=7)
        ok = b.batch_set(keys, views(recs))
        stored = leading_run(ok)
        assert 0 < stored < 16
        assert ok == [True] * stored + [False] * (16 - stored)
        st = b.stats()
        assert (st.set_failures, st.errors) == (16 - stored, 16 - stored)
        assert b.available  # a full server is not a dead one
        assert b.batch_exists(keys) == stored
        assert_reads_back(b, codec, keys[:stored], recs[:stored])


# -- a real 3-node cluster -----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    if not HAVE_REDIS:
        pytest.skip(SKIP_REASON)
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.mark.redis
@pytest.mark.parametrize("how", ["url", "flag"])
def test_cluster_spreads_pages_over_every_node(cluster: RedisCluster, how: str) -> None:
    b = rb(cluster.url) if how == "url" else rb(cluster.seed_url, cluster=True)
    b.clear()
    assert cluster.dbsizes() == [0, 0, 0]
    codec, keys, recs = make_pages(2000, 60, salt=8)
    assert b.batch_set(keys, views(recs)) == [True] * 60
    sizes = cluster.dbsizes()
    assert sum(sizes) == 60
    assert all(n > 0 for n in sizes)
    other = rb(cluster.nodes[2].url, cluster=True)  # any node is a seed
    assert other.batch_exists(keys) == 60
    assert_reads_back(other, codec, keys, recs)
    other.delete(keys[:30])
    assert sum(cluster.dbsizes()) == 30
    b.clear()
    assert cluster.dbsizes() == [0, 0, 0]


@pytest.mark.redis
def test_cluster_down_is_a_counted_miss(tmp_path: Path) -> None:
    if not HAVE_REDIS:
        pytest.skip(SKIP_REASON)
    with redis_cluster(tmp_path / "c") as c:
        b = rb(c.url, socket_timeout=0.5, backoff_initial_s=0.05, backoff_max_s=0.2)
        codec = make_codec(1000)
        keys = make_keys(8, salt=9)
        assert b.batch_set(keys, views(make_records(codec, keys))) == [True] * 8
        for node in c.nodes:
            node.kill()
        assert b.batch_exists(keys) == 0
        assert_all_miss(b, codec, keys)
        assert b.batch_set(keys, views(make_records(codec, keys))) == [False] * 8
        st = b.stats()
        assert (st.errors, st.set_failures) == (3, 8)
