"""The connector's `hicache-server` client: `HiCacheServerBackend`, except that a server refusing
our token at start-up is a counted, logged error instead of an exception.

An LMCache engine must keep serving when its remote tier is misconfigured: LMCache would catch
the exception, drop the connector and retry only on its own schedule. With this client the
connector exists either way; every operation on a refusing server is a miss (or a put reported
not stored), counted in `errors`, until the token is right (a server restarted with the token we
hold is used at once).
"""

from __future__ import annotations

import logging

from hicache_client.errors import StorageError, StorageUnavailable
from hicache_client.remote.backend import HiCacheServerBackend

logger = logging.getLogger(__name__)


class ConnectorBackend(HiCacheServerBackend):
    """`HiCacheServerBackend` whose start-up probe never raises."""

    refused: str = ""  # why the server refused us at start-up ("" when it did not)

    def _probe(self) -> None:
        try:
            pong = self.ping()
        except StorageUnavailable as e:
            logger.warning("hicache-server at %s not reachable yet (chunks miss until it is): %s",
                           self.url, e)
            return
        except StorageError as e:
            self.refused = str(e)
            self._count(errors=1)
            logger.error("hicache-server at %s refused us (wrong auth token?): %s; every chunk "
                         "misses until it accepts us", self.url, e)
            return
        self.max_frame_bytes = pong.max_frame_bytes
        logger.info("hicache connector: server %s at %s (protocol %d)", pong.server_version,
                    self.url, pong.protocol_version)
