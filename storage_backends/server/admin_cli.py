"""`hicache-admin`: ask a `hicache-server` (and its engines) what they hold, and tell it what to
keep or drop.

    hicache-admin [--url URL] [--admin-token T] lookup  PROMPT [--engine URL]... [--json]
    hicache-admin ... pin    PROMPT [--ttl SECONDS] [--allow-partial]
    hicache-admin ... unpin  PROMPT
    hicache-admin ... pins   [--json]
    hicache-admin ... clear  (--namespace HEX | --all)
    hicache-admin ... stats  [--json]
    hicache-admin ... top    [--metrics-url URL] [--interval S] [--once]

PROMPT is `--text TEXT` (tokenized with `--model`, a model path or demo name, or else by the
first `--engine`) or `--token-ids 1,2,3`, with `--extra-key` / `--cache-salt` as the requests
name them. A prompt's page keys need the engines' namespace and page size: from the first
`--engine` (its `/hicache/lookup`), or `--namespace` and `--page-size`. The server's admin API
takes the admin token (`--admin-token` or env `HICACHE_SERVER_ADMIN_TOKEN`); without it every
command is refused. An engine started with `--api-key` takes `--engine-api-key` (env
`HICACHE_ENGINE_API_KEY`). Exit status: 0 done, 1 refused or failed (the reason on stderr, one
line), 2 usage (one line).
"""

from __future__ import annotations

import argparse
import hmac
import json
import math
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import zmq

from hicache_client.keys import page_keys, request_seed
from hicache_client.remote import admin_protocol as A
from hicache_client.remote import protocol as P
from storage_backends.server.cli import ADMIN_ENV, DEFAULT_PORT

R = TypeVar("R", bound=P.Reply)
URL_ENV = "HICACHE_SERVER_URL"
ENGINE_KEY_ENV = "HICACHE_ENGINE_API_KEY"
SERVER_KEY_ENV = "HICACHE_SERVER_PUBLIC_KEY"


class AdminError(Exception):
    """A refused or failed admin operation (the message says why)."""


