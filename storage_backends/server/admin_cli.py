"""`hicache-admin`: ask a `hicache-server` (and its engines) what they hold, and tell it what to
keep or drop.

    hicache-admin [--url URL] [--admin-token T] lookup  PROMPT [--engine URL]... [--json]
    hicache-admin ... pin    PROMPT [--ttl SECONDS]
    hicache-admin ... unpin  PROMPT
    hicache-admin ... clear  (--namespace HEX | --all)
    hicache-admin ... stats  [--json]

PROMPT is `--text TEXT` (tokenized with `--model`, a model path or demo name, or else by the
first `--engine`) or `--token-ids 1,2,3`, with `--extra-key` / `--cache-salt` as the requests
name them. A prompt's page keys need the engines' namespace and page size: from the first
`--engine` (its `/hicache/lookup`), or `--namespace` and `--page-size`. The server's admin API
takes the admin token (`--admin-token` or env `HICACHE_SERVER_ADMIN_TOKEN`); without it every
command is refused. Exit status: 0 done, 1 refused or failed (the reason on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq

from hicache.keys import page_keys, request_seed
from storage_backends.server import protocol as P
from storage_backends.server.cli import ADMIN_ENV, DEFAULT_PORT

R = TypeVar("R", bound=P.Reply)
URL_ENV = "HICACHE_SERVER_URL"


class AdminError(Exception):
    """A refused or failed admin operation (the message says why)."""


class AdminClient:
    """One DEALER socket to a server's admin API."""

    def __init__(self, url: str, token: str, timeout_ms: int = 5000) -> None:
        self.url, self.token, self.timeout_ms = url, token, timeout_ms
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(url)
        self._ids = 0

    def call(self, req: P.Request, kind: type[R]) -> R:
        self._ids += 1
        req.request_id, req.token = self._ids, self.token
        self._sock.send_multipart(P.encode(req))
        while True:
            if not self._sock.poll(self.timeout_ms, zmq.POLLIN):
                raise AdminError(f"no reply from {self.url} within {self.timeout_ms} ms")
            reply = P.decode(self._sock.recv_multipart(), expect="reply")
            if reply.request_id == req.request_id:
                break
        if isinstance(reply, P.ErrorReply):
            hint = " (a server before protocol 6 has no admin API)" \
                if reply.code in (P.ErrorCode.BAD_VERSION, P.ErrorCode.UNKNOWN_TYPE) else ""
            raise AdminError(f"{self.url} refused {req.TYPE}: {reply.code}: {reply.message}{hint}")
        if not isinstance(reply, kind):
            raise AdminError(f"{self.url} answered {reply.TYPE} to {req.TYPE}")
        return reply

    def close(self) -> None:
        self._sock.close(linger=0)


