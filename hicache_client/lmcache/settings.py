"""The connector's settings: where `hicache-server` is and how to talk to it, read from LMCache's
`extra_config` (no LMCache import here).

LMCache hands a remote connector either the `remote_url` it was configured with
(`hicache://host:port`, the legacy form) or, for a remote storage plugin, a virtual URL
`plugin://<plugin name>` that carries no address. Every setting, the address included, is then
read from `extra_config` under the plugin's prefix::

    remote_storage_plugin.<plugin name>.<setting>     e.g. remote_storage_plugin.hicache.url

A plugin instance `hicache.<instance>` falls back to the plain `hicache` prefix for any setting
it does not set itself, so several instances can share a token or timeouts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from hicache_client.backend_util import as_bool
from hicache_client.errors import ConfigError
from hicache_client.units import parse_bytes

PLUGIN_TYPE = "hicache"
SCHEME = "hicache://"
PLUGIN_SCHEME = "plugin://"
PREFIX = "remote_storage_plugin."

# Settings handed to `HiCacheServerBackend` as they are (see docs/hicache-server.md).
BACKEND_KEYS = ("auth_token", "timeout_ms", "batch_keys", "batch_bytes", "shm", "shm_bytes",
                "shm_populate", "tune_malloc", "encryption_key", "token_proof",
                "server_public_key")
# Settings of the connector itself.
CONNECTOR_KEYS = ("url", "batch_chunks", "list_limit")
# Keys of the plugin prefix that LMCache itself reads.
LMCACHE_KEYS = ("module_path", "class_name")
KNOWN_KEYS = BACKEND_KEYS + CONNECTOR_KEYS + LMCACHE_KEYS

DEFAULT_BATCH_CHUNKS = 64
DEFAULT_LIST_LIMIT = 65536


def plugin_type(plugin_name: str) -> str:
    """`hicache.a` -> `hicache` (LMCache names plugin instances `{type}.{instance}`)."""
    return plugin_name.split(".", 1)[0]


def server_url(url: str) -> str:
    """`hicache://host:port` -> the ZeroMQ address `tcp://host:port` of the server."""
    u = urlparse(url)
    if u.scheme != PLUGIN_TYPE or not u.hostname or not u.port:
        raise ConfigError(f"hicache connector: {url!r} is not hicache://host:port")
    if u.path not in ("", "/") or u.query or u.username or u.password:
        raise ConfigError(
            f"hicache connector: {url!r} has a path, query or credentials; settings go in "
            "extra_config (remote_storage_plugin.hicache.<setting>)"
        )
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return f"tcp://{host}:{u.port}"


@dataclass(frozen=True)
class Settings:
    """Everything the connector needs to start."""

    url: str  # hicache://host:port, as configured
    backend_extra: Mapping[str, Any]  # HiCacheServerBackend's extra config (url included)
    batch_chunks: int  # most chunks in one call to the client (a larger batch goes in parts)
    list_limit: int  # most written keys remembered for list()
    prefixes: tuple[str, ...]  # the extra_config prefixes read, most specific first

    @property
    def auth_token_set(self) -> bool:
        return bool(self.backend_extra.get("auth_token"))


def _prefixes(plugin_name: str | None) -> tuple[str, ...]:
    names = [plugin_name] if plugin_name else []
    names.append(PLUGIN_TYPE)
    return tuple(dict.fromkeys(f"{PREFIX}{n}." for n in names))


def _check_known(extra: Mapping[str, Any], prefixes: tuple[str, ...]) -> None:
    """A misspelt setting under our prefix is an error at start-up, not a silent default."""
    plain = f"{PREFIX}{PLUGIN_TYPE}."
    for key in extra:
        for p in prefixes:
            if not key.startswith(p):
                continue
            rest = key[len(p):]
            # `remote_storage_plugin.hicache.a.url` is instance `a`'s, not a setting `a.url`.
            if p == plain and "." in rest:
                break
            if rest not in KNOWN_KEYS:
                raise ConfigError(
                    f"hicache connector: unknown setting {key!r}; known: {sorted(KNOWN_KEYS)}"
                )
            break


def resolve(extra_config: Mapping[str, Any] | None, url: str | None,
            plugin_name: str | None, remote_url: str | None = None) -> Settings:
    """The settings for a connector LMCache asked for with `url` (`hicache://...`,
    `plugin://hicache[.instance]`, or None when LMCache built the connector class directly).
    Raises `ConfigError` with what to write when something is missing or wrong."""
    extra = dict(extra_config or {})
    if plugin_name is None and url and url.startswith(PLUGIN_SCHEME):
        plugin_name = url[len(PLUGIN_SCHEME):] or PLUGIN_TYPE
    prefixes = _prefixes(plugin_name)
    _check_known(extra, prefixes)

    def get(key: str) -> Any:
        for p in prefixes:
            if extra.get(p + key) is not None:
                return extra[p + key]
        return None

    address = url if url and url.startswith(SCHEME) else get("url")
    # Built without a URL (LMCache's DynamicConnectorAdapter): `remote_url` may name the server.
    # Not for `plugin://hicache`: a `remote_url` has its own backend, and two would double up.
    if not address and url is None and remote_url and remote_url.startswith(SCHEME):
        address = remote_url
    if not address:
        raise ConfigError(
            f"hicache connector: no server address; set extra_config "
            f"'{prefixes[0]}url' = 'hicache://HOST:PORT'"
        )
    backend: dict[str, Any] = {"url": server_url(str(address))}
    for key in BACKEND_KEYS:
        value = get(key)
        if value is not None:
            backend[key] = value
    try:
        for key in ("shm_bytes", "batch_bytes"):
            if key in backend:
                backend[key] = parse_bytes(backend[key], what=key)
        if "shm" in backend:
            backend["shm"] = as_bool(backend["shm"], "shm")
        batch, limit = get("batch_chunks"), get("list_limit")
        batch_chunks = DEFAULT_BATCH_CHUNKS if batch is None else int(batch)
        list_limit = DEFAULT_LIST_LIMIT if limit is None else int(limit)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"hicache connector: bad setting: {e}") from e
    if "auth_token" not in backend and os.environ.get("HICACHE_SERVER_AUTH_TOKEN"):
        backend["auth_token"] = os.environ["HICACHE_SERVER_AUTH_TOKEN"]
    if batch_chunks <= 0 or list_limit < 0:
        raise ConfigError("hicache connector: batch_chunks must be > 0, list_limit >= 0")
    return Settings(str(address), backend, batch_chunks, list_limit, prefixes)