class AdminClient:
    """One DEALER socket to a server's admin API."""

    def __init__(self, url: str, token: str, timeout_ms: int = 5000,
                 server_key: str | None = None) -> None:
        self.url, self.token, self.timeout_ms = url, token, timeout_ms
        self._server_key = None  # Ed25519PublicKey the server's hello must be signed by
        if server_key:
            from hicache_client.errors import ConfigError
            from hicache_client.remote.identity import parse_public_key

            try:
                self._server_key = parse_public_key(server_key, "--server-public-key")
            except ConfigError as e:
                raise AdminError(str(e)) from None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.connect(url)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise AdminError(f"--url {url}: {e}") from None
        self._ids = 0
        self._nonce: bytes | None = None  # the server's hello nonce: the token is proved
        self._said_hello = False

    def _exchange(self, req: P.Request, token: str) -> P.Reply:
        self._ids += 1
        req.request_id = self._ids
        req.token = P.request_proof(self.token, self._nonce, self._ids, req.TYPE) \
            if self._nonce is not None and token else token
        self._sock.send_multipart(P.encode(req))
        while True:
            if not self._sock.poll(self.timeout_ms, zmq.POLLIN):
                raise AdminError(f"no reply from {self.url} within {self.timeout_ms} ms")
            reply = P.decode(self._sock.recv_multipart(), expect="reply")
            if reply.request_id == req.request_id:
                assert isinstance(reply, P.Reply)
                return reply

    def _hello(self, what: str) -> None:
        """Prove the admin token instead of sending it (protocol 7; an older server gets it
        as it is), and refuse a server that does not hold it."""
        self._said_hello = True
        client_nonce = os.urandom(32)
        reply = self._exchange(P.HelloRequest(token_id=P.token_id(self.token),
                                              client_nonce=client_nonce.hex()), "")
        if isinstance(reply, P.HelloReply):
            nonce = bytes.fromhex(reply.nonce) if len(reply.nonce) >= 32 else b""
            if self._server_key is not None:
                self._check_signature(reply, client_nonce, nonce)
            if nonce and not reply.proof:  # the server checks no such token: it says so next
                self._nonce = nonce
                return
            if not nonce or not hmac.compare_digest(
                    reply.proof, P.server_proof(self.token, nonce, client_nonce)):
                raise AdminError(f"{self.url} does not hold the admin token (its hello proof "
                                 "is wrong): not the server meant")
            self._nonce = nonce
        elif isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.UNAUTHORIZED:
            # The server does not know the token (its hello says so before `what` is sent).
            raise AdminError(f"{self.url} refused {what}: {reply.code}: missing or wrong admin "
                             "token")
        elif self._server_key is not None:
            raise AdminError(f"{self.url} answered no signed hello (a server before protocol 7) "
                             "and --server-public-key is set: refused")

    def _check_signature(self, reply: P.HelloReply, client_nonce: bytes, nonce: bytes) -> None:
        from hicache_client.remote import identity

        assert self._server_key is not None
        if not reply.signature:
            raise AdminError(f"{self.url} holds no server key (started without --server-key) "
                             "and --server-public-key is set: not the server meant")
        data = identity.transcript(P.token_id(self.token), client_nonce, nonce, reply.proof)
        if not nonce or not identity.verify(self._server_key, reply.signature, data):
            raise AdminError(f"{self.url} does not hold the key of --server-public-key (its "
                             "hello signature does not verify): not the server meant")

    def call(self, req: P.Request, kind: type[R]) -> R:
        if not self._said_hello:
            self._hello(req.TYPE)
        reply = self._exchange(req, self.token)
        if isinstance(reply, P.ErrorReply):
            hint = " (a server before protocol 6 has no admin API)" \
                if reply.code in (P.ErrorCode.BAD_VERSION, P.ErrorCode.UNKNOWN_TYPE) else ""
            raise AdminError(f"{self.url} refused {req.TYPE}: {reply.code}: {reply.message}{hint}")
        if not isinstance(reply, kind):
            raise AdminError(f"{self.url} answered {reply.TYPE} to {req.TYPE}")
        return reply

    def close(self) -> None:
        self._sock.close(linger=0)


def engine_lookup(url: str, body: dict[str, Any], timeout_s: float = 30.0,
                  api_key: str | None = None) -> dict[str, Any]:
    """An engine's `POST /hicache/lookup` (`api_key`: the engine's `--api-key`)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        req = urllib.request.Request(url.rstrip("/") + "/hicache/lookup",
                                     data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out
    except urllib.error.HTTPError as e:
        hint = " (the engine's --api-key: pass --engine-api-key or set " \
            f"{ENGINE_KEY_ENV})" if e.code == 401 else ""
        text = " ".join(e.read().decode(errors="replace").split())[:300]
        raise AdminError(f"{url}/hicache/lookup: HTTP {e.code}: {text}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise AdminError(f"{url}/hicache/lookup: {e}") from None


@dataclass
class Prompt:
    """A prompt's tokens and page keys in one namespace."""

    ids: list[int]
    namespace: str
    page_size: int
    extra_key: str | None
    engines: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    partition: str | None = None  # a tenant's partition (--tenants-file): its stored keys

    @property
    def keys(self) -> list[str]:
        seed = request_seed(bytes.fromhex(self.namespace), self.extra_key)
        keys = [d.hex() for d in page_keys(self.ids, self.page_size, seed)]
        if self.partition is None:
            return keys
        from storage_backends.server.tenants import Tenant

        return Tenant(self.partition, self.partition, frozenset()).keys(keys)

    @property
    def reusable_pages(self) -> int:
        """Pages a request can reuse: its last token is always computed."""
        return max(len(self.ids) - 1, 0) // self.page_size


def _extra_key(a: argparse.Namespace) -> str | None:
    if a.extra_key is None or a.cache_salt is None:
        return a.extra_key if a.cache_salt is None else a.cache_salt
    return json.dumps([a.extra_key, a.cache_salt])  # as the engine's cache_key


