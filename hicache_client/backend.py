"""The L3 storage interface: `StorageConfig`, `BackendStats` and the `StorageBackend` ABC.

Backends move opaque page *records* (bytes, see hicache_client.codec). `StorageBackend.batch_get`
validates each record it returns, so a truncated, bit-flipped or misplaced record is a counted
miss (and deleted where the backend can), never KV handed to a model. `batch_get_parts` /
`batch_set_parts` do the same for records scattered over several buffers (a header buffer and
the page's regions in a host pool), so a caller need not assemble them.
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence, Sized
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, NamedTuple

from hicache_client.codec import RecordHeader, verify_record
from hicache_client.errors import StorageCorrupt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorageConfig:
    """What every backend constructor receives: `Backend(config)`."""

    # Backend-specific settings (`--hicache-storage-backend-extra-config`, a JSON object).
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Hex namespace seed of the owning cache; backends may use it as a key prefix. Keys are
    # already namespaced by construction (see hicache_client.keys), so this is for tidiness/ops only.
    namespace: str = ""
    # Size in bytes of one page record for this cache (0 when unknown).
    record_bytes: int = 0
    tp_rank: int = 0
    tp_size: int = 1

    def get(self, key: str, default: Any = None) -> Any:
        return self.extra.get(key, default)


@dataclass
class BackendStats:
    """Counters of one backend object. Units are in the names."""

    exists_calls: int = 0
    get_pages: int = 0  # pages asked for by batch_get
    get_hits: int = 0  # pages returned valid
    set_pages: int = 0  # pages asked to be stored
    set_failures: int = 0  # pages batch_set reported False for
    bytes_read: int = 0
    bytes_written: int = 0  # bytes of the records batch_set reported stored
    # Records dropped as corrupt: failed validation in batch_get, or reported by a caller
    # through report_corrupt. The one count of corrupt L3 pages (CacheStats reads it).
    corrupt_pages: int = 0
    errors: int = 0  # failed operations (unreachable, I/O error, disk full...)
    deleted_pages: int = 0
    evicted_pages: int = 0  # pages the backend dropped to stay under its capacity
    stored_pages: int = -1  # pages currently held (-1: the backend cannot tell)
    stored_bytes: int = -1

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Checked(NamedTuple):
    """One key's outcome of a checked read (`StorageBackend._get_checked`)."""

    length: int  # the stored record's length in bytes; -1 when the key is absent
    problem: str | None  # why the record is corrupt; None when valid or absent


_ABSENT = Checked(-1, None)
# A caller's own judgement of a record that passed every check (`batch_get_parts(accept=...)`):
# why it is not wanted (e.g. a page of another format), or None to take it.
HeaderCheck = Callable[[str, RecordHeader], str | None]
# Records at least this long are checked off the reading thread (a thread hand-off costs tens of
# microseconds; XXH3 checks 256 KiB in about ten).
OFFLOAD_CHECK_BYTES = 256 << 10
CHECK_THREADS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def check_pool() -> ThreadPoolExecutor:
    """The process-wide threads that check records (recreated after a fork)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="hicache-check")
            _pool_pid = os.getpid()
        return _pool


class RecordChecker:
    """Checks records while the backend goes on reading: `add` each record as soon as it is in
    its buffer (a large one is checked on a `check_pool` thread, the GIL released), `results`
    when the batch is read. So the check of record i overlaps the read of record i+1."""

    def __init__(self, backend: StorageBackend, n: int, *, offload: bool = True) -> None:
        """`offload=False`: check every record in the calling thread (a record this thread has
        just copied is in its cache; handing it to another core costs more than the check)."""
        self._backend = backend
        self._offload = offload
        self._res: list[Checked] = [_ABSENT] * n
        self._pending: list[tuple[int, int, Future[str | None]]] = []

    def add(self, i: int, key: str, length: int, buf: memoryview) -> None:
        """Record i (`key`, stored length `length`, -1 when absent) was read into `buf`."""
        if length < 0:
            return
        if self._offload and length >= OFFLOAD_CHECK_BYTES and length == memoryview(buf).nbytes:
            fut = check_pool().submit(self._backend.check_record, key, length, buf)
            self._pending.append((i, length, fut))
        else:
            self._res[i] = Checked(length, self._backend.check_record(key, length, buf))

    def results(self) -> list[Checked]:
        for i, length, fut in self._pending:
            self._res[i] = Checked(length, fut.result())
        self._pending.clear()
        return self._res


def byte_view(buf: memoryview | bytes | bytearray) -> memoryview:
    """A flat unsigned-byte view of any buffer (no copy)."""
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def flat_parts(parts: Sequence[memoryview]) -> list[memoryview]:
    """Flat unsigned-byte views of one record's parts (no copy)."""
    return [byte_view(p) for p in parts]


