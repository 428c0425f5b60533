"""The `hf3fs` backend's configuration look-up and SQLite index schema, and small helpers."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hicache_client.backend import StorageConfig
from hicache_client.errors import ConfigError

CONFIG_ENV = "HICACHE_HF3FS_CONFIG_PATH"
SQL_CHUNK = 500  # keys per `IN (...)` query (SQLite's variable limit is 32766)

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (file TEXT PRIMARY KEY, slot_bytes INTEGER, nslots INTEGER,
                                  hwm INTEGER);
CREATE TABLE IF NOT EXISTS pages (key TEXT PRIMARY KEY, file TEXT, slot INTEGER,
                                  length INTEGER, seq INTEGER, atime INTEGER);
CREATE INDEX IF NOT EXISTS pages_lru ON pages (file, atime);
CREATE TABLE IF NOT EXISTS free (file TEXT, slot INTEGER, PRIMARY KEY (file, slot));
CREATE TABLE IF NOT EXISTS pending (file TEXT, slot INTEGER, host TEXT, pid INTEGER,
                                    PRIMARY KEY (file, slot));
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER);
"""


def load_config(config: StorageConfig) -> dict[str, Any]:
    """Extra config if it names a mount, else the JSON file at `HICACHE_HF3FS_CONFIG_PATH`."""
    extra = dict(config.extra)
    if "mount_path" not in extra and os.environ.get(CONFIG_ENV):
        path = os.environ[CONFIG_ENV]
        try:
            extra = {**json.loads(Path(path).read_text()), **extra}
        except (OSError, ValueError) as e:
            raise ConfigError(f"hf3fs: cannot read {CONFIG_ENV}={path}: {e}") from e
    if not extra.get("mount_path"):
        raise ConfigError(f"hf3fs: set extra config 'mount_path' or {CONFIG_ENV}")
    return extra


def chunks(items: Sequence[str], n: int = SQL_CHUNK) -> list[Sequence[str]]:
    return [items[i : i + n] for i in range(0, len(items), n)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