def resolve_prompt(a: argparse.Namespace) -> Prompt:
    ids: list[int] | None = None
    if a.token_ids is not None:
        try:
            ids = [int(t) for t in a.token_ids.replace(",", " ").split()]
        except ValueError:
            raise AdminError("--token-ids: give integers, e.g. 1,2,3") from None
        bad = next((t for t in ids if not 0 <= t < 1 << 32), None)
        if bad is not None:  # page keys hash token ids as 32-bit unsigned integers
            raise AdminError(f"--token-ids: {bad} is not a token id (0 to {(1 << 32) - 1})")
    elif a.model is not None:
        from engine.demo_model import resolve_model_path
        from engine.tokenizer import load_tokenizer

        try:
            ids = load_tokenizer(resolve_model_path(a.model, "--model")).encode(a.text)
        except Exception as e:  # noqa: BLE001 - ConfigError, OSError, tokenizer errors
            raise AdminError(f"--model {a.model}: {e}") from e
    elif not a.engine:
        raise AdminError("--text needs --model (or an --engine) to tokenize it")
    engines: list[tuple[str, dict[str, Any]]] = []
    for url in a.engine or []:
        body: dict[str, Any] = {"input_ids": ids} if ids is not None else {"text": a.text}
        body.update({k: v for k, v in (("extra_key", a.extra_key),
                                       ("cache_salt", a.cache_salt)) if v is not None})
        out = engine_lookup(url, body, api_key=a.engine_api_key)
        ids = ids if ids is not None else list(out["input_ids"])
        engines.append((url, out))
    assert ids is not None
    ns, ps = a.namespace, a.page_size
    if engines:
        first = engines[0][1]
        ns = ns if ns is not None else first.get("namespace")
        ps = ps if ps is not None else first.get("page_size")
    if not ns or not ps:
        raise AdminError("a prompt's page keys need --engine URL, or --namespace and --page-size")
    return Prompt(ids, ns, int(ps), _extra_key(a), engines, getattr(a, "partition", None))


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


def engine_reuse(o: dict[str, Any], server_reusable: int, same_namespace: bool
                 ) -> tuple[int, str | None]:
    """The tokens the engine's next request for the prompt reuses (device, host, then what it
    reads from the server), and why it reads less from the server than the server holds."""
    local = o["device_tokens"] + o["host_tokens"]
    extra = max(0, server_reusable - local)
    l3 = o.get("l3")
    if not extra:
        return local, None
    if not same_namespace:
        return local, "the engine's namespace is not the one looked up"
    if l3 is None:  # an engine from before l3 decisions: it may read them
        return local + extra, None
    if not l3["prefetch"]:
        return local, f"{extra} tokens held by the server are not read: {l3['reason']}"
    return local + extra, None


def cmd_lookup(c: AdminClient, a: argparse.Namespace) -> dict[str, Any]:
    p = resolve_prompt(a)
    r = c.call(P.AdminLookupRequest(keys=p.keys), P.AdminLookupReply)
    reusable = min(r.count, p.reusable_pages) * p.page_size
    engines = []
    for url, o in p.engines:
        same = o.get("namespace") in (None, p.namespace)
        n, why = engine_reuse(o, reusable, same)
        engines.append({"url": url, "device_tokens": o["device_tokens"],
                        "host_tokens": o["host_tokens"], "namespace": o.get("namespace"),
                        "reused_tokens": n, "why_not_server": why, "l3": o.get("l3")})
    return {
        "namespace": p.namespace, "page_size": p.page_size, "prompt_tokens": len(p.ids),
        "server": {"pages": r.count, "tokens": r.count * p.page_size,
                   "in_memory_pages": r.in_memory, "pinned_pages": r.pinned,
                   "reusable_tokens": reusable},
        "engines": engines,
    }


