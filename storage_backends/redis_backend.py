"""`redis`: page records in Redis or Redis Cluster (redis-py + hiredis), pipelined batches.

One Redis string per page, named ``<key_prefix><page key>``; the record is self-describing
(hicache_client.backend.PageCodec), so no separate metadata key exists and no hash tag is needed: in a
cluster each page's single key lands on its own slot, which spreads pages over every node.
(A hash tag would pin *all* pages to one slot, i.e. one node.)

Every batch is one round trip (one per node in a cluster, sent to all nodes before any reply
is read): `batch_exists` is one ``EVALSHA`` of a tiny Lua script that returns the leading run,
reads are one ``MGET`` (on a cluster, where one command cannot touch keys of many slots: a
pipeline of ``EXISTS`` / ``GET``, the run computed locally); writes are a pipeline of
``SET [PX ttl]``, deletes of ``UNLINK``.

Failure behaviour: a connection error or timeout makes the whole batch a miss (`batch_exists`
-> 0, `batch_get` -> all False, `batch_set` -> all False), counted in `stats().errors`, and opens
a circuit breaker (`hicache_client.backend_util.Backoff`): further calls fail fast, without touching
the network, until the back-off delay has passed; then one call probes the server, and on
success everything resumes. No call waits longer than `socket_timeout` (plus the connect
timeout), and redis-py's own retries are disabled so they cannot stack up behind it.

Extra config (JSON) and environment:

=====================  ============================================  ==========================
key                    meaning                                       default
=====================  ============================================  ==========================
``url``                ``redis://[user:pw@]h:p/db``, ``rediss://``,  env ``HICACHE_REDIS_URL``,
                       ``unix:///path.sock?db=0``, or                else
                       ``redis+cluster://h:p,h:p`` (a cluster)       ``redis://127.0.0.1:6379/0``
``cluster``            treat ``url`` as a cluster seed node          false (env
                                                                     ``HICACHE_REDIS_CLUSTER``)
``key_prefix``         prefix of every Redis key                     ``hicache:<ns[:16]>:``
``ttl_s``              expire pages after this many seconds; 0: no   0
``socket_timeout``     seconds one round trip may take               2.0
``connect_timeout``    seconds a connection attempt may take         ``socket_timeout``
``backoff_initial_s``  first retry delay after a failure             0.05
``backoff_max_s``      longest retry delay                           5.0
``max_connections``    connection pool size (per node)               64
``zero_copy_send``     send values straight from the caller's        true
                       buffers (no hiredis packing copy; single
                       node only)
=====================  ============================================  ==========================
"""

from __future__ import annotations

import logging
import re
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import redis
import redis.connection
from redis.backoff import NoBackoff
from redis.retry import Retry

from hicache_client.backend import StorageBackend, StorageConfig, byte_view
from hicache_client.backend_util import check_known_keys, leading_run, setting
from hicache_client.backoff import Backoff
from hicache_client.errors import ConfigError, StorageUnavailable

logger = logging.getLogger(__name__)

KNOWN_KEYS = (
    "url",
    "cluster",
    "key_prefix",
    "ttl_s",
    "socket_timeout",
    "connect_timeout",
    "backoff_initial_s",
    "backoff_max_s",
    "max_connections",
    "zero_copy_send",
)
DEFAULT_URL = "redis://127.0.0.1:6379/0"
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_CLEAR_CHUNK = 1000
# batch_exists on a single node: the length of the leading run of KEYS present.
_LEADING_RUN_LUA = (
    "for i, k in ipairs(KEYS) do if redis.call('EXISTS', k) == 0 then return i - 1 end end "
    "return #KEYS"
)
T = TypeVar("T")

# Failures that mean "Redis is not reachable now": retried with back-off, pages are misses.
TRANSIENT: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.RedisClusterException,
    OSError,
)


