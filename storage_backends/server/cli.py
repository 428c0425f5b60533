"""The `hicache-server` command line: flags, sizes and the `ServerConfig` they make (`main` is
in `server.py`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from hicache_client.units import parse_bytes

AUTH_ENV = "HICACHE_SERVER_AUTH_TOKEN"
ADMIN_ENV = "HICACHE_SERVER_ADMIN_TOKEN"
DEFAULT_PORT = 7480
DEFAULT_MAX_FRAME = 64 << 20
DEFAULT_REPLY_BUDGET = 1 << 30
DEFAULT_CLIENT_REPLY_BUDGET = 64 << 20
DEFAULT_SHM_MAX = 2 << 30
DEFAULT_MAX_HEADER = 8 << 20


# Arena room beyond the capacity for records being written: each client connection holds the
# slots of the batch it writes and of the next one (reserved ahead), 2 x 4 MiB by default, so 8
# busy same-host clients need 64 MiB. A full store whose arena had only capacity / 8 to spare
# sent most writes of 8 clients through the two-copy region path (measured by the SGLang
# plugin's benchmark). Unused room costs nothing: /dev/shm space is taken as blocks are used.
SHM_STORE_ROOM = 256 << 20


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    capacity_bytes: int = 8 << 30
    persist_dir: str | None = None
    persist_queue: int = 4096
    persist_block_ms: int = 100
    persist_capacity_bytes: int = 0
    auth_token: str | None = None
    max_frame_bytes: int = DEFAULT_MAX_FRAME
    max_keys: int = 65536
    max_header_bytes: int = DEFAULT_MAX_HEADER  # frame 0 (msgpack), cut to max_frame_bytes
    metrics_port: int | None = None
    io_threads: int = 2
    reply_budget_bytes: int = DEFAULT_REPLY_BUDGET
    client_reply_budget_bytes: int = DEFAULT_CLIENT_REPLY_BUDGET
    shm_max_bytes: int = DEFAULT_SHM_MAX  # 0: shared-memory attaches refused (--no-shm)
    shm_store_bytes: int = -1  # the arena's data bytes; -1: sized from capacity; 0: off
    admin_token: str | None = None  # None: the admin API is off
    pin_share: float = 0.5  # most of --capacity pinned pages may hold
    read_lease_ms: int = 10_000  # how long a record located for a read in place is held
    tenants_file: str | None = None  # None: one shared token (--auth-token) or none
    require_token_proof: bool = False  # refuse tokens sent as they are (protocol 7 proofs only)
    server_key: str | None = None  # private key file: signs hello replies (clients pin its public)

    @property
    def arena_bytes(self) -> int:
        """Data bytes of the shared-memory store: `shm_store_bytes`, or by default the capacity
        plus the larger of 1/8 of it (records take whole 4 KiB blocks) and `SHM_STORE_ROOM`
        (slots reserved for records clients are writing); 0 (off) with an unbounded capacity.
        /dev/shm space is taken only as blocks are used."""
        if self.shm_store_bytes >= 0:
            return self.shm_store_bytes
        if not self.capacity_bytes:
            return 0
        return self.capacity_bytes + max(self.capacity_bytes // 8, SHM_STORE_ROOM)


def config_from_args(argv: list[str] | None) -> tuple[ServerConfig, str]:
    """Parse and check the command line: the config and the log level."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.client_reply_budget < args.max_frame_bytes:
        parser.error("--client-reply-budget must be at least --max-frame-bytes (one page)")
    if args.reply_budget < args.client_reply_budget:
        parser.error("--reply-budget must be at least --client-reply-budget")
    token = args.auth_token if args.auth_token is not None else os.environ.get(AUTH_ENV) or None
    admin = args.admin_token if args.admin_token is not None else os.environ.get(ADMIN_ENV) or None
    if not 0 <= args.pin_share <= 1:
        parser.error("--pin-share must be between 0 and 1")
    if args.read_lease_ms <= 0:
        parser.error("--read-lease-ms must be > 0")
    if args.tenants_file is not None and token is not None:
        parser.error(f"--tenants-file and --auth-token (or {AUTH_ENV}) exclude each other: "
                     "with a tenants file every data token is a tenant's")
    if args.generate_server_key is not None:
        from hicache_client.errors import ConfigError
        from hicache_client.remote.identity import generate_key_file

        try:
            pub = generate_key_file(args.generate_server_key)
        except ConfigError as e:
            parser.error(str(e))
        print(pub)  # stdout: the public key alone (PUB=$(hicache-server --generate-...))
        parser.exit(0, f"wrote {args.generate_server_key} (private, mode 600) and "
                    f"{args.generate_server_key}.pub (the public key, printed above: clients "
                    "pin it as server_public_key)\n")
    if args.server_key is not None:
        from hicache_client.errors import ConfigError
        from hicache_client.remote.identity import load_private_key

        try:
            load_private_key(args.server_key)
        except ConfigError as e:
            parser.error(str(e))
    config = ServerConfig(
        host=args.host,
        port=args.port,
        capacity_bytes=args.capacity,
        persist_dir=args.persist_dir,
        persist_queue=args.persist_queue,
        persist_block_ms=args.persist_block_ms,
        persist_capacity_bytes=args.persist_capacity,
        auth_token=token,
        max_frame_bytes=args.max_frame_bytes,
        max_keys=args.max_keys,
        max_header_bytes=args.max_header_bytes,
        metrics_port=args.metrics_port,
        io_threads=args.io_threads,
        reply_budget_bytes=args.reply_budget,
        client_reply_budget_bytes=args.client_reply_budget,
        shm_max_bytes=0 if args.no_shm else args.shm_max_bytes,
        shm_store_bytes=-1 if args.shm_store_bytes is None else args.shm_store_bytes,
        admin_token=admin,
        pin_share=args.pin_share,
        read_lease_ms=args.read_lease_ms,
        tenants_file=args.tenants_file,
        require_token_proof=args.require_token_proof,
        server_key=args.server_key,
    )
    return config, args.log_level


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One-line errors (exit 2) for values argparse's types let through."""
    import ipaddress
    import socket

    for flag, value in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if value is not None and not 0 <= value <= 65535:
            parser.error(f"{flag} {value}: a TCP port is 0 to 65535")
    for flag, value in (("--io-threads", args.io_threads), ("--persist-queue", args.persist_queue),
                        ("--max-frame-bytes", args.max_frame_bytes),
                        ("--max-header-bytes", args.max_header_bytes),
                        ("--max-keys", args.max_keys)):
        if value <= 0:
            parser.error(f"{flag} {value}: must be > 0")
    if args.persist_block_ms < 0:
        parser.error(f"--persist-block-ms {args.persist_block_ms}: must be >= 0")
    if args.io_threads > 256:
        parser.error(f"--io-threads {args.io_threads}: at most 256")
    if args.persist_dir is not None and os.path.exists(args.persist_dir) \
            and not os.path.isdir(args.persist_dir):
        parser.error(f"--persist-dir {args.persist_dir}: exists and is not a directory")
    host = args.host
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if host != "*":
            try:
                socket.getaddrinfo(host, None)
            except (OSError, UnicodeError):
                parser.error(f"--host {host}: not an address or a name this host resolves")