class ThreadBuffers:
    """Per thread, one byte area that grows as needed, handed out as buffers side by side:
    `take(sizes)`'s buffers are reused by the same thread's next call, so a batch costs no
    allocation and no page faults once warm (records read before a check, the headers of
    records whose payload lies in an engine's pool)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def held(self) -> int:
        """Bytes of this thread's area (0: it never took any)."""
        buf: bytearray | None = getattr(self._local, "buf", None)
        return 0 if buf is None else len(buf)

    def take(self, sizes: Sequence[int]) -> list[memoryview]:
        need = sum(sizes)
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < need:
            buf = self._local.buf = bytearray(need)
        mv = memoryview(buf)
        out = []
        off = 0
        for n in sizes:
            out.append(mv[off : off + n])
            off += n
        return out


def scatter(src: memoryview, parts: Sequence[memoryview]) -> None:
    """Copy `src` over `parts` in order (their lengths add up to `len(src)`)."""
    off = 0
    for p in parts:
        n = len(p)
        p[:] = src[off : off + n]
        off += n


def gather(parts: Sequence[memoryview], dst: memoryview) -> None:
    """Copy `parts` one after the other into `dst` (their lengths add up to `len(dst)`)."""
    off = 0
    for p in parts:
        n = len(p)
        dst[off : off + n] = p
        off += n


def _paired(keys: Sequence[str], other: Sized, what: str) -> bool:
    """Whether a batch has any keys; ValueError when its `what` do not pair up with them."""
    if len(keys) != len(other):
        raise ValueError(f"{len(keys)} keys but {len(other)} {what}")
    return bool(keys)