def show_lookup(out: dict[str, Any]) -> str:
    s = out["server"]
    lines = [f"prompt: {out['prompt_tokens']} tokens, page size {out['page_size']}, "
             f"namespace {out['namespace']}",
             f"server: {s['pages']} leading pages held ({s['tokens']} tokens; "
             f"{s['in_memory_pages']} in memory, {s['pinned_pages']} pinned); a request can "
             f"reuse {s['reusable_tokens']} tokens of them"]
    for e in out["engines"]:
        other = "" if e["namespace"] in (None, out["namespace"]) else \
            f" (another namespace: {e['namespace']})"
        lines.append(f"engine {e['url']}: device {e['device_tokens']} tokens, host "
                     f"{e['host_tokens']} tokens{other}; its next request reuses "
                     f"{e['reused_tokens']} tokens")
        if e["why_not_server"]:
            lines.append(f"  ({e['why_not_server']})")
    return "\n".join(lines)


def cmd_pin(c: AdminClient, a: argparse.Namespace) -> dict[str, Any]:
    p = resolve_prompt(a)
    keys = p.keys
    if not keys:
        raise AdminError(f"the prompt ({len(p.ids)} tokens) has no full page of "
                         f"{p.page_size} tokens: nothing to pin")
    r = c.call(P.PinRequest(keys=keys, ttl_ms=max(1, round(a.ttl * 1000)) if a.ttl else 0,
                            require_all=not a.allow_partial), P.PinReply)
    if r.pinned == 0 or (r.absent and not a.allow_partial):
        raise AdminError(
            f"pin refused: the server holds {len(keys) - r.absent} of the prompt's {len(keys)} "
            f"pages, pinned {r.pinned}" + ("" if a.allow_partial else
                                           " (--allow-partial pins the ones held)"))
    return {"pinned": r.pinned, "absent": r.absent, "pinned_bytes": r.pinned_bytes,
            "limit_bytes": r.limit_bytes, "ttl_s": a.ttl}


def show_pin(out: dict[str, Any]) -> str:
    lease = f" for {out['ttl_s']:g} s" if out["ttl_s"] else " until unpinned"
    return (f"pinned {out['pinned']} pages{lease} ({out['absent']} not held); the server pins "
            f"{out['pinned_bytes']} of at most {out['limit_bytes']} bytes")


def cmd_unpin(c: AdminClient, a: argparse.Namespace) -> dict[str, Any]:
    p = resolve_prompt(a)
    return {"unpinned": c.call(P.UnpinRequest(keys=p.keys), P.UnpinReply).unpinned}


def cmd_clear(c: AdminClient, a: argparse.Namespace) -> dict[str, Any]:
    if bool(a.namespace) == bool(a.all):
        raise AdminError("clear: give --namespace HEX or --all")
    r = c.call(P.AdminClearRequest(namespace=a.namespace or "", all=bool(a.all)),
               P.AdminClearReply)
    return {"namespace": a.namespace or "*", "deleted": r.deleted, "unpinned": r.unpinned}


def cmd_pins(c: AdminClient, a: argparse.Namespace) -> dict[str, Any]:
    r = c.call(A.AdminPinsRequest(), A.AdminPinsReply)
    pins = [{"key": k, "namespace": ns, "bytes": n,
             "ttl_left_s": None if ms < 0 else ms / 1000}
            for k, ns, n, ms in zip(r.keys, r.namespaces, r.sizes, r.ttl_left_ms)]
    return {"pins": sorted(pins, key=lambda x: (x["namespace"], x["key"])),
            "limit_bytes": r.limit_bytes}


def show_pins(out: dict[str, Any]) -> str:
    pins = out["pins"]
    rows = [["namespace", "key", "bytes", "ttl_left_s"]]
    for x in pins:
        ttl = "-" if x["ttl_left_s"] is None else f"{x['ttl_left_s']:.0f}"
        rows.append([x["namespace"] if x["namespace"] == "-" else x["namespace"][:16],
                     x["key"][:16], str(x["bytes"]), ttl])
    held = sum(max(x["bytes"], 0) for x in pins)
    tail = f"{len(pins)} pins, {held} of at most {out['limit_bytes']} bytes"
    return (_table(rows) + "\n" + tail) if pins else tail


def cmd_reload_tenants(c: AdminClient, a: argparse.Namespace) -> dict[str, Any]:
    return {"summary": c.call(P.ReloadTenantsRequest(), P.ReloadTenantsReply).summary}