def parse_size(text: str) -> int:
    """Bytes in `text`: `4096`, `512MiB`, `8GiB`, `1TiB` (binary), `8GB` (decimal), `8G` (binary)
    (`hicache_client.units.parse_bytes`, the project's one size parser)."""
    return parse_bytes(text)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hicache-server",
        description="Shared L3 page store for HiCache engines (ZeroMQ + msgpack). Engines use it "
        "with --hicache-storage-backend hicache.",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; bind another address only on a trusted "
        "network, and set --auth-token)",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (default %(default)s)")
    p.add_argument(
        "--capacity",
        type=_size,
        default="8GiB",
        help="memory tier capacity: 512MiB, 8GiB, 1TiB, 8GB (decimal) or bytes; least recently "
        "used pages are evicted beyond it (default 8GiB)",
    )
    p.add_argument(
        "--persist-dir",
        default=None,
        help="directory to persist pages to (the `file` backend's layout); a restarted server "
        "serves every page written before a clean shutdown. Default: memory only",
    )
    p.add_argument(
        "--persist-queue",
        type=int,
        default=4096,
        help="write-behind queue length in pages (default %(default)s); when full, a set waits "
        "up to --persist-block-ms, then the page is kept in memory only and counted as dropped",
    )
    p.add_argument(
        "--persist-block-ms",
        type=int,
        default=100,
        help="how long a set may wait for room in a full write-behind queue (default %(default)s)",
    )
    p.add_argument(
        "--persist-capacity",
        type=_size,
        default="0",
        help="byte cap of the persisted pages, LRU-evicted beyond it (default 0: no cap)",
    )
    p.add_argument(
        "--auth-token",
        default=None,
        help=f"shared token every request must carry (default: env {AUTH_ENV}; unset = no auth). "
        "Prefer the environment variable: command lines are visible to other users",
    )
    p.add_argument(
        "--tenants-file",
        default=None,
        help="TOML (or .json) file of tenants: each token's tenant, partition and rights (read, "
        "write, clear), and optionally the partition's cap in memory (max_bytes: past it the "
        "partition evicts its own pages, never another's; with the caps summing to at most "
        "--capacity each is a reservation too); the server keys every page by its "
        "tenant's partition, so no tenant reads, "
        "probes, overwrites or clears another's (docs/security.md). Read again on SIGHUP and by "
        "`hicache-admin reload-tenants`. Excludes --auth-token; turns the shared-memory store off "
        "for tenants (same-host clients use their own regions). Default: no tenants",
    )
    p.add_argument(
        "--require-token-proof",
        action="store_true",
        help="refuse requests that carry their token as it is: clients of protocol 7 prove "
        "their token (an HMAC over a nonce of their connection, `hello`) and never send it; "
        "older clients are refused with an error saying so. Default: both are taken",
    )
    p.add_argument(
        "--server-key",
        default=None,
        metavar="FILE",
        help="the server's Ed25519 private key (PEM, mode 600: a file group or others can read "
        "is refused): every hello reply is signed with it, and clients given its public key "
        "(server_public_key, hicache-admin --server-public-key) refuse a server that does not "
        "hold it. Make one with --generate-server-key. Default: no key (hello replies unsigned)",
    )
    p.add_argument(
        "--generate-server-key",
        default=None,
        metavar="FILE",
        help="write a new server key to FILE (mode 600; an existing file is refused) and its "
        "public key to FILE.pub, print the public key (64 hex characters) on stdout, and exit",
    )
    p.add_argument(
        "--admin-token",
        default=None,
        help=f"token of the admin API (hicache-admin: lookup, pin, unpin, clear, stats) "
        f"(default: env {ADMIN_ENV}; unset = the admin API is off)",
    )
    p.add_argument(
        "--pin-share",
        type=float,
        default=0.5,
        help="most of --capacity that pinned pages may hold together, 0 to 1 (default "
        "%(default)s); a pin past it is refused",
    )
    p.add_argument(
        "--read-lease-ms",
        type=int,
        default=10_000,
        help="how long a page located for a read in place is kept from eviction and reuse if "
        "its reader does not release it first (default %(default)s)",
    )
    p.add_argument(
        "--max-frame-bytes",
        type=_size,
        default=str(DEFAULT_MAX_FRAME),
        help="largest frame (one page record or a request header) accepted; larger ones get a "
        "too_large error reply (default 64MiB)",
    )
    p.add_argument(
        "--max-header-bytes",
        type=_size,
        default=str(DEFAULT_MAX_HEADER),
        help="largest request header (frame 0, msgpack); decoded before any token check, with "
        "each list at most --max-keys long and only a request's flat shape accepted "
        "(default 8MiB; never more than --max-frame-bytes)",
    )
    p.add_argument(
        "--max-keys",
        type=int,
        default=65536,
        help="most keys in one request (default %(default)s)",
    )
    p.add_argument(
        "--reply-budget",
        type=_size,
        default=str(DEFAULT_REPLY_BUDGET),
        help="most bytes held for all clients together beyond the page store: replies not yet "
        "written to a socket plus requests waiting for room (default 1GiB). Server memory "
        "stays within --capacity plus this. With tenants, each partition's connections together "
        "hold at most this divided among the partitions",
    )
    p.add_argument(
        "--client-reply-budget",
        type=_size,
        default=str(DEFAULT_CLIENT_REPLY_BUDGET),
        help="the same, per connection (default 64MiB); also the most page bytes in one get "
        "reply. A client that does not read its replies waits, then gets `busy` errors",
    )
    p.add_argument(
        "--io-threads",
        type=int,
        default=2,
        help="ZeroMQ I/O threads (socket reads and writes run there, outside the GIL); more "
        "help with many clients moving large pages (default %(default)s)",
    )
    p.add_argument(
        "--no-shm",
        action="store_true",
        help="refuse same-host shared-memory regions: every client sends its pages over TCP",
    )
    p.add_argument(
        "--shm-max-bytes",
        type=_size,
        default=str(DEFAULT_SHM_MAX),
        help="most bytes of client shared-memory regions mapped at once; beyond it the least "
        "recently used region is dropped (its client attaches again) (default 2GiB)",
    )
    p.add_argument(
        "--shm-store-bytes",
        type=_size,
        default=None,
        help="size of the shared-memory store: an arena in /dev/shm that holds the memory tier's "
        "pages so that same-host clients read them in place (one copy, no socket bytes); space "
        "is taken from /dev/shm only as pages are stored; 0 turns it off (same-host clients "
        "then read through their own region, two copies) (default: --capacity plus the "
        "larger of 1/8 of it and 256MiB of room for records being written; off with --no-shm or "
        "an unbounded --capacity)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics (default: off)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default %(default)s)",
    )
    return p
