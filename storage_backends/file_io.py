"""Low-level reads for the `file` backend: readinto a caller's buffer, buffered or O_DIRECT.

O_DIRECT needs the buffer address, the file offset and the length 4 KiB-aligned; a record is
rarely a whole number of blocks, so `read_direct` / `write_direct` move the aligned bulk straight
between the file and the caller's (aligned) buffer and only the last partial block through a
small aligned bounce buffer (a write then cuts the file back to the record's length).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

DIRECT_ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)
# A thread hand-off costs tens of microseconds: smaller batches are read by the caller alone.
PARALLEL_READ_BYTES = 256 << 10
# `ReadFanOut` with `auto`: a batch is read by the caller's thread alone once that thread has
# spent more than this share of its recent batch time runnable but waiting for a CPU (every core
# is busy: more reading threads would only queue for the same cores, and pay the hand-offs) ...
BUSY_SHARE = 0.2
# ... judged over windows of this much batch time (one batch alone says little: it either fitted
# in a time slice or it did not).
BUSY_WINDOW_NS = 50_000_000


def address(mv: memoryview) -> int:
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def read_buffered(fd: int, dst: memoryview, off: int = 0) -> int:
    """readinto `dst[off:]` from file offset `off` until full or EOF; the bytes now in `dst`."""
    size = len(dst)
    while off < size:
        n = os.preadv(fd, (dst[off:],) if off else (dst,), off)
        if n == 0:
            break  # truncated meanwhile: reported as a short (corrupt) record
        off += n
    return off


def read_direct(fd: int, dst: memoryview) -> int:
    """`read_buffered` for an O_DIRECT `fd` and a 4 KiB-aligned `dst`: the aligned bulk goes
    straight into `dst`, a last partial block through a 4 KiB aligned bounce buffer."""
    size = len(dst)
    bulk = size - size % DIRECT_ALIGN
    off = 0
    while off < bulk:
        n = os.preadv(fd, [dst[off:bulk]], off)
        if n == 0:
            return off
        off += n
    if off < size:
        bounce = _bounce()
        n = os.preadv(fd, [bounce], off)
        take = min(n, size - off)
        dst[off : off + take] = bounce[:take]
        off += take
    return off


_tls = threading.local()
# One byte past the buffer of a buffered read: filled only when the file is longer. Threads may
# share it: what it holds is never looked at.
_EOF_PROBE = memoryview(bytearray(1))
_SCHEDSTAT = "/proc/thread-self/schedstat"


def cpu_wait_ns() -> int | None:
    """Nanoseconds the calling thread has so far spent runnable but waiting for a CPU (the
    kernel's run-queue delay, field 2 of /proc/thread-self/schedstat), or None where the kernel
    does not tell. One `pread` of a file this thread keeps open (reopened after a fork)."""
    pid = os.getpid()
    if getattr(_tls, "schedstat_pid", 0) != pid:
        old = getattr(_tls, "schedstat", None)
        if old is not None:
            old.close()  # a fork's copy of the parent thread's file
        try:
            _tls.schedstat = open(_SCHEDSTAT, "rb", buffering=0)  # noqa: SIM115 - kept open
        except OSError:
            _tls.schedstat = None
        _tls.schedstat_pid = pid
    f = _tls.schedstat
    if f is None:
        return None
    try:
        return int(os.pread(f.fileno(), 64, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _bounce() -> memoryview:
    """A 4 KiB-aligned 4 KiB buffer of this thread (an anonymous mapping is page-aligned)."""
    buf: memoryview | None = getattr(_tls, "bounce", None)
    if buf is None:
        buf = memoryview(mmap.mmap(-1, DIRECT_ALIGN))
        _tls.bounce = buf
    return buf


def default_read_threads() -> int:
    """The CPUs this process may run on, at most 4: a page-cache read is bound by its copy, and
    threads beyond the cores only queue for them."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


class ReadFanOut:
    """Runs the reads of one batch in up to `threads` threads: contiguous slices of the batch
    of at least `PARALLEL_READ_BYTES` each, the caller's thread taking the first.

    With `auto`, only while a core is free for them: the caller's run-queue delay
    (`wait_clock`, default `cpu_wait_ns`) is measured over every batch that could fan out, and
    while it exceeds `BUSY_SHARE` of the batch time of the last full window of `window_ns` (or
    no window is complete yet), the batch is read by the caller alone. Where the delay is
    unknown, batches always fan out.
    """

    def __init__(
        self,
        threads: int,
        *,
        auto: bool = True,
        wait_clock: Callable[[], int | None] | None = None,
        window_ns: int = BUSY_WINDOW_NS,
    ) -> None:
        self.threads = threads
        self.auto = auto
        self.wait_clock = wait_clock or cpu_wait_ns
        self.window_ns = window_ns
        self.fanned_out = 0  # batches read by more than one thread (for tests and tuning)
        # Share of the last window's batch time spent waiting for a CPU; until a window is
        # measured, taken as busy: a burst of fresh processes must not all fan out at once.
        self.busy = 1.0
        self._window = [0, 0]  # run-queue wait and batch time (ns) of the current window
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0

    def run(self, work: Callable[[int, int], None], out: Sequence[memoryview]) -> None:
        """Call `work(lo, hi)` over slices covering `range(len(out))`; return when all did."""
        n = len(out)
        parts = min(self.threads, n)
        if parts > 1:
            total = sum(memoryview(o).nbytes for o in out)
            parts = max(1, min(parts, total // PARALLEL_READ_BYTES))
        wait0 = None
        if parts > 1 and self.auto:
            wait0 = self.wait_clock()
            if wait0 is not None and self.busy > BUSY_SHARE:
                parts = 1
        t0 = time.perf_counter_ns()
        if parts == 1:
            work(0, n)
        else:
            bounds = [(n * j // parts, n * (j + 1) // parts) for j in range(parts)]
            pool = self._executor()
            futures = [pool.submit(work, lo, hi) for lo, hi in bounds[1:]]
            try:
                work(*bounds[0])
            finally:
                for f in futures:
                    f.result()
            with self._lock:
                self.fanned_out += 1
        if wait0 is not None:
            wait1 = self.wait_clock()
            if wait1 is not None:
                self._note(wait1 - wait0, time.perf_counter_ns() - t0)

    def _note(self, wait_ns: int, batch_ns: int) -> None:
        with self._lock:
            w = self._window
            w[0] += wait_ns
            w[1] += batch_ns
            if w[1] >= self.window_ns:
                self.busy = w[0] / max(1, w[1])
                w[0] = w[1] = 0

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool_pid != os.getpid():  # none yet, or forked
                self._pool = ThreadPoolExecutor(
                    max_workers=self.threads - 1, thread_name_prefix="hicache-file-read"
                )
                self._pool_pid = os.getpid()
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pool_pid == os.getpid():
            pool.shutdown(wait=True)


def read_file(path: str, dst: memoryview, direct: bool) -> tuple[int, OSError | None]:
    """Read file `path` into `dst`. Returns the file's size and, when O_DIRECT was asked for
    and refused by the file system (EINVAL), that error (the read was then done buffered).

    `dst` holds the file when the size is `len(dst)`. A file of another size is a corrupt
    record to the caller: a buffered read may have filled `dst` partly (it learns the size from
    the read itself, one byte past `dst` showing a longer file, instead of an `fstat` per read);
    an O_DIRECT read (which checks the size first) leaves `dst` alone then."""
    if not direct:  # the common case: open, one preadv, close
        fd = os.open(path, os.O_RDONLY)
        try:
            size = len(dst)
            n = os.preadv(fd, (dst, _EOF_PROBE), 0)
            if n == size:
                return size, None
            if n > size:  # longer than `dst`: its true size
                return os.fstat(fd).st_size, None
            return (read_buffered(fd, dst, n) if n else 0), None  # shorter, or a short read
        finally:
            os.close(fd)
    refused: OSError | None = None
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        refused, direct = e, False
        fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != len(dst):
            return size, refused
        if direct:
            try:
                return read_direct(fd, dst), None
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                refused = e
        return read_buffered(fd, dst), refused
    finally:
        os.close(fd)


def write_direct(fd: int, src: memoryview) -> None:
    """Write `src` (at a 4 KiB-aligned address) to the new, empty O_DIRECT file `fd`: whole
    blocks straight from `src`, a last partial block through a zero-padded aligned bounce
    buffer, then the file cut back to `len(src)`."""
    size = len(src)
    bulk = size - size % DIRECT_ALIGN
    off = 0
    while off < bulk:
        off += os.pwritev(fd, [src[off:bulk]], off)
    if off < size:
        tail = size - off
        bounce = _bounce()
        bounce[:tail] = src[off:]
        bounce[tail:] = bytes(DIRECT_ALIGN - tail)
        if os.pwritev(fd, [bounce], off) != DIRECT_ALIGN:
            raise OSError(errno.EIO, "short O_DIRECT write")
        os.ftruncate(fd, size)


def _write_buffered(fd: int, src: memoryview) -> None:
    off = 0
    while off < len(src):
        off += os.pwrite(fd, src[off:], off)


def publish(
    fd: int, tmp: str, final: str, src: memoryview, fsync: str, direct: bool = False
) -> OSError | None:
    """Write `src` to the new temp file `tmp` (open as `fd`, with O_DIRECT when `direct`;
    closed here), sync it per `fsync` ("none" | "data" | "always": file and directory) and
    rename it to `final`. Returns the error with which the file system refused O_DIRECT (the
    write was then redone buffered), else None. Raises OSError after removing `tmp`."""
    refused: OSError | None = None
    try:
        try:
            if direct:
                try:
                    write_direct(fd, src)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    refused = e
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
                    os.ftruncate(fd, 0)
                    _write_buffered(fd, src)
            else:
                _write_buffered(fd, src)
            if fsync == "data":
                os.fdatasync(fd)
            elif fsync == "always":
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync == "always":
        dfd = os.open(os.path.dirname(final), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return refused