def cmd_stats(c: AdminClient, a: argparse.Namespace) -> dict[str, Any]:
    r = c.call(P.AdminStatsRequest(), P.AdminStatsReply)
    return {"namespaces": r.namespaces, "totals": r.totals}


def show_stats(out: dict[str, Any]) -> str:
    cols = ["pages", "bytes", "disk_pages", "disk_bytes", "hits", "misses", "pinned_pages",
            "pinned_bytes"]
    rows = [["namespace", *cols]]
    for ns, r in sorted(out["namespaces"].items()):
        rows.append([ns if ns == "-" else ns[:16], *(str(r.get(k, 0)) for k in cols)])
    t = out["totals"]
    disk = [sum(r.get(k, 0) for r in out["namespaces"].values())
            for k in ("disk_pages", "disk_bytes")]
    rows.append(["total", *(str(t.get(k, 0)) for k in ("pages", "bytes")), *map(str, disk),
                 *(str(t.get(k, 0)) for k in ("hits", "misses", "pinned_pages",
                                              "pinned_bytes"))])
    return _table(rows) + (f"\ncapacity {t.get('capacity_bytes', 0)} bytes, pin limit "
                           f"{t.get('pin_limit_bytes', 0)} bytes, read leases "
                           f"{t.get('read_leases', 0)}, evictions {t.get('evictions', 0)}")


COMMANDS = {
    "lookup": (cmd_lookup, show_lookup),
    "pin": (cmd_pin, show_pin),
    "unpin": (cmd_unpin, lambda o: f"unpinned {o['unpinned']} pages"),
    "clear": (cmd_clear, lambda o: f"cleared {o['namespace']}: {o['deleted']} pages deleted, "
                                   f"{o['unpinned']} pins dropped"),
    "pins": (cmd_pins, show_pins),
    "stats": (cmd_stats, show_stats),
    "reload-tenants": (cmd_reload_tenants, lambda o: f"tenants reloaded: {o['summary']}"),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line (`hicache-admin: ...`), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: an integer, not {text!r}") from None
        if n <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be > 0, got {n}")
        if n >= 1 << 31:  # ZeroMQ's poll takes a C int of milliseconds
            raise argparse.ArgumentTypeError(f"{what} must be below {1 << 31}, got {n}")
        return n
    return parse


def _ttl(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ttl: seconds, not {text!r}") from None
    if not math.isfinite(s) or s <= 0:
        raise argparse.ArgumentTypeError(
            f"--ttl must be a finite number of seconds > 0, got {text} (leave it out for a pin "
            "without a lease)")
    if s * 1000 >= 2**63:
        raise argparse.ArgumentTypeError(f"--ttl {text}: too long")
    return s


def _namespace(text: str) -> str:
    ns = text.strip().lower()
    if len(ns) != 64 or ns.strip("0123456789abcdef"):
        raise argparse.ArgumentTypeError(
            f"--namespace: 64 hex characters (a 32-byte seed; `stats` lists them), got {text!r}")
    return ns


def _url(text: str) -> str:
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("tcp", "ipc") or not rest:
        raise argparse.ArgumentTypeError(
            f"--url: the server's ZeroMQ endpoint, tcp://HOST:PORT (or ipc://PATH), got {text!r}"
            " (an engine's http:// URL goes to --engine)")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"--url: tcp://HOST:PORT, got {text!r}")
    return text


def _engine_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"--engine: an engine's HTTP URL (http://HOST:PORT), got {text!r}")
    return text


