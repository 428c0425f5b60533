"""The server's handlers of protocol version 6 (`admin_protocol`): the admin API, read-lease
releases and `bind_namespace`. The admin's operations are logged at INFO."""

from __future__ import annotations

import logging
from typing import Any

from hicache_client.remote import admin_protocol as A
from hicache_client.remote import protocol as P
from storage_backends.server.admin import PinLimit

logger = logging.getLogger(__name__)


def execute(server: Any, req: P.Request, ident: bytes) -> P.Reply | None:
    """The reply to a version-6 request, or None when `req` is of an older type. `server`: the
    `HiCacheServer` (not imported: it imports this module)."""
    rid = req.request_id
    tiers = server.tiers
    if isinstance(req, P.ShmReleaseRequest):
        server._arena(rid, req.arena_id)
        return P.ShmReleaseReply(request_id=rid,
                                 released=tiers.store.release(ident, req.offsets))
    if isinstance(req, P.BindNamespaceRequest):
        tiers.namespaces.bind(ident, req.namespace)
        return P.BindNamespaceReply(request_id=rid)
    if isinstance(req, P.AdminLookupRequest):
        count, in_memory, pinned = tiers.admin_lookup(req.keys)
        return P.AdminLookupReply(request_id=rid, count=count, in_memory=in_memory,
                                  pinned=pinned)
    if isinstance(req, P.PinRequest):
        if req.ttl_ms < 0:
            raise P.ProtocolError(P.ErrorCode.MALFORMED, "ttl_ms must be >= 0", rid)
        try:
            pinned, absent = tiers.pin(req.keys, req.ttl_ms, require_all=req.require_all)
        except PinLimit as e:
            raise P.ProtocolError(P.ErrorCode.PIN_LIMIT, str(e), rid) from None
        logger.info("admin: pinned %d pages (%d absent)%s", pinned, absent,
                    f" for {req.ttl_ms} ms" if req.ttl_ms else "")
        return P.PinReply(request_id=rid, pinned=pinned, absent=absent,
                          pinned_bytes=tiers.pinned_bytes(), limit_bytes=tiers.pins.limit_bytes)
    if isinstance(req, P.UnpinRequest):
        n = tiers.pins.unpin(req.keys)
        logger.info("admin: unpinned %d pages", n)
        return P.UnpinReply(request_id=rid, unpinned=n)
    if isinstance(req, P.AdminClearRequest):
        ns = bytes.fromhex(req.namespace) if req.namespace else None
        deleted, unpinned = tiers.admin_clear(ns)
        if ns is None:
            logger.warning("admin: cleared the whole server (%d pages, %d pins)", deleted,
                           unpinned)
        else:
            logger.info("admin: cleared namespace %s (%d pages, %d pins)", req.namespace,
                        deleted, unpinned)
        return P.AdminClearReply(request_id=rid, deleted=deleted, unpinned=unpinned)
    if isinstance(req, P.AdminStatsRequest):
        return P.AdminStatsReply(request_id=rid, namespaces=tiers.namespace_rows(),
                                 totals=server.stats())
    if isinstance(req, A.AdminPinsRequest):
        pins = tiers.pin_list()
        return A.AdminPinsReply(
            request_id=rid, keys=[p[0] for p in pins], namespaces=[p[1] for p in pins],
            sizes=[p[2] for p in pins], ttl_left_ms=[p[3] for p in pins],
            limit_bytes=tiers.pins.limit_bytes)
    return None
