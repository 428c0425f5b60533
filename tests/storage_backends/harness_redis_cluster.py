"""Contract harness for the `redis` backend on a real 3-node Redis Cluster."""

from __future__ import annotations

from tests.storage_backends.harness_redis import redis_harness
from tests.storage_backends.redis_servers import redis_cluster

HARNESS = redis_harness("redis_cluster", lambda tmp: redis_cluster(tmp / "cluster"))