def _json_flag(sp: argparse.ArgumentParser) -> None:
    """`--json` after the command too (as before it)."""
    sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                    help="print JSON instead of text")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hicache-admin", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", type=_url,
                   default=os.environ.get(URL_ENV, f"tcp://127.0.0.1:{DEFAULT_PORT}"),
                   help=f"the server's endpoint, tcp://HOST:PORT (default: env {URL_ENV} or "
                        "%(default)s)")
    p.add_argument("--admin-token", default=None,
                   help=f"the server's --admin-token (default: env {ADMIN_ENV})")
    p.add_argument("--server-public-key", default=os.environ.get(SERVER_KEY_ENV),
                   help="the server's public key (64 hex characters, or its FILE.pub): refuse "
                        "a server whose hello is not signed by its --server-key (default: env "
                        f"{SERVER_KEY_ENV}; unset = not checked)")
    p.add_argument("--engine-api-key", default=os.environ.get(ENGINE_KEY_ENV),
                   help=f"the engines' --api-key, sent to --engine URLs (default: env "
                        f"{ENGINE_KEY_ENV})")
    p.add_argument("--timeout-ms", type=_positive_int("--timeout-ms"), default=5000,
                   help="longest wait for a reply, milliseconds (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub = p.add_subparsers(dest="command", required=True)

    def prompt_args(sp: argparse.ArgumentParser) -> None:
        g = sp.add_mutually_exclusive_group(required=True)
        g.add_argument("--text", help="the prompt as text (tokenized with --model or --engine)")
        g.add_argument("--token-ids", help="the prompt as token ids: 1,2,3")
        sp.add_argument("--model", help="model path or demo name whose tokenizer to use")
        sp.add_argument("--engine", action="append", type=_engine_url,
                        help="an engine's HTTP URL (repeatable)")
        sp.add_argument("--namespace", type=_namespace,
                        help="the engines' L3 namespace (64 hex)")
        sp.add_argument("--page-size", type=_positive_int("--page-size"),
                        help="the engines' page size (tokens)")
        sp.add_argument("--partition", help="on a server with --tenants-file: the tenant's "
                        "partition (its namespace in the file; by default the tenant's name) "
                        "whose pages to look up, pin or unpin")
        sp.add_argument("--extra-key", help="the requests' extra_key")
        sp.add_argument("--cache-salt", help="the requests' cache_salt")
        sp.add_argument("--engine-api-key", default=argparse.SUPPRESS,
                        help="the engines' --api-key (as before the command)")
        _json_flag(sp)

    prompt_args(sub.add_parser("lookup", help="how much of a prompt the server and engines hold"))
    pin = sub.add_parser("pin", help="keep a prompt's pages from eviction (optionally leased)")
    prompt_args(pin)
    pin.add_argument("--ttl", type=_ttl, help="seconds until the pin ends on its own")
    pin.add_argument("--allow-partial", action="store_true",
                     help="pin the prompt's pages the server holds even when some are not "
                          "(else nothing is pinned and the exit status is 1)")
    prompt_args(sub.add_parser("unpin", help="end a prompt's pins"))
    pins = sub.add_parser("pins", help="list the pins: namespace, key, bytes, lease left")
    _json_flag(pins)
    clear = sub.add_parser("clear", help="delete one namespace's pages, or all (--all)")
    clear.add_argument("--namespace", type=_namespace,
                       help="the namespace to clear (64 hex, from stats)")
    clear.add_argument("--all", action="store_true", help="every page of the server")
    _json_flag(clear)
    st = sub.add_parser("stats", help="pages, bytes, hits, misses, pins per namespace")
    _json_flag(st)
    rt = sub.add_parser("reload-tenants", help="read the server's --tenants-file again (as "
                        "SIGHUP does): added, removed and rotated tokens apply from the next "
                        "request; a file that does not load changes nothing (exit status 1)")
    _json_flag(rt)
    from storage_backends.server.admin_top import add_parser as add_top

    add_top(sub, _json_flag)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    token = a.admin_token if a.admin_token is not None else os.environ.get(ADMIN_ENV, "")
    if not token:
        print(f"hicache-admin: no admin token: pass --admin-token or set {ADMIN_ENV}",
              file=sys.stderr)
        return 1
    run, show = COMMANDS.get(a.command) or (None, None)
    try:
        client = AdminClient(a.url, token, a.timeout_ms, a.server_public_key)
        try:
            if run is None:  # top (storage_backends.server.admin_top)
                from storage_backends.server.admin_top import run_top

                return run_top(client, a)
            out = run(client, a)
            assert show is not None
        finally:
            client.close()
    except AdminError as e:
        print(f"hicache-admin: {e}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(out, indent=2, sort_keys=True) if a.json else show(out))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): no traceback, and no second error at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("hicache-admin: output closed early (broken pipe)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