def _zero_copy_class(base: type[Any]) -> type | None:
    """A subclass of `base` that packs commands with redis-py's pure-Python serializer, which
    sends large values (our records) as the caller's own memoryviews instead of copying them
    into one packed buffer as the hiredis packer does. None when this redis-py lacks the hook."""
    serializer = getattr(redis.connection, "PythonRespSerializer", None)
    if serializer is None or not hasattr(base, "_construct_command_packer"):
        return None

    def _construct_command_packer(self: Any, packer: Any) -> Any:
        if packer is not None:
            return packer
        return serializer(self._buffer_cutoff, self.encoder.encode)

    return type(
        f"ZeroCopy{base.__name__}",
        (base,),
        {
            "_construct_command_packer": _construct_command_packer,
        },
    )


def redact(url: str) -> str:
    """`url` with any password replaced by ``***`` (for logs)."""
    return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """``redis+cluster://[user:pw@]h1:p1,h2:p2/?opt=..`` -> seed nodes and client kwargs."""
    scheme, rest = url.split("://", 1)
    rest, _, qs = rest.partition("?")
    netloc = rest.partition("/")[0]
    auth, _, hosts = netloc.rpartition("@")
    query = urllib.parse.parse_qs(qs)
    nodes: list[tuple[str, int]] = []
    for hp in hosts.split(","):
        if not hp:
            continue
        host, _, port = hp.rpartition(":")
        if not host:
            host, port = port, "6379"
        try:
            nodes.append((host.strip("[]"), int(port)))
        except ValueError as e:
            raise ConfigError(f"redis backend: bad cluster node {hp!r} in {redact(url)}") from e
    if not nodes:
        raise ConfigError(f"redis backend: no nodes in {redact(url)}")
    kwargs: dict[str, Any] = {}
    if auth:
        user, _, pw = auth.rpartition(":")
        if user:
            kwargs["username"] = urllib.parse.unquote(user)
        kwargs["password"] = urllib.parse.unquote(pw)
    if scheme.startswith("rediss"):
        kwargs["ssl"] = True
    for k in ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if k in query:
            kwargs[k] = query[k][0]
    return nodes, kwargs