class StorageBackend(ABC):
    """An L3 page store shared by many cache instances.

    Contract (every backend, checked by tests/storage_backends/test_contract.py):
    - Methods are thread-safe: the cache's prefetch and backup threads call them concurrently.
    - `batch_exists(keys)` returns the length of the leading run of `keys` present.
    - `batch_get(keys, out)` fills `out[i]` with the record of `keys[i]` and returns, per key,
      whether a *valid* record was delivered. A missing key is False; a record that fails
      `verify_record` (or has another length than `out[i]`, or names another namespace than
      `config.namespace` when that is set) is False too, counted in
      `stats().corrupt_pages` and deleted. The contents of `out[i]` are unspecified when False.
    - `batch_set(keys, values)` stores each record all-or-nothing; returns per key whether it
      is now stored. Setting an existing key again is harmless (records of a key are identical).
    - `batch_get_parts` / `batch_set_parts` are the same with each record in several buffers
      (scatter / gather); every backend has them (by default through a temporary per record).
    - A method that cannot do its work raises `StorageError` (`StorageUnavailable` when
      transient): it never returns None or a partial list.

    `batch_get` and `batch_set` are template methods: a backend implements the raw `_get_into`
    (or, to check records while it reads, `_get_checked`) and `_set_from`; argument checks,
    validation and the get/set/corrupt counters live here once. (A backend may still override
    `batch_set` itself and count its own set counters.) The parts pair's are `_get_parts_checked`
    and `_set_parts`, whose defaults go through `_get_checked` and `batch_set`.
    """

    name: ClassVar[str] = "abstract"

    def __init__(self, config: StorageConfig) -> None:
        if (
            type(self).batch_set is StorageBackend.batch_set
            and type(self)._set_from is StorageBackend._set_from
        ):
            raise TypeError(f"{type(self).__name__} implements neither _set_from nor batch_set")
        self.config = config
        self._stats = BackendStats()
        self._stats_lock = threading.Lock()
        self._warned_corrupt = False
        # Records whose header names another namespace are rejected when ours is known.
        self._namespace = bytes.fromhex(config.namespace) if config.namespace else b""
        self._scratch_buffers = ThreadBuffers()  # records read into temporaries
        self._scratch = self._scratch_buffers.take
        self._last_get = threading.local()  # per thread: the corrupt keys of its latest get

    # -- to implement ---------------------------------------------------------------------

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int: ...

    @abstractmethod
    def _get_into(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[int]:
        """Raw read. Per key: the stored value's length, or -1 when absent. `out[i]` holds the
        record only when that length equals `len(out[i])`; otherwise its contents are
        unspecified (a backend may have read part of a longer or shorter value into it)."""

    def _set_from(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        """Raw write of a non-empty batch (`len(keys) == len(values)` is checked): per key,
        whether it is now stored. Raise `StorageError` when nothing could be done."""
        raise NotImplementedError

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None: ...

    @abstractmethod
    def clear(self) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files. Idempotent."""

    def _get_checked(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[Checked]:
        """Read and check each record. The default reads the batch with `_get_into`, then
        checks its large records on `check_pool` threads and the rest in this one. A backend
        that receives records one by one overrides this to feed a `RecordChecker` as they
        arrive; one that reads in several threads runs `check_record` in them, right after
        each read (the checksum releases the GIL)."""
        lengths = self._get_into(keys, out)
        if len(lengths) != len(keys):
            raise AssertionError(f"{type(self).__name__}._get_into returned {len(lengths)} results")
        checker = RecordChecker(self, len(keys))
        for i, (key, n, buf) in enumerate(zip(keys, lengths, out)):
            checker.add(i, key, n, buf)
        return checker.results()

    # -- provided -------------------------------------------------------------------------

    def check_record(self, key: str, length: int, buf: memoryview) -> str | None:
        """Why the record of `key` just read into `buf` (stored length `length`) is corrupt,
        or None when it is valid. Thread-safe; counts nothing."""
        try:
            if length != len(memoryview(buf).cast("B")):
                raise StorageCorrupt(f"stored record is {length} bytes, expected {len(buf)}")
            header = verify_record(buf, key)
            if self._namespace and header.namespace != self._namespace:
                raise StorageCorrupt("record is from another namespace")
        except StorageCorrupt as e:
            return str(e)
        return None

    def _check_results(self, keys: Sequence[str], results: Sized, method: str) -> None:
        """A subclass's `method` answered one result per key (else a bug: AssertionError)."""
        if len(results) != len(keys):
            raise AssertionError(f"{type(self).__name__}{method} returned {len(results)} results")

    def batch_get(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[bool]:
        if not _paired(keys, out, "buffers"):
            return []
        checked = self._get_checked(keys, out)
        self._check_results(keys, checked, "")
        return self._tally(keys, checked)

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]], *,
                        accept: HeaderCheck | None = None) -> list[bool]:
        """`batch_get` of records scattered over several buffers each: `keys[i]`'s record (its
        128-byte header, then its payload) fills `parts[i]` in order (typically a header
        buffer, then the regions of a page in a host pool), whose lengths add up to the
        record's. Per key, whether a valid record was delivered, exactly as `batch_get` answers
        and counts (misses, corrupt records counted and deleted; never an exception for a
        backend failure).

        `accept(key, header)`, when given, is asked of every record that passed its checks;
        an answer other than None makes it corrupt too (counted, deleted, False), and its
        payload is not delivered (e.g. a page of another format than the caller's).

        When False, the parts' contents are unspecified, as in `batch_get`. This default reads
        each record into a temporary, checks it and copies it into its parts only when valid
        and accepted, so its parts are left untouched then; a backend may override
        `_get_parts_checked` to copy straight into the parts (see its docstring).
        """
        if not _paired(keys, parts, "part lists"):
            return []
        checked = self._get_parts_checked(keys, [flat_parts(ps) for ps in parts], accept)
        self._check_results(keys, checked, "._get_parts_checked")
        return self._tally(keys, checked)

    def batch_set_parts(self, keys: Sequence[str],
                        parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """`batch_set` of records each gathered from several buffers: `keys[i]`'s record is
        `parts[i]` one after the other. Answers and counts exactly as `batch_set`."""
        if not _paired(keys, parts, "part lists"):
            return []
        ok = self._set_parts(keys, [flat_parts(ps) for ps in parts])
        self._check_results(keys, ok, "._set_parts")
        return ok

    def _get_parts_checked(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]],
                           accept: HeaderCheck | None) -> list[Checked]:
        """Read, check and deliver records into their parts (flat byte views). The default
        reads the batch into temporaries with `_get_checked`, then copies each valid, accepted
        record into its parts. A backend that copies straight into the parts overrides this;
        it must check the bytes as they are in the parts (the caller's), and should leave the
        parts untouched where it can (judge what it can before copying)."""
        tmp = self._scratch([sum(len(p) for p in ps) for ps in parts])
        checked = self._get_checked(keys, tmp)
        self._check_results(keys, checked, "._get_checked")
        return [self._deliver(key, c, t, ps, accept)
                for key, c, t, ps in zip(keys, checked, tmp, parts)]

    def _deliver(self, key: str, checked: Checked, record: memoryview,
                 parts: Sequence[memoryview], accept: HeaderCheck | None) -> Checked:
        """Copy `record` (read and checked: `checked`) into `parts` when it is valid and
        `accept` takes it; what the caller is told of it."""
        if checked.length < 0 or checked.problem is not None:
            return checked
        if accept is not None:
            problem = accept(key, verify_record(record, key, checksum=False))
            if problem is not None:
                return Checked(checked.length, problem)
        scatter(record, parts)
        return checked

    def _set_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]
                   ) -> list[bool]:
        """Store records gathered from their parts (flat byte views). The default copies each
        into a temporary and calls `batch_set`, which counts."""
        tmp = self._scratch([sum(len(p) for p in ps) for ps in parts])
        for ps, t in zip(parts, tmp):
            gather(ps, t)
        return self.batch_set(keys, tmp)

    def _tally(self, keys: Sequence[str], checked: Sequence[Checked]) -> list[bool]:
        """Per key whether a valid record was delivered; count the batch, report the corrupt."""
        ok: list[bool] = []
        bad: list[str] = []
        nbytes = 0
        for key, (n, problem) in zip(keys, checked):
            if n < 0:
                ok.append(False)
            elif problem is not None:
                bad.append(key)
                ok.append(False)
                if not self._warned_corrupt:
                    self._warned_corrupt = True
                    logger.warning("%s: dropping corrupt page %s: %s", self.name, key[:16], problem)
                else:
                    logger.debug("%s: dropping corrupt page %s: %s", self.name, key[:16], problem)
            else:
                ok.append(True)
                nbytes += n
        if bad:
            self.report_corrupt(bad)
        self._last_get.corrupt = bad
        self._count(get_pages=len(keys), get_hits=sum(ok), bytes_read=nbytes)
        return ok

    def corrupt_in_last_get(self) -> list[str]:
        """The keys that the calling thread's latest `batch_get` / `batch_get_parts` dropped
        as corrupt (a False there is otherwise a miss or a failure). A backend that overrides
        `batch_get` without `_tally` reports none."""
        return list(getattr(self._last_get, "corrupt", ()))

    def batch_set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        if not _paired(keys, values, "values"):
            return []
        ok = self._set_from(keys, values)
        self._check_results(keys, ok, "._set_from")
        written = sum(memoryview(v).nbytes for v, stored in zip(values, ok) if stored)
        self._count(set_pages=len(keys), set_failures=ok.count(False), bytes_written=written)
        return ok

    def report_corrupt(self, keys: Sequence[str]) -> None:
        """Count `keys` as corrupt and delete them (a caller that found a bad record, e.g. a
        page of another format, calls this: `stats().corrupt_pages` is the one count). Never
        raises: a failed delete is only logged."""
        self._count(corrupt_pages=len(keys))
        try:
            self.delete(keys)
        except Exception as e:  # noqa: BLE001 - deletion is best effort
            logger.debug("%s: could not delete corrupt pages: %s", self.name, e)

    def stats(self) -> BackendStats:
        with self._stats_lock:
            return BackendStats(**self._stats.as_dict())

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def _set_gauge(self, **values: int) -> None:
        with self._stats_lock:
            for k, v in values.items():
                setattr(self._stats, k, v)

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
