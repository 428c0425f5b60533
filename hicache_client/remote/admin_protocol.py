"""Protocol version 6 of `hicache-server`: the admin API and the read leases' messages
(`admin_pins` came with version 7: `protocol.py` encodes it at 7).

`protocol.py` adds these to its codec. The `admin_*`, `pin` and `unpin` requests carry the
admin token (`--admin-token`) in the `auth` field instead of the data path's token, and are
refused (`unauthorized`) when it is wrong or when the server has no admin token (the admin API
is then off). `bind_namespace` and `shm_release` are data-path requests (the data token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hicache_client.remote.wire import ErrorCode, ProtocolError, Reply, Request

VERSION = 6


def check_namespace(ns: str, request_id: int, *, empty_ok: bool = False) -> None:
    if empty_ok and ns == "":
        return
    if len(ns) != 64 or ns.strip("0123456789abcdef"):
        raise ProtocolError(ErrorCode.MALFORMED, "namespace must be 64 lower-case hex characters",
                            request_id)


@dataclass
class BindNamespaceRequest(Request):
    """This connection's pages are of `namespace`: its misses are counted there (`stats`)."""

    TYPE: ClassVar[str] = "bind_namespace"
    namespace: str = ""

    def check(self) -> None:
        check_namespace(self.namespace, self.request_id)


@dataclass
class BindNamespaceReply(Reply):
    TYPE: ClassVar[str] = "bind_namespace_ok"


@dataclass
class ShmReleaseRequest(Request):
    """The reads in place of the records at `offsets` (located by this connection) are over:
    their read leases end. A client need not wait for the reply."""

    TYPE: ClassVar[str] = "shm_release"
    arena_id: int = 0
    offsets: list[int] = field(default_factory=list)


@dataclass
class ShmReleaseReply(Reply):
    TYPE: ClassVar[str] = "shm_release_ok"
    released: int = 0


@dataclass
class AdminLookupRequest(Request):
    """How many of `keys` (a prompt's page keys, in order) the server holds as a leading run."""

    TYPE: ClassVar[str] = "admin_lookup"
    keys: list[str] = field(default_factory=list)


@dataclass
class AdminLookupReply(Reply):
    """`count`: the leading run held (memory or disk); `in_memory`: the leading run in memory;
    `pinned`: how many of the first `count` are pinned."""

    TYPE: ClassVar[str] = "admin_lookup_ok"
    count: int = 0
    in_memory: int = 0
    pinned: int = 0


@dataclass
class PinRequest(Request):
    """Pin the pages of `keys` that are held; `ttl_ms` > 0: the pin ends on its own then.
    `require_all`: pin nothing unless every page is held (the reply says how many are not)."""

    TYPE: ClassVar[str] = "pin"
    keys: list[str] = field(default_factory=list)
    ttl_ms: int = 0
    require_all: bool = False


@dataclass
class PinReply(Reply):
    TYPE: ClassVar[str] = "pin_ok"
    pinned: int = 0  # pages pinned by this request
    absent: int = 0  # keys not held (not pinned)
    pinned_bytes: int = 0  # bytes of every pinned page held, after this request
    limit_bytes: int = 0


@dataclass
class UnpinRequest(Request):
    TYPE: ClassVar[str] = "unpin"
    keys: list[str] = field(default_factory=list)


@dataclass
class UnpinReply(Reply):
    TYPE: ClassVar[str] = "unpin_ok"
    unpinned: int = 0


@dataclass
class AdminClearRequest(Request):
    """Delete the pages of `namespace` (memory and disk, their pins too); with `all` (and no
    namespace), every page of the server and every pin."""

    TYPE: ClassVar[str] = "admin_clear"
    namespace: str = ""
    all: bool = False

    def check(self) -> None:
        check_namespace(self.namespace, self.request_id, empty_ok=True)
        if bool(self.namespace) == self.all:
            raise ProtocolError(ErrorCode.MALFORMED,
                                "admin_clear: give a namespace or all, not both", self.request_id)


@dataclass
class AdminClearReply(Reply):
    TYPE: ClassVar[str] = "admin_clear_ok"
    deleted: int = 0
    unpinned: int = 0


@dataclass
class AdminStatsRequest(Request):
    TYPE: ClassVar[str] = "admin_stats"


@dataclass
class AdminStatsReply(Reply):
    """`namespaces`: per namespace (64 hex; "-" for misses of connections that named none)
    pages, bytes, pinned_pages, pinned_bytes, hits, misses; `totals`: the server's counters."""

    TYPE: ClassVar[str] = "admin_stats_ok"
    namespaces: dict[str, dict[str, int]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)


@dataclass
class AdminPinsRequest(Request):
    TYPE: ClassVar[str] = "admin_pins"


@dataclass
class AdminPinsReply(Reply):
    """One entry per pin in each list: `keys`, `namespaces` (64 hex; "-": not in memory or not
    a record), `sizes` (bytes; -1: not in memory), `ttl_left_ms` (-1: until unpinned);
    `limit_bytes`: the pin limit."""

    TYPE: ClassVar[str] = "admin_pins_ok"
    keys: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    ttl_left_ms: list[int] = field(default_factory=list)
    limit_bytes: int = 0


ADMIN_REQUESTS: tuple[type[Request], ...] = (
    AdminLookupRequest, PinRequest, UnpinRequest, AdminClearRequest, AdminStatsRequest,
    AdminPinsRequest)
REQUESTS: tuple[type[Request], ...] = (BindNamespaceRequest, ShmReleaseRequest, *ADMIN_REQUESTS)
REPLIES: tuple[type[Reply], ...] = (
    BindNamespaceReply, ShmReleaseReply, AdminLookupReply, PinReply, UnpinReply,
    AdminClearReply, AdminStatsReply, AdminPinsReply)
ADMIN_TYPES = frozenset(c.TYPE for c in ADMIN_REQUESTS)