def engine_lookup(url: str, body: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    """An engine's `POST /hicache/lookup`."""
    req = urllib.request.Request(url.rstrip("/") + "/hicache/lookup",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out
    except urllib.error.HTTPError as e:
        raise AdminError(f"{url}/hicache/lookup: HTTP {e.code}: {e.read().decode()[:300]}") from e
    except (urllib.error.URLError, OSError) as e:
        raise AdminError(f"{url}/hicache/lookup: {e}") from e


@dataclass
class Prompt:
    """A prompt's tokens and page keys in one namespace."""

    ids: list[int]
    namespace: str
    page_size: int
    extra_key: str | None
    engines: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        seed = request_seed(bytes.fromhex(self.namespace), self.extra_key)
        return [d.hex() for d in page_keys(self.ids, self.page_size, seed)]

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
        out = engine_lookup(url, body)
        ids = ids if ids is not None else list(out["input_ids"])
        engines.append((url, out))
    assert ids is not None
    ns, ps = a.namespace, a.page_size
    if engines:
        first = engines[0][1]
        ns = ns or first.get("namespace")
        ps = ps or first.get("page_size")
    if not ns or not ps:
        raise AdminError("a prompt's page keys need --engine URL, or --namespace and --page-size")
    return Prompt(ids, ns, int(ps), _extra_key(a), engines)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


def cmd_lookup(c: AdminClient, a: argparse.Namespace) -> dict[str, Any]:
    p = resolve_prompt(a)
    r = c.call(P.AdminLookupRequest(keys=p.keys), P.AdminLookupReply)
    return {
        "namespace": p.namespace, "page_size": p.page_size, "prompt_tokens": len(p.ids),
        "server": {"pages": r.count, "tokens": r.count * p.page_size,
                   "in_memory_pages": r.in_memory, "pinned_pages": r.pinned,
                   "reusable_tokens": min(r.count, p.reusable_pages) * p.page_size},
        "engines": [{"url": url, "device_tokens": o["device_tokens"],
                     "host_tokens": o["host_tokens"], "namespace": o.get("namespace")}
                    for url, o in p.engines],
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
                     f"{e['host_tokens']} tokens{other}")
    return "\n".join(lines)


def cmd_pin(c: AdminClient, a: argparse.Namespace) -> dict[str, Any]:
    p = resolve_prompt(a)
    if a.ttl is not None and a.ttl <= 0:
        raise AdminError("--ttl must be > 0 seconds (leave it out for a pin without a lease)")
    r = c.call(P.PinRequest(keys=p.keys, ttl_ms=int((a.ttl or 0) * 1000)), P.PinReply)
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


def cmd_stats(c: AdminClient, a: argparse.Namespace) -> dict[str, Any]:
    r = c.call(P.AdminStatsRequest(), P.AdminStatsReply)
    return {"namespaces": r.namespaces, "totals": r.totals}


def show_stats(out: dict[str, Any]) -> str:
    cols = ["pages", "bytes", "hits", "misses", "pinned_pages", "pinned_bytes"]
    rows = [["namespace", *cols]]
    for ns, r in sorted(out["namespaces"].items()):
        rows.append([ns if ns == "-" else ns[:16], *(str(r.get(k, 0)) for k in cols)])
    t = out["totals"]
    rows.append(["total", *(str(t.get(k, 0)) for k in ("pages", "bytes", "hits", "misses",
                                                       "pinned_pages", "pinned_bytes"))])
    return _table(rows) + (f"\ncapacity {t.get('capacity_bytes', 0)} bytes, pin limit "
                           f"{t.get('pin_limit_bytes', 0)} bytes, read leases "
                           f"{t.get('read_leases', 0)}, evictions {t.get('evictions', 0)}")


COMMANDS = {
    "lookup": (cmd_lookup, show_lookup),
    "pin": (cmd_pin, show_pin),
    "unpin": (cmd_unpin, lambda o: f"unpinned {o['unpinned']} pages"),
    "clear": (cmd_clear, lambda o: f"cleared {o['namespace']}: {o['deleted']} pages deleted, "
                                   f"{o['unpinned']} pins dropped"),
    "stats": (cmd_stats, show_stats),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hicache-admin", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get(URL_ENV, f"tcp://127.0.0.1:{DEFAULT_PORT}"),
                   help=f"the server (default: env {URL_ENV} or %(default)s)")
    p.add_argument("--admin-token", default=None,
                   help=f"the server's --admin-token (default: env {ADMIN_ENV})")
    p.add_argument("--timeout-ms", type=int, default=5000, help="longest wait for a reply")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub = p.add_subparsers(dest="command", required=True)

    def prompt_args(sp: argparse.ArgumentParser) -> None:
        g = sp.add_mutually_exclusive_group(required=True)
        g.add_argument("--text", help="the prompt as text (tokenized with --model or --engine)")
        g.add_argument("--token-ids", help="the prompt as token ids: 1,2,3")
        sp.add_argument("--model", help="model path or demo name whose tokenizer to use")
        sp.add_argument("--engine", action="append", help="an engine's HTTP URL (repeatable)")
        sp.add_argument("--namespace", help="the engines' L3 namespace (64 hex)")
        sp.add_argument("--page-size", type=int, help="the engines' page size")
        sp.add_argument("--extra-key", help="the requests' extra_key")
        sp.add_argument("--cache-salt", help="the requests' cache_salt")
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS)

    prompt_args(sub.add_parser("lookup", help="how much of a prompt the server and engines hold"))
    pin = sub.add_parser("pin", help="keep a prompt's pages from eviction (optionally leased)")
    prompt_args(pin)
    pin.add_argument("--ttl", type=float, help="seconds until the pin ends on its own")
    prompt_args(sub.add_parser("unpin", help="end a prompt's pins"))
    clear = sub.add_parser("clear", help="delete one namespace's pages, or all (--all)")
    clear.add_argument("--namespace", help="the namespace to clear (64 hex, from stats)")
    clear.add_argument("--all", action="store_true", help="every page of the server")
    clear.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    st = sub.add_parser("stats", help="pages, bytes, hits, misses, pins per namespace")
    st.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    token = a.admin_token if a.admin_token is not None else os.environ.get(ADMIN_ENV, "")
    if not token:
        print(f"hicache-admin: no admin token: pass --admin-token or set {ADMIN_ENV}",
              file=sys.stderr)
        return 1
    run, show = COMMANDS[a.command]
    client = AdminClient(a.url, token, a.timeout_ms)
    try:
        out = run(client, a)
    except AdminError as e:
        print(f"hicache-admin: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(out, indent=2, sort_keys=True) if a.json else show(out))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
