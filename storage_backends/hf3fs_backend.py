"""`hf3fs`: pages on a 3FS mount (or any POSIX file system standing in for one).

Layout under `{mount_path}/{prefix}/`:

- `rank{R}-{S}.data`: one preallocated file per tensor-parallel rank `R` and slot size `S`
  (bytes), cut into `file_size // S` fixed slots; one page record per slot.
- `index.sqlite`: the persistent key -> (file, slot, length) index shared by every process on
  the mount, with the free-slot list, a `pending` table of slots being written, and an access
  time per page for LRU eviction.

Crash safety: a slot is taken from the free list (or by evicting the least recently used page
of that file) and recorded as *pending* in one transaction; the record is then written with
`os.pwrite`; only after the write completes is the key published in `pages` in a second
transaction. A process that dies mid-write leaves a pending row, which the next process to open
the index on the same host reclaims (its pid is gone). A reader never sees a half-written slot
under a key, and re-checks the slot's write sequence number after reading, so a page evicted and
overwritten by another process while it was being read is a plain miss, never a corrupt one.

Sharing: every process opens the same `index.sqlite`; SQLite's own file locks serialise the
writers (`BEGIN IMMEDIATE`), so two engines on one mount see each other's pages. This needs a
file system with working POSIX locks (local disks, 3FS FUSE on one host). Reads and writes go
through POSIX `pread`/`pwrite` into/out of the caller's buffers (no intermediate copy), in
`numjobs` parallel threads; the 3FS usrbio path is used when `hf3fs_fuse` is importable (see
`Usrbio`; it is not testable without a 3FS cluster).
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

from hicache_client.backend import BackendStats, Checked, StorageBackend, StorageConfig, byte_view
from hicache_client.backend_util import as_bool, check_known_keys, leading_run
from hicache_client.errors import ConfigError, StorageError
from storage_backends.hf3fs_meta import SCHEMA, chunks, load_config, pid_alive
from storage_backends.hf3fs_usrbio import Usrbio

logger = logging.getLogger(__name__)

KNOWN_KEYS = (
    "mount_path",
    "file_size",
    "numjobs",
    "slot_bytes",
    "prefix",
    "use_usrbio",
    "fsync",
    "entries",  # accepted for SGLang config compatibility (usrbio ring size)
)
DEFAULT_FILE_SIZE = 1 << 30
DEFAULT_SLOT_BYTES = (1 << 20) + 4096
class HF3FSBackend(StorageBackend):
    """Fixed-slot page files on a 3FS mount with a shared SQLite index.

    Extra config (or the JSON file at `HICACHE_HF3FS_CONFIG_PATH`):
    `mount_path` (required), `file_size` (bytes per rank file, default 1 GiB), `numjobs`
    (parallel I/O threads, default 4), `slot_bytes` (default `config.record_bytes`, else
    1 MiB + 4 KiB), `prefix` (sub-directory, default "hicache"), `use_usrbio` ("auto"), `fsync`
    (fdatasync each written record before publishing it, default false), `entries` (usrbio ring
    size, default 64).
    """

    name: ClassVar[str] = "hf3fs"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        cfg = load_config(config)
        check_known_keys(StorageConfig(extra=cfg), KNOWN_KEYS, self.name)
        try:
            self.file_size = int(cfg.get("file_size", DEFAULT_FILE_SIZE))
            self.numjobs = int(cfg.get("numjobs", 4))
            default_slot = config.record_bytes or DEFAULT_SLOT_BYTES
            self.slot_bytes = int(cfg.get("slot_bytes", default_slot))
            entries = int(cfg.get("entries", 64))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"hf3fs: bad numeric setting: {e}") from e
        self.fsync = as_bool(cfg.get("fsync", False), "fsync")
        if self.slot_bytes <= 0 or self.file_size < self.slot_bytes or self.numjobs < 1:
            raise ConfigError(
                f"hf3fs: need 0 < slot_bytes <= file_size and numjobs >= 1 (slot_bytes="
                f"{self.slot_bytes}, file_size={self.file_size}, numjobs={self.numjobs})"
            )
        self.mount = str(cfg["mount_path"])
        self.root = Path(self.mount) / str(cfg.get("prefix", "hicache"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.nslots = self.file_size // self.slot_bytes
        self.file = f"rank{config.tp_rank}-{self.slot_bytes}.data"
        self._db_path = str(self.root / "index.sqlite")
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        self._closed = False
        self._host = socket.gethostname()
        self._pool = ThreadPoolExecutor(self.numjobs, thread_name_prefix="hf3fs-io")
        self._prepare_file()
        self._usrbio: Usrbio | None = None
        use_usrbio = str(cfg.get("use_usrbio", "auto")).lower()
        if use_usrbio not in ("false", "0", "no", "off"):
            try:
                self._usrbio = Usrbio(self.mount, self.slot_bytes, entries)
                logger.info("hf3fs: usrbio I/O enabled on %s", self.mount)
            except Exception as e:  # noqa: BLE001 - ImportError off 3FS, anything on a bad mount
                if use_usrbio in ("true", "1", "yes", "on"):
                    raise ConfigError(f"hf3fs: use_usrbio requested but unavailable: {e}") from e
                logger.info("hf3fs: usrbio unavailable (%s); using POSIX pread/pwrite", e)
        logger.info(
            "hf3fs: %s, %d slots of %d bytes in %s", self.root, self.nslots, self.slot_bytes,
            self.file,
        )

    # -- index and files -------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise StorageError("hf3fs: backend is closed")
            try:
                conn = sqlite3.connect(
                    self._db_path, timeout=60.0, isolation_level=None, check_same_thread=False
                )
                # NORMAL: a committed index survives a process crash; FULL (with `fsync`)
                # survives power loss too, at an fsync per transaction.
                conn.execute(f"PRAGMA synchronous={'FULL' if self.fsync else 'NORMAL'}")
            except sqlite3.Error as e:
                raise StorageError(f"hf3fs: cannot open index {self._db_path}: {e}") from e
            self._local.conn = conn
            with self._fd_lock:
                self._conns.append(conn)
        return conn

    def _write_txn(self, fn: Any, durable: bool = True) -> Any:
        """Run `fn(conn)` inside `BEGIN IMMEDIATE` (the index's cross-process write lock).
        `durable=False` skips the sync at commit (for LRU access times, which may be lost)."""
        conn = self._db()
        try:
            if not durable:
                conn.execute("PRAGMA synchronous=OFF")
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            if not durable:
                conn.execute(f"PRAGMA synchronous={'FULL' if self.fsync else 'NORMAL'}")
        except sqlite3.Error as e:
            self._count(errors=1)
            raise StorageError(f"hf3fs: index update failed: {e}") from e
        return result

    def _prepare_file(self) -> None:
        conn = self._db()
        conn.executescript(SCHEMA)
        path = self.root / self.file
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < self.file_size:
                try:
                    os.posix_fallocate(fd, 0, self.file_size)
                except OSError:  # file systems without fallocate: a sparse file
                    os.ftruncate(fd, self.file_size)
        finally:
            os.close(fd)

        def setup(c: sqlite3.Connection) -> None:
            c.execute(
                "INSERT OR IGNORE INTO files VALUES (?, ?, ?, 0)",
                (self.file, self.slot_bytes, self.nslots),
            )
            # Reclaim slots whose writer (on this host) died before publishing them.
            rows = c.execute(
                "SELECT file, slot, pid FROM pending WHERE host = ?", (self._host,)
            ).fetchall()
            for file, slot, pid in rows:
                if not pid_alive(pid):
                    c.execute("DELETE FROM pending WHERE file = ? AND slot = ?", (file, slot))
                    c.execute("INSERT OR IGNORE INTO free VALUES (?, ?)", (file, slot))

        self._write_txn(setup)

    def _fd(self, file: str) -> int:
        with self._fd_lock:
            if self._closed:
                raise StorageError("hf3fs: backend is closed")
            fd = self._fds.get(file)
            if fd is None:
                fd = os.open(self.root / file, os.O_RDWR)
                self._fds[file] = fd
            return fd

    def _next_seq(self, c: sqlite3.Connection, n: int) -> int:
        c.execute("INSERT OR IGNORE INTO counters VALUES ('seq', 0)")
        c.execute("UPDATE counters SET value = value + ? WHERE name = 'seq'", (n,))
        (last,) = c.execute("SELECT value FROM counters WHERE name = 'seq'").fetchone()
        return int(last) - n + 1

    # -- I/O -------------------------------------------------------------------------------

    def _io(
        self, ios: list[tuple[str, int, memoryview]], read: bool,
        then: Callable[[int, int], None] | None = None,
    ) -> list[int]:
        """(file, slot, buffer) per page: bytes moved per page (-1 on an OS error). `then(j,
        n)` runs right after I/O j, in the thread that did it (the reads' record checks)."""
        if not ios:
            return []
        if self._usrbio is not None:
            try:
                out: list[int] = []
                step = self._usrbio._entries
                for i in range(0, len(ios), step):
                    part = [(self._fd(f), s * self.slot_bytes, b) for f, s, b in ios[i : i + step]]
                    out.extend(self._usrbio.run(part, read))
                if then is not None:
                    for j, n in enumerate(out):
                        then(j, n)
                return out
            except Exception as e:  # noqa: BLE001 - never lose a page to the fast path
                logger.warning("hf3fs: usrbio failed (%s); falling back to POSIX I/O", e)
                self._usrbio = None

        def one(j: int) -> int:
            file, slot, buf = ios[j]
            fd = self._fd(file)
            off = slot * self.slot_bytes
            try:
                if read:
                    n = os.preadv(fd, [buf], off)
                else:
                    n = os.pwrite(fd, buf, off)
                    if self.fsync:
                        os.fdatasync(fd)
            except OSError as e:
                logger.warning("hf3fs: %s of %s slot %d failed: %s",
                               "read" if read else "write", file, slot, e)
                n = -1
            if then is not None:
                then(j, n)
            return n

        if len(ios) == 1 or self.numjobs == 1:
            return [one(j) for j in range(len(ios))]
        return list(self._pool.map(one, range(len(ios))))

    # -- StorageBackend --------------------------------------------------------------------

    def _lookup(self, keys: Sequence[str], cols: str) -> dict[str, tuple[Any, ...]]:
        conn = self._db()
        found: dict[str, tuple[Any, ...]] = {}
        try:
            for part in chunks(keys):
                q = f"SELECT key, {cols} FROM pages WHERE key IN ({','.join('?' * len(part))})"
                for row in conn.execute(q, list(part)):
                    found[row[0]] = tuple(row[1:])
        except sqlite3.Error as e:
            self._count(errors=1)
            raise StorageError(f"hf3fs: index lookup failed: {e}") from e
        return found

    def batch_exists(self, keys: Sequence[str]) -> int:
        self._count(exists_calls=1)
        if not keys:
            return 0
        present = self._lookup(keys, "slot")
        return leading_run([k in present for k in keys])

    def _get_into(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[int]:
        return [r.length for r in self._read(keys, out, check=False)]

    def _get_checked(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[Checked]:
        # Each record is checked by the I/O thread that read it, right after its read.
        return self._read(keys, out, check=True)

    def _read(self, keys: Sequence[str], out: Sequence[memoryview], check: bool) -> list[Checked]:
        where = self._lookup(keys, "file, slot, length, seq")
        result = [Checked(-1, None)] * len(keys)
        ios: list[tuple[str, int, memoryview]] = []
        idx: list[int] = []
        for i, (k, buf) in enumerate(zip(keys, out)):
            loc = where.get(k)
            if loc is None:
                continue
            file, slot, length, _seq = loc
            dst = byte_view(buf)
            if length != len(dst):  # a size mismatch: dropped as corrupt
                result[i] = Checked(length, self.check_record(k, length, dst) if check else None)
                continue
            ios.append((file, slot, dst))
            idx.append(i)
        problems: list[str | None] = [None] * len(ios)

        def checked(j: int, n: int) -> None:
            if n == len(ios[j][2]):
                problems[j] = self.check_record(keys[idx[j]], n, ios[j][2])

        moved = self._io(ios, read=True, then=checked if check else None)
        # A slot evicted and rewritten by another process while we read it is a plain miss.
        again = self._lookup([keys[i] for i in idx], "file, slot, length, seq")
        hits: list[str] = []
        for j, (i, n) in enumerate(zip(idx, moved)):
            k = keys[i]
            if again.get(k) != where[k] or n != where[k][2]:
                if n < 0:
                    self._count(errors=1)
                continue
            result[i] = Checked(n, problems[j])
            hits.append(k)
        if hits:
            now = time.time_ns()

            def touch(c: sqlite3.Connection) -> None:
                for part in chunks(hits):
                    c.execute(
                        f"UPDATE pages SET atime = ? WHERE key IN ({','.join('?' * len(part))})",
                        [now, *part],
                    )

            self._write_txn(touch, durable=False)
        return result

    def _set_from(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        views = [byte_view(v) for v in values]
        ok = [False] * len(keys)
        todo: list[int] = []
        seen: set[str] = set()
        for i, (k, v) in enumerate(zip(keys, views)):
            if len(v) <= self.slot_bytes and k not in seen:
                todo.append(i)
                seen.add(k)
        present = self._lookup([keys[i] for i in todo], "length")
        stale: list[str] = []  # stored with another length: replaced
        for i in todo:
            if keys[i] in present:
                if present[keys[i]][0] == len(views[i]):
                    ok[i] = True  # records of a key are identical: nothing to write
                else:
                    stale.append(keys[i])
        todo = [i for i in todo if not ok[i]]
        evicted = 0

        def reserve(c: sqlite3.Connection) -> list[int]:
            nonlocal evicted
            slots: list[int] = []
            for key in stale:
                row = c.execute("SELECT file, slot FROM pages WHERE key = ?", (key,)).fetchone()
                if row is not None:
                    c.execute("DELETE FROM pages WHERE key = ?", (key,))
                    c.execute("INSERT OR IGNORE INTO free VALUES (?, ?)", row)
            need = len(todo)
            rows = c.execute(
                "SELECT slot FROM free WHERE file = ? LIMIT ?", (self.file, need)
            ).fetchall()
            for (s,) in rows:
                c.execute("DELETE FROM free WHERE file = ? AND slot = ?", (self.file, s))
                slots.append(s)
            if len(slots) < need:
                (hwm,) = c.execute(
                    "SELECT hwm FROM files WHERE file = ?", (self.file,)
                ).fetchone()
                fresh = min(need - len(slots), self.nslots - hwm)
                slots.extend(range(hwm, hwm + fresh))
                c.execute("UPDATE files SET hwm = ? WHERE file = ?", (hwm + fresh, self.file))
            if len(slots) < need:  # full: evict the least recently used pages of this file
                rows = c.execute(
                    "SELECT key, slot FROM pages WHERE file = ? ORDER BY atime LIMIT ?",
                    (self.file, need - len(slots)),
                ).fetchall()
                for key, s in rows:
                    c.execute("DELETE FROM pages WHERE key = ?", (key,))
                    slots.append(s)
                evicted = len(rows)
            for s in slots:
                c.execute(
                    "INSERT INTO pending VALUES (?, ?, ?, ?)", (self.file, s, self._host,
                                                               os.getpid())
                )
            return slots

        slots = self._write_txn(reserve) if todo else []
        # Fewer slots than pages only when every slot is pending elsewhere: those pages fail.
        placed = list(zip(todo, slots))
        moved = self._io([(self.file, s, views[i]) for i, s in placed], read=False)

        def publish(c: sqlite3.Connection) -> None:
            seq = self._next_seq(c, len(placed))
            now = time.time_ns()
            for j, ((i, s), n) in enumerate(zip(placed, moved)):
                c.execute("DELETE FROM pending WHERE file = ? AND slot = ?", (self.file, s))
                stored = False
                if n == len(views[i]):
                    cur = c.execute(
                        "INSERT OR IGNORE INTO pages VALUES (?, ?, ?, ?, ?, ?)",
                        (keys[i], self.file, s, n, seq + j, now),
                    )
                    stored = cur.rowcount == 1
                    ok[i] = True  # stored now, or by another process meanwhile
                if not stored:
                    c.execute("INSERT OR IGNORE INTO free VALUES (?, ?)", (self.file, s))

        if placed:
            self._write_txn(publish)
        # Duplicates of a key within the batch share the first one's outcome.
        first = {keys[i]: ok[i] for i in range(len(keys)) if keys[i] in seen and ok[i]}
        for i, k in enumerate(keys):
            if not ok[i] and first.get(k):
                ok[i] = True
        self._count(evicted_pages=evicted, errors=sum(1 for n in moved if n < 0))
        return ok

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return

        def drop(c: sqlite3.Connection) -> int:
            n = 0
            for part in chunks(keys):
                marks = ",".join("?" * len(part))
                rows = c.execute(
                    f"SELECT file, slot FROM pages WHERE key IN ({marks})", list(part)
                ).fetchall()
                c.execute(f"DELETE FROM pages WHERE key IN ({marks})", list(part))
                c.executemany("INSERT OR IGNORE INTO free VALUES (?, ?)", rows)
                n += len(rows)
            return n

        self._count(deleted_pages=self._write_txn(drop))

    def clear(self) -> None:
        def drop_all(c: sqlite3.Connection) -> None:
            c.execute("INSERT OR IGNORE INTO free SELECT file, slot FROM pages")
            c.execute("DELETE FROM pages")

        self._write_txn(drop_all)

    def stats(self) -> BackendStats:
        try:
            pages, nbytes = self._db().execute(
                "SELECT COUNT(*), COALESCE(SUM(length), 0) FROM pages"
            ).fetchone()
            self._set_gauge(stored_pages=int(pages), stored_bytes=int(nbytes))
        except sqlite3.Error as e:
            logger.debug("hf3fs: stats query failed: %s", e)
        return super().stats()

    def close(self) -> None:
        with self._fd_lock:
            if self._closed:
                return
            self._closed = True
            fds = list(self._fds.values())
            self._fds.clear()
        self._pool.shutdown(wait=True)
        if self._usrbio is not None:
            self._usrbio.close()
        for fd in fds:
            os.close(fd)
        with self._fd_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
        self._local = threading.local()