class RedisBackend(StorageBackend):
    """Pages in Redis / Redis Cluster; one pipelined round trip per batch."""

    name: ClassVar[str] = "redis"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        check_known_keys(config, KNOWN_KEYS, self.name)
        self.url = setting(config, "url", DEFAULT_URL, env="HICACHE_REDIS_URL", cast=str)
        scheme = self.url.split("://", 1)[0].lower() if "://" in self.url else ""
        self.cluster = scheme in CLUSTER_SCHEMES or setting(
            config, "cluster", False, env="HICACHE_REDIS_CLUSTER"
        )
        if scheme not in ("redis", "rediss", "unix", *CLUSTER_SCHEMES):
            raise ConfigError(
                f"redis backend: url must start with redis://, rediss://, unix:// or "
                f"redis+cluster://, got {redact(self.url)!r}"
            )
        if self.cluster and scheme == "unix":
            raise ConfigError("redis backend: a cluster is reached over TCP, not unix://")
        default_prefix = f"hicache:{config.namespace[:16]}:" if config.namespace else "hicache:"
        self.key_prefix = setting(config, "key_prefix", default_prefix, cast=str)
        self.ttl_s = setting(config, "ttl_s", 0.0, cast=float)
        self.socket_timeout = setting(config, "socket_timeout", 2.0, cast=float)
        self.connect_timeout = setting(config, "connect_timeout", self.socket_timeout, cast=float)
        max_connections = setting(config, "max_connections", 64, cast=int)
        zero_copy = setting(config, "zero_copy_send", True)
        if self.ttl_s < 0 or self.socket_timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError("redis backend: ttl_s >= 0 and timeouts > 0 required")
        if self.cluster and "{" in self.key_prefix:
            logger.warning(
                "redis backend: key_prefix %r has a hash tag: every page maps to one slot "
                "(one node) of the cluster",
                self.key_prefix,
            )
        self._prefix_b = self.key_prefix.encode()
        self._backoff = Backoff(
            f"redis {redact(self.url)}",
            initial_s=setting(config, "backoff_initial_s", 0.05, cast=float),
            max_s=setting(config, "backoff_max_s", 5.0, cast=float),
        )
        self._client_lock = threading.Lock()
        self._client: Any = None
        self._leading_run_script: Any = None
        self._kwargs: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.connect_timeout,
            "retry": Retry(NoBackoff(), 0),  # our Backoff retries; never stack retries here
            "max_connections": max_connections,
        }
        if scheme != "unix":
            self._kwargs["socket_keepalive"] = True
        if zero_copy:
            base: type[Any] = redis.connection.Connection
            if scheme == "unix":
                base = redis.connection.UnixDomainSocketConnection
            elif scheme.startswith("rediss"):
                base = redis.connection.SSLConnection
            cls = _zero_copy_class(base)
            if cls is not None:
                self._kwargs["connection_class"] = cls
        logger.info(
            "redis backend: %s%s, prefix %r, ttl %s, timeout %.1fs",
            redact(self.url),
            " (cluster)" if self.cluster else "",
            self.key_prefix,
            self.ttl_s or "none",
            self.socket_timeout,
        )

    # -- connection -----------------------------------------------------------------------

    def client(self) -> Any:
        """The redis-py client (`redis.Redis` or `redis.cluster.RedisCluster`), built on first
        use: a standalone client connects lazily; a cluster client must reach a seed node to
        learn the slot map, so building it can fail (a transient error)."""
        c = self._client
        if c is not None:
            return c
        with self._client_lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        if not self.cluster:
            return redis.Redis.from_url(self.url, **self._kwargs)
        from redis.cluster import ClusterNode, RedisCluster

        # NOTE: redis-py builds cluster node clients as Redis(host, port, **kwargs), which
        # takes no connection_class: a cluster sends with the default (hiredis) packer.
        kwargs = {k: v for k, v in self._kwargs.items() if k != "connection_class"}
        if self.url.split("://", 1)[0].lower() in CLUSTER_SCHEMES:
            nodes, extra = parse_cluster_url(self.url)
            return RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in nodes], **kwargs, **extra
            )
        return RedisCluster.from_url(self.url, **kwargs)

    def _call(self, fn: Callable[[Any], T]) -> T:
        """`fn(client)` (one round trip) under the breaker. Raises StorageUnavailable."""
        self._backoff.check()
        try:
            result = fn(self.client())
        except TRANSIENT as e:
            self._backoff.failure(e)
            if self.cluster:
                self._reset_cluster()
            raise StorageUnavailable(f"redis: {e}") from e
        except BaseException:
            self._backoff.success()  # the server answered; the error is ours
            raise
        self._backoff.success()
        return result

    def _run(self, build: Callable[[Any], None]) -> list[Any]:
        """One pipelined round trip of the commands `build(pipe)` queues."""

        def execute(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            build(pipe)
            results: list[Any] = pipe.execute(raise_on_error=False)
            # A connection error of one command (one cluster node) fails the whole batch.
            for r in results:
                if isinstance(r, TRANSIENT):
                    raise r
            return results

        return self._call(execute)

    def _reset_cluster(self) -> None:
        # After a cluster-level failure rebuild the client on the next call, so a restarted
        # cluster (new node ids, moved slots) is rediscovered from the seed nodes.
        with self._client_lock:
            c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception as e:  # noqa: BLE001 - closing a broken client is best effort
                logger.debug("redis backend: closing cluster client: %s", e)

    def _k(self, key: str) -> bytes:
        return self._prefix_b + key.encode()

    def _failed(self, op: str, e: BaseException) -> None:
        self._count(errors=1)
        logger.debug("redis backend: %s failed: %s", op, e)

    # -- the contract ---------------------------------------------------------------------

    def batch_exists(self, keys: Sequence[str]) -> int:
        self._count(exists_calls=1)
        if not keys:
            return 0
        rkeys = [self._k(k) for k in keys]
        try:
            if self.cluster:
                # Keys of one batch live on many slots: one EXISTS each, pipelined per node.
                def build(p: Any) -> None:
                    for k in rkeys:
                        p.exists(k)

                res = self._run(build)
                return leading_run([isinstance(r, int) and r > 0 for r in res])
            # One EVALSHA: the server walks the keys and stops at the first missing one.
            return int(self._call(lambda c: self._exists_script(c)(keys=rkeys)))
        except StorageUnavailable as e:
            self._failed("exists", e)
            return 0

    def _exists_script(self, client: Any) -> Any:
        if self._leading_run_script is None:
            self._leading_run_script = client.register_script(_LEADING_RUN_LUA)
        return self._leading_run_script

    def _get_into(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[int]:
        rkeys = [self._k(k) for k in keys]

        def build(p: Any) -> None:
            for k in rkeys:
                p.get(k)

        try:
            if self.cluster:
                res = self._run(build)  # keys on many slots: GETs pipelined per node
            else:
                res = self._call(lambda c: c.mget(rkeys))  # one command, one array reply
        except StorageUnavailable as e:
            self._failed("get", e)
            return [-1] * len(keys)
        lengths: list[int] = []
        for r, buf in zip(res, out):
            if r is None:
                lengths.append(-1)
            elif isinstance(r, Exception):
                self._failed("get", r)
                lengths.append(-1)
            else:
                dst = byte_view(buf)
                if len(r) == len(dst):
                    dst[:] = r
                lengths.append(len(r))
        return lengths

    def _set_from(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        views = [byte_view(v) for v in values]
        px = int(self.ttl_s * 1000) if self.ttl_s else None

        def build(p: Any) -> None:
            for k, v in zip(keys, views):
                p.set(self._k(k), v, px=px)

        try:
            res = self._run(build)
        except StorageUnavailable as e:
            self._failed("set", e)
            return [False] * len(keys)
        ok: list[bool] = []
        for r in res:
            if isinstance(r, Exception):  # e.g. OOM "used memory > maxmemory"
                self._failed("set", r)
                ok.append(False)
            else:
                ok.append(bool(r))
        return ok

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return

        def build(p: Any) -> None:
            for k in keys:
                p.unlink(self._k(k))

        try:
            res = self._run(build)
        except StorageUnavailable as e:
            self._failed("delete", e)
            raise  # the caller must know the pages may still be there
        self._count(deleted_pages=sum(1 for r in res if isinstance(r, int) and r > 0))

    def clear(self) -> None:
        """Remove every key under `key_prefix` (all nodes of a cluster)."""
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.key_prefix) + "*"
        try:
            self._backoff.check()
        except StorageUnavailable as e:
            self._failed("clear", e)
            raise
        try:
            c = self.client()
            batch: list[bytes] = []
            for k in c.scan_iter(match=pattern, count=_CLEAR_CHUNK):
                batch.append(k)
                if len(batch) >= _CLEAR_CHUNK:
                    self._unlink_raw(batch)
                    batch = []
            if batch:
                self._unlink_raw(batch)
        except TRANSIENT as e:
            self._backoff.failure(e)
            self._failed("clear", e)
            raise StorageUnavailable(f"redis: clear failed: {e}") from e
        self._backoff.success()

    def _unlink_raw(self, raw_keys: list[bytes]) -> None:
        p = self.client().pipeline(transaction=False)
        for k in raw_keys:
            p.unlink(k)
        p.execute()

    def close(self) -> None:
        with self._client_lock:
            c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                logger.debug("redis backend: close: %s", e)

    # -- ops helpers ----------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the breaker is open (the last call failed)."""
        return not self._backoff.down

    def ttl_ms(self, key: str) -> int:
        """Remaining time to live of `key` in ms (-1: none, -2: absent). For tests and ops."""
        return int(self.client().pttl(self._k(key)))

    def raw_put(self, key: str, raw: bytes) -> None:
        """Store `raw` under `key` as-is (bypasses nothing of redis; for corruption tests)."""
        self.client().set(self._k(key), raw)
