"""Tenants of one `hicache-server`: the tenants file, the token -> tenant table, and the keys the
server stores a tenant's pages under.

The tenants file (``--tenants-file``, TOML or JSON by its suffix) names each tenant, the
partition (namespace) its pages live in and its tokens with their rights::

    [tenants.team-a]
    namespace = "team-a"                  # optional; default: the tenant's name
    rights = ["read", "write", "clear"]   # optional; default: all three
    tokens = ["a-2026-11", "a-2026-12"]   # two during a rotation
    max_bytes = "8GiB"                    # optional: the partition's share of memory

    [tenants.team-a-readers]              # a second tenant on the same partition, read only
    namespace = "team-a"
    rights = ["read"]
    tokens = ["a-ro-1"]

A token may also be a table ``{ token = "...", rights = ["read"] }`` (its own rights). The
server derives everything from the token a request carries: a client never names a partition.
Each page key a tenant sends is stored as `Tenant.tag` (16 hex characters) followed by the key
(hex keys of up to 112 characters) or the SHA-256 hex of the key (any other key), so two
partitions can never name the same stored page, and the persistence directory's file names (the
stored keys: ``file`` backend, hex names) say which partition a file belongs to.

`max_bytes` caps the bytes a partition holds in the server's memory tier: a page that would take
it past that evicts the partition's own least recently used pages first, never another
partition's (`PageStore`); tenants sharing a partition must not name different caps. Without it
a partition shares the whole capacity, least recently used first across partitions.

Secrets are never logged: tenants are named by their names, tokens by nothing. The file is
read again on SIGHUP and by the admin call `reload_tenants` (`Tenants.reload`): a file that
does not load leaves the table as it was.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hicache_client.errors import ConfigError
from hicache_client.remote.protocol import token_id
from hicache_client.units import parse_bytes

logger = logging.getLogger(__name__)

RIGHTS = ("read", "write", "clear")
_HEX = re.compile(r"[0-9a-f]+")
_MAX_PLAIN_KEY = 112  # tag (16) + key stays a hex name the file backend keeps (<= 128)
TAG_CHARS = 16


class TenantsError(ValueError):
    """A tenants file that cannot be used (the message says where and why; never a token)."""


@dataclass(frozen=True)
class Tenant:
    """What one token may do, and where: `namespace` is the partition its pages live in."""

    name: str
    namespace: str
    rights: frozenset[str]
    max_bytes: int = 0  # the partition's cap in the memory tier (0: none)

    @property
    def tag(self) -> str:
        return partition_tag(self.namespace)

    def key(self, key: str) -> str:
        """The stored key of this tenant's page `key`."""
        if len(key) <= _MAX_PLAIN_KEY and _HEX.fullmatch(key):
            return self.tag + key
        return self.tag + hashlib.sha256(key.encode()).hexdigest()

    def keys(self, keys: Iterable[str]) -> list[str]:
        tag = self.tag
        return [tag + k if len(k) <= _MAX_PLAIN_KEY and _HEX.fullmatch(k)
                else tag + hashlib.sha256(k.encode()).hexdigest() for k in keys]

    def owns(self, stored_key: str) -> bool:
        return stored_key.startswith(self.tag)


def partition_tag(namespace: str) -> str:
    """The 16 hex characters every stored key of partition `namespace` starts with."""
    digest = hashlib.sha256(b"hicache-tenant-partition\0" + namespace.encode()).hexdigest()
    return digest[:TAG_CHARS]


def _token_id(token: str) -> bytes:
    # The table is keyed by a digest of the token, so a lookup's timing says nothing about
    # how much of a wrong token matched.
    return hashlib.sha256(token.encode()).digest()


