"""`file`: page records as files in a directory on local disk or a shared mount.

Layout: ``<root>/<k[0:2]>/<k[2:4]>/<k>`` for a lower-case hex key ``k`` (other keys are stored
under ``x`` + the SHA-256 of the key), so no directory holds more than a few thousand files even
with millions of pages. A write goes to a temp file in the page's shard directory
(``.<name>.<host>.<pid>.<n>.tmp``), is optionally fsync'ed, and is renamed into place with
``os.replace``: a reader sees the old record, the new record or nothing, never half of one.

Every object keeps an in-memory index (file name -> record bytes, in LRU order) built by a
start-up scan (oldest mtime first), used for the byte cap and its LRU eviction. Several objects,
in one process or many, can share one directory: presence is always decided by the file system
(one ``stat`` per key in `batch_exists`, the ``open`` itself in reads), never by a directory
listing, so a page written by another process is found and a page removed by another process is
a miss, not an error.

Extra config (JSON) and environment:

====================  ==================================================  =================
key                   meaning                                             default
====================  ==================================================  =================
``path``              the directory (env ``HICACHE_FILE_BACKEND_DIR``)    see `default_dir`
``capacity_bytes``    byte cap over the pages this object knows; 0: none  0
``fsync``             ``none`` | ``data`` (fdatasync the file) |           ``none``
                      ``always`` (fsync the file and its directory)
``o_direct``          use O_DIRECT where the buffer's address is 4 KiB    false
                      aligned (buffered I/O otherwise)
``read_threads``      threads that read (and check) one batch             CPUs, at most 4
``fan_out``           ``auto``: more than one thread only while the       ``auto``
                      reader gets a CPU at once; ``always``
``scan_on_start``     build the index from the directory at start-up      true
``stale_tmp_s``       age after which any temp file is removed at          3600
                      start-up (a temp file of a dead local pid goes now)
====================  ==================================================  =================
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import logging
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

from hicache_client.backend import Checked, StorageBackend, StorageConfig, byte_view
from hicache_client.backend_util import check_known_keys, setting
from hicache_client.errors import ConfigError
from hicache_client.units import parse_bytes
from storage_backends.file_io import (
    DIRECT_ALIGN,
    O_DIRECT,
    ReadFanOut,
    address,
    default_read_threads,
    publish,
    read_file,
)

logger = logging.getLogger(__name__)

KNOWN_KEYS = (
    "path", "capacity_bytes", "fsync", "o_direct", "read_threads", "fan_out", "scan_on_start",
    "stale_tmp_s",
)
FAN_OUT_POLICIES = ("auto", "always")
FSYNC_POLICIES = ("none", "data", "always")
_HEX_KEY = re.compile(r"[0-9a-f]{8,128}")
_PAGE_NAME = re.compile(r"(?:[0-9a-f]{8,128}|x[0-9a-f]{64})")
_TMP_SUFFIX = ".tmp"
_MISSING = Checked(-1, None)


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/hicache/pages``, else ``~/.cache/hicache/pages``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache" / "pages"


def page_name(key: str) -> str:
    """The file name of `key`'s record: the key itself when it is lower-case hex (8..128
    chars, e.g. the 64-hex page keys of hicache_client.keys), else ``x`` + SHA-256 hex of the key."""
    if _HEX_KEY.fullmatch(key):
        return key
    return "x" + hashlib.sha256(key.encode()).hexdigest()


class FileBackend(StorageBackend):
    """Records as files: sharded directories, atomic writes, byte cap with LRU eviction."""

    name: ClassVar[str] = "file"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        check_known_keys(config, KNOWN_KEYS, self.name)
        path = setting(config, "path", "", env="HICACHE_FILE_BACKEND_DIR", cast=str)
        self.root = Path(os.path.expanduser(path)) if path else default_dir()
        self._root_s = str(self.root).rstrip("/") or "/"
        self.capacity_bytes = parse_bytes(
            config.get("capacity_bytes") or 0, what="file backend: capacity_bytes"
        )
        self.fsync = setting(config, "fsync", "none", cast=str)
        self.o_direct = setting(config, "o_direct", False) and bool(O_DIRECT)
        self.stale_tmp_s = setting(config, "stale_tmp_s", 3600.0)
        self.read_threads = setting(config, "read_threads", default_read_threads())
        if self.read_threads < 1:
            raise ConfigError("file backend: read_threads must be >= 1")
        fan_out = setting(config, "fan_out", "auto", cast=str)
        if fan_out not in FAN_OUT_POLICIES:
            raise ConfigError(f"file backend: fan_out must be one of {FAN_OUT_POLICIES}")
        if self.fsync not in FSYNC_POLICIES:
            raise ConfigError(f"file backend: fsync must be one of {FSYNC_POLICIES}")
        if self.capacity_bytes < 0:
            raise ConfigError("file backend: capacity_bytes must be >= 0")
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"file backend: {self.root} exists and is not a directory")

        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # page name -> bytes, LRU first
        self._bytes = 0
        self._dirs: set[str] = set()  # shard directories known to exist
        self._tmp_seq = itertools.count()
        self._host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32] or "host"
        self._warned_io = False
        self._closed = False
        self._fan_out = ReadFanOut(self.read_threads, auto=fan_out == "auto")
        self.direct_reads = 0  # reads done with O_DIRECT (for tests and tuning)
        self.direct_writes = 0
        # Page names the byte cap never evicts (hicache-server's pinned pages); a write that
        # could only fit by evicting one of them is refused instead.
        self.keep: Callable[[str], bool] | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            # Not fatal: the engine runs without L3 until the directory becomes usable.
            logger.warning("file backend: cannot create %s (%s); writes will fail", self.root, e)
        if setting(config, "scan_on_start", True):
            self._scan()
        logger.info(
            "file backend at %s: %d pages, %d bytes known (cap %s, fsync %s, o_direct %s)",
            self.root, len(self._index), self._bytes, self.capacity_bytes or "none",
            self.fsync, self.o_direct,
        )

    # -- paths ----------------------------------------------------------------------------

    def _shard(self, name: str) -> str:
        s = name[1:] if name[0] == "x" else name
        return f"{self._root_s}/{s[0:2]}/{s[2:4]}"

    def _file(self, name: str) -> str:
        s = name[1:] if name[0] == "x" else name
        return f"{self._root_s}/{s[0:2]}/{s[2:4]}/{name}"

    def path_of(self, key: str) -> Path:
        """Where `key`'s record lives (for tools and tests)."""
        name = page_name(key)
        return Path(self._shard(name)) / name

    # -- start-up scan --------------------------------------------------------------------

    def _scan(self) -> None:
        found: list[tuple[float, str, int]] = []
        removed_tmp = 0
        now = time.time()
        try:
            level1 = [e for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except OSError as e:
            logger.warning("file backend: cannot scan %s: %s", self.root, e)
            return
        for d1 in level1:
            try:
                level2 = [e for e in os.scandir(d1.path) if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for d2 in level2:
                self._dirs.add(d2.path)
                try:
                    entries = list(os.scandir(d2.path))
                except OSError:
                    continue
                for ent in entries:
                    try:
                        if ent.name.endswith(_TMP_SUFFIX):
                            if self._stale_tmp(ent.name, ent.stat().st_mtime, now):
                                os.unlink(ent.path)
                                removed_tmp += 1
                            continue
                        if not _PAGE_NAME.fullmatch(ent.name) or not ent.is_file():
                            continue
                        st = ent.stat()
                    except OSError:
                        continue  # vanished meanwhile (another process)
                    found.append((st.st_mtime, ent.name, st.st_size))
        found.sort()
        with self._lock:
            for _, name, size in found:
                self._index[name] = size
                self._bytes += size
        if removed_tmp:
            logger.info("file backend: removed %d stale temp files", removed_tmp)
        self._gauges()

    def _stale_tmp(self, name: str, mtime: float, now: float) -> bool:
        """A temp file is stale if its writer (a pid on this host) is dead, or it is old."""
        if now - mtime > self.stale_tmp_s:
            return True
        parts = name[: -len(_TMP_SUFFIX)].split(".")
        # "", page name, host, pid, seq
        if len(parts) != 5 or parts[2] != self._host:
            return False
        try:
            pid = int(parts[3])
        except ValueError:
            return False
        if pid <= 0:
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    # -- index ----------------------------------------------------------------------------

    def _index_put(self, name: str, size: int) -> None:
        # Caller holds self._lock.
        old = self._index.pop(name, None)
        if old is not None:
            self._bytes -= old
        self._index[name] = size
        self._bytes += size

    def _index_drop(self, name: str) -> bool:
        # Caller holds self._lock.
        old = self._index.pop(name, None)
        if old is None:
            return False
        self._bytes -= old
        return True

    def _gauges(self) -> None:
        with self._lock:
            pages, nbytes = len(self._index), self._bytes
        self._set_gauge(stored_pages=pages, stored_bytes=nbytes)

    def _make_room(self, name: str, size: int) -> list[str] | None:
        """Pick LRU victims so that `size` more bytes fit (None: they cannot without evicting
        a page `keep` names); caller holds the lock."""
        victims: list[str] = []
        if not self.capacity_bytes:
            return victims
        budget = self._bytes - self._index.get(name, 0) + size
        keep = self.keep
        for victim in self._index:
            if budget <= self.capacity_bytes:
                break
            if victim == name or (keep is not None and keep(victim)):
                continue
            victims.append(victim)
            budget -= self._index[victim]
        if budget > self.capacity_bytes:
            return None
        for v in victims:
            self._index_drop(v)
        return victims

    def known_pages(self) -> list[tuple[str, int]]:
        """(file path, bytes) of every page this object knows, least recently used first."""
        with self._lock:
            return [(self._file(name), n) for name, n in self._index.items()]

    # -- the contract ---------------------------------------------------------------------

    def batch_exists(self, keys: Sequence[str]) -> int:
        self._count(exists_calls=1)
        n = len(keys)
        changed = False
        for i, key in enumerate(keys):
            name = page_name(key)
            path = self._file(name)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                with self._lock:
                    changed |= self._index_drop(name)
                n = i
                break
            except OSError as e:
                self._io_error("stat", key, e)
                n = i
                break
            if self._index.get(name) != size:  # a dict read is atomic: no lock when in sync
                with self._lock:
                    self._index_put(name, size)  # written by another object / process
                changed = True
        if changed:
            self._gauges()
        return n

    def _get_into(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[int]:
        return [r.length for r in self._read_batch(keys, out, check=False)]

    def _get_checked(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[Checked]:
        # Each record is checked by the thread that read it, right after its read: the
        # checksum (GIL released) of one page overlaps the reads of the others.
        return self._read_batch(keys, out, check=True)

    def _read_batch(
        self, keys: Sequence[str], out: Sequence[memoryview], *, check: bool
    ) -> list[Checked]:
        """Read `keys` into `out`, in up to `read_threads` threads while cores are free
        (`ReadFanOut`); each record is checked by the thread that read it, right after."""
        res: list[Checked] = [_MISSING] * len(keys)

        def work(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                res[i] = self._read_one(keys[i], byte_view(out[i]), check)

        self._fan_out.run(work, out)
        return res

    @property
    def fanned_out_batches(self) -> int:
        """Batches read by more than one thread (for tests and tuning)."""
        return self._fan_out.fanned_out

    def _read_one(self, key: str, dst: memoryview, check: bool) -> Checked:
        name = page_name(key)
        try:
            n = self._read(self._file(name), dst)
        except FileNotFoundError:
            with self._lock:
                changed = self._index_drop(name)
            if changed:
                self._gauges()
            return _MISSING
        except OSError as e:
            self._io_error("read", key, e)
            return _MISSING
        # Checked first, while the record is still in cache.
        problem = self.check_record(key, n, dst) if check else None
        if self.capacity_bytes or self._index.get(name) != n:  # no cap: no LRU order to keep
            with self._lock:
                if self._index.get(name) == n:
                    self._index.move_to_end(name)  # LRU: most recently used last
                    changed = False
                else:
                    self._index_put(name, n)  # written by another object / process
                    changed = True
            if changed:
                self._gauges()
        return Checked(n, problem)

    def _read(self, path: str, dst: memoryview) -> int:
        """Read the file into `dst` when its size is len(dst); return the file's size (or the
        bytes actually read, if it shrank under us). With `o_direct` and a 4 KiB-aligned `dst`
        the file is read with O_DIRECT (DMA straight into `dst`, the page cache bypassed)."""
        direct = self.o_direct and len(dst) > 0 and address(dst) % DIRECT_ALIGN == 0
        size, refused = read_file(path, dst, direct)
        if refused is not None:
            self._disable_direct(refused)
        elif direct and size == len(dst):
            with self._lock:
                self.direct_reads += 1
        return size

    def _set_from(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        ok: list[bool] = []
        evicted = 0
        for key, value in zip(keys, values):
            src = byte_view(value)
            size = len(src)
            name = page_name(key)
            if self.capacity_bytes and size > self.capacity_bytes:
                logger.debug("file backend: page %s (%d B) exceeds the cap", key[:16], size)
                ok.append(False)
                continue
            with self._lock:
                victims = self._make_room(name, size)
            if victims is None:
                logger.debug("file backend: no room for page %s but kept pages", key[:16])
                ok.append(False)
                continue
            evicted += self._unlink_all(victims)
            shard = self._shard(name)
            try:
                self._write(shard, name, src)
            except OSError as e:
                self._io_error("write", key, e)
                ok.append(False)
                continue
            with self._lock:
                self._index_put(name, size)
            ok.append(True)
        self._count(evicted_pages=evicted)
        self._gauges()
        return ok

    def _write(self, shard: str, name: str, src: memoryview) -> None:
        """Atomically store `src` as `shard/name` (temp file + os.replace). Raises OSError
        after removing its temp file."""
        if shard not in self._dirs:
            os.makedirs(shard, exist_ok=True)
            self._dirs.add(shard)
        tmp = os.path.join(
            shard, f".{name}.{self._host}.{os.getpid()}.{next(self._tmp_seq)}{_TMP_SUFFIX}"
        )
        direct = self.o_direct and len(src) > 0 and address(src) % DIRECT_ALIGN == 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(tmp, flags | (O_DIRECT if direct else 0), 0o644)
        except FileNotFoundError:
            # The shard directory was removed under us: make it again, once.
            self._dirs.discard(shard)
            os.makedirs(shard, exist_ok=True)
            self._dirs.add(shard)
            fd = os.open(tmp, flags | (O_DIRECT if direct else 0), 0o644)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            self._disable_direct(e)
            fd = os.open(tmp, flags, 0o644)
        refused = publish(fd, tmp, os.path.join(shard, name), src, self.fsync, direct)
        if refused is not None:
            self._disable_direct(refused)
        elif direct:
            with self._lock:
                self.direct_writes += 1

    def _unlink_all(self, names: Sequence[str]) -> int:
        n = 0
        for name in names:
            try:
                os.unlink(self._file(name))
                n += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                self._io_error("unlink", name, e)
        return n

    def delete(self, keys: Sequence[str]) -> None:
        names = [page_name(k) for k in keys]
        with self._lock:
            for name in names:
                self._index_drop(name)
        self._count(deleted_pages=self._unlink_all(names))
        self._gauges()

    def clear(self) -> None:
        """Remove every page file under the directory (the whole shared store). Shard
        directories and other writers' in-flight temp files are left alone."""
        with self._lock:
            self._index.clear()
            self._bytes = 0
        try:
            level1 = [e.path for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            level1 = []
        for d1 in level1:
            try:
                level2 = [e.path for e in os.scandir(d1) if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for d2 in level2:
                try:
                    entries = list(os.scandir(d2))
                except OSError:
                    continue
                for e in entries:
                    if _PAGE_NAME.fullmatch(e.name):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(e.path)
        self._gauges()

    def close(self) -> None:
        self._closed = True
        self._fan_out.close()

    # -- helpers --------------------------------------------------------------------------

    def _io_error(self, op: str, key: str, e: OSError) -> None:
        self._count(errors=1)
        if not self._warned_io:
            self._warned_io = True
            logger.warning("file backend: %s of %s failed: %s", op, key[:16], e)
        else:
            logger.debug("file backend: %s of %s failed: %s", op, key[:16], e)

    def _disable_direct(self, e: OSError) -> None:
        if self.o_direct:
            self.o_direct = False
            logger.warning("file backend: O_DIRECT not supported on %s (%s); buffered I/O",
                           self.root, e)