def _load_raw(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except OSError as e:
        raise TenantsError(f"tenants file {path}: {e.strerror or e}") from None
    kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
    try:
        if kind == "JSON":
            data = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            import tomllib

            data = tomllib.loads(text.decode())
        _check_strings(data, 0)
    except _DuplicateKey as e:
        raise TenantsError(f"tenants file {path}: key {e.args[0]!r} is named twice in one "
                           "table") from None
    except RecursionError:
        raise TenantsError(f"tenants file {path}: nested too deeply") from None
    except TenantsError as e:
        raise TenantsError(f"tenants file {path}: {e}") from None
    except UnicodeEncodeError:
        raise TenantsError(f"tenants file {path}: a string is not UTF-8 (a lone surrogate)") \
            from None
    except (ValueError, UnicodeError) as e:
        # NOTE: the parser's message may quote the line, which may hold a token: only its
        # position is reported.
        where = getattr(e, "lineno", None)
        raise TenantsError(f"tenants file {path}: not valid {'JSON' if path.suffix.lower() == '.json' else 'TOML'}"
                           + (f" (line {where})" if where else "")) from None
    if not isinstance(data, dict):
        raise TenantsError(f"tenants file {path}: the top level must be a table")
    return data


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it names a key twice (TOML refuses that itself; JSON's
    decoder would keep the last silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k[:64].encode("utf-8", "replace").decode())
        out[k] = v
    return out


_MAX_DEPTH = 8  # [tenants.<name>] tokens = [{token, rights = [...]}]: 5 levels at most


def _check_strings(value: Any, depth: int) -> None:
    """Refuse what no tenants file holds and later code would trip on: nesting past
    `_MAX_DEPTH`, strings that are not UTF-8 (a lone surrogate, "\\ud800" in JSON)."""
    if depth > _MAX_DEPTH:
        raise TenantsError("nested too deeply")
    if isinstance(value, str):
        value.encode()  # UnicodeEncodeError for a lone surrogate
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, depth + 1)
            _check_strings(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_strings(v, depth + 1)


def _rights(value: Any, where: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(r, str) for r in value):
        raise TenantsError(f"{where}: rights must be a list of {', '.join(RIGHTS)}")
    bad = sorted(set(value) - set(RIGHTS))
    if bad:
        raise TenantsError(f"{where}: unknown right(s) {bad}; known: {', '.join(RIGHTS)}")
    return frozenset(value)


def parse_tenants(data: dict[str, Any], source: str = "tenants file") -> dict[bytes, Tenant]:
    """The token table of a parsed tenants file: digest of each token -> its `Tenant`."""
    unknown = sorted(set(data) - {"tenants"})
    if unknown:
        raise TenantsError(f"{source}: unknown top-level key(s) {unknown}; expected [tenants.*]")
    tenants = data.get("tenants")
    if not isinstance(tenants, dict) or not tenants:
        raise TenantsError(f"{source}: no tenants (expected [tenants.<name>] tables)")
    table: dict[bytes, Tenant] = {}
    tags: dict[str, str] = {}
    caps: dict[str, int] = {}  # partition -> max_bytes
    for name, spec in tenants.items():
        where = f"{source}: tenant {name!r}"
        if not isinstance(spec, dict):
            raise TenantsError(f"{where}: must be a table")
        extra = sorted(set(spec) - {"namespace", "rights", "tokens", "max_bytes"})
        if extra:
            raise TenantsError(f"{where}: unknown key(s) {extra}; known: namespace, rights, "
                               "tokens, max_bytes")
        namespace = spec.get("namespace", name)
        if not isinstance(namespace, str) or not namespace:
            raise TenantsError(f"{where}: namespace must be a non-empty string")
        tag = partition_tag(namespace)
        if tags.setdefault(tag, namespace) != namespace:  # pragma: no cover - 2^-64
            raise TenantsError(f"{where}: namespace collides with {tags[tag]!r}")
        max_bytes = _max_bytes(spec.get("max_bytes", 0), where)
        if max_bytes and caps.setdefault(namespace, max_bytes) != max_bytes:
            raise TenantsError(f"{where}: max_bytes {max_bytes} differs from the "
                               f"{caps[namespace]} another tenant of partition {namespace!r} "
                               "names (one cap per partition)")
        rights = _rights(spec.get("rights", list(RIGHTS)), where)
        tokens = spec.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise TenantsError(f"{where}: tokens must be a non-empty list")
        for i, entry in enumerate(tokens):
            token_rights = rights
            if isinstance(entry, dict):
                extra = sorted(set(entry) - {"token", "rights"})
                if extra:
                    raise TenantsError(f"{where}: token #{i + 1}: unknown key(s) {extra}")
                if "rights" in entry:
                    token_rights = _rights(entry["rights"], f"{where}: token #{i + 1}")
                entry = entry.get("token")
            if not isinstance(entry, str) or len(entry) < 16:
                raise TenantsError(f"{where}: token #{i + 1} must be a string of at least 16 "
                                   "characters")
            tid = _token_id(entry)
            if tid in table:
                raise TenantsError(f"{where}: token #{i + 1} is also a token of tenant "
                                   f"{table[tid].name!r}")
            table[tid] = Tenant(name=str(name), namespace=namespace, rights=token_rights)
    # A cap named by one tenant of a partition holds for every tenant of it.
    return {tid: replace(t, max_bytes=caps.get(t.namespace, 0)) for tid, t in table.items()}


def _max_bytes(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TenantsError(f"{where}: max_bytes must be a byte count (8589934592, \"8GiB\")")
    try:
        return parse_bytes(value, what="max_bytes")
    except ConfigError as e:
        raise TenantsError(f"{where}: {e}") from None


def _tokens(data: dict[str, Any]) -> list[str]:
    """Every token of a tenants file that `parse_tenants` accepted."""
    out: list[str] = []
    for spec in data["tenants"].values():
        for entry in spec["tokens"]:
            out.append(entry["token"] if isinstance(entry, dict) else entry)
    return out


class Tenants:
    """The live token table of a server, loaded from `path` (reloadable)."""

    def __init__(self, path: str | os.PathLike[str], admin_token: str | None = None) -> None:
        self.path = Path(path)
        self._admin_id = _token_id(admin_token) if admin_token else None
        self._lock = threading.Lock()
        self.table: dict[bytes, Tenant] = {}
        self._secrets: dict[str, str] = {}  # P.token_id(token) -> token, for token proofs
        self.reloads = 0
        self.reload_failures = 0
        self.table, self._secrets = self._read()

    def _read(self) -> tuple[dict[bytes, Tenant], dict[str, str]]:
        try:
            mode = self.path.stat().st_mode
        except OSError as e:
            raise TenantsError(f"tenants file {self.path}: {e.strerror or e}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("tenants file %s is readable by other users (mode %o): it holds "
                           "tokens; chmod 600 it", self.path, stat.S_IMODE(mode))
        raw = _load_raw(self.path)
        table = parse_tenants(raw, f"tenants file {self.path}")
        if self._admin_id is not None and self._admin_id in table:
            raise TenantsError(f"tenants file {self.path}: a tenant token equals the admin token")
        return table, {token_id(t): t for t in _tokens(raw)}

    def reload(self) -> tuple[bool, str]:
        """Read the file again; the new table takes effect from the next request. On any
        error the table stays as it was. (ok, a one-line summary or the error)."""
        try:
            table, secrets = self._read()
        except Exception as e:  # noqa: BLE001 - any bad file keeps the previous table
            self.reload_failures += 1
            logger.error("tenants file not reloaded, the previous tenants stay: %s", e)
            return False, str(e)
        with self._lock:
            old, self.table, self._secrets = self.table, table, secrets
        self.reloads += 1
        added = len(set(table) - set(old))
        removed = len(set(old) - set(table))
        summary = (f"{len(self.names())} tenants, {len(table)} tokens ({added} added, "
                   f"{removed} removed)")
        logger.info("tenants file %s reloaded: %s", self.path, summary)
        return True, summary

    def secret(self, tid: str) -> str | None:
        """The token whose `token_id` is `tid` (a token proof's key), or None."""
        return self._secrets.get(tid)

    def names(self) -> list[str]:
        return sorted({t.name for t in self.table.values()})

    def lookup(self, token: str) -> Tenant | None:
        """The tenant of `token`, or None."""
        return self.table.get(_token_id(token)) if token else None

    def partitions(self) -> dict[str, tuple[str, int]]:
        """Partition tag -> (partition name, max_bytes: 0 for none), of the current table."""
        return {t.tag: (t.namespace, t.max_bytes) for t in self.table.values()}

    def describe(self) -> str:
        """For the start-up log: names and partitions, no tokens."""
        parts = sorted({f"{t.name} ({t.namespace}: {','.join(sorted(t.rights))})"
                        for t in self.table.values()})
        return ", ".join(parts)
