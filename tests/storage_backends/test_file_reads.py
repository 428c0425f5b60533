"""`file` backend reads: one `preadv` that learns the file's size, reads fanned out over threads
only while cores are free (`ReadFanOut`), and the run-queue clock that decides it."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from pathlib import Path

import pytest

from hicache_client.backend import StorageConfig
from hicache_client.codec import HEADER_BYTES
from storage_backends import file_io
from storage_backends.file_backend import FileBackend
from storage_backends.file_io import (
    PARALLEL_READ_BYTES,
    ReadFanOut,
    cpu_wait_ns,
    read_file,
)
from tests.storage_backends.conftest import NAMESPACE, buffers, make_codec, make_keys, make_records

SCHEDSTAT = Path("/proc/thread-self/schedstat")


class _WhoReads(FileBackend):
    """Records which thread read each page."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.read_by: dict[str, str] = {}

    def _read(self, path: str, dst: memoryview) -> int:
        self.read_by[Path(path).name] = threading.current_thread().name
        return super()._read(path, dst)


class _RunQueueClock:
    """A scripted run-queue delay: every reading grows by `step` ns."""

    def __init__(self) -> None:
        self.now = 0
        self.step = 0

    def __call__(self) -> int:
        self.now += self.step
        return self.now


# -- one preadv per record ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "expect_size"),
    [(b"r" * 64, 64), (b"r" * 40, 40), (b"r" * 64 + b"tail", 68), (b"", 0)],
    ids=["exact", "shorter", "longer", "empty"],
)
def test_read_file_reports_the_files_size(tmp_path: Path, stored: bytes, expect_size: int) -> None:
    path = tmp_path / "page"
    path.write_bytes(stored)
    dst = memoryview(bytearray(64))
    assert read_file(str(path), dst, False) == (expect_size, None)
    if expect_size == 64:
        assert bytes(dst) == stored


def test_read_file_into_an_empty_buffer(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "full").write_bytes(b"abc")
    assert read_file(str(tmp_path / "empty"), memoryview(bytearray()), False) == (0, None)
    assert read_file(str(tmp_path / "full"), memoryview(bytearray()), False) == (3, None)


# -- fan-out while cores are free ---------------------------------------------------------------


def _backend_with_clock(root: Path, clock: _RunQueueClock) -> _WhoReads:
    b = _WhoReads(StorageConfig(extra={"path": str(root), "read_threads": 4},
                                namespace=NAMESPACE.hex()))
    b._fan_out.close()
    b._fan_out = ReadFanOut(4, wait_clock=clock, window_ns=0)  # every batch closes a window
    return b


def test_busy_cpus_read_inline_with_the_same_results_and_checks(tmp_path: Path) -> None:
    clock = _RunQueueClock()
    b = _backend_with_clock(tmp_path, clock)
    codec = make_codec(PARALLEL_READ_BYTES)  # 8 x 256 KiB: four slices of two pages
    keys = make_keys(8)
    recs = make_records(codec, keys)
    assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 8
    bad = bytearray(recs[5])
    bad[HEADER_BYTES + 7] ^= 0x20

    def read(expect_fanned: int) -> list[str]:
        b.path_of(keys[5]).write_bytes(bytes(bad))  # a corrupt page, again (a miss deletes it)
        b.read_by.clear()
        out = buffers(8, codec.record_bytes)
        assert b.batch_get(keys, out) == [True] * 5 + [False] + [True] * 2
        for i, r in enumerate(recs):
            if i != 5:
                assert bytes(out[i]) == bytes(r)
        assert b.fanned_out_batches == expect_fanned
        return [b.read_by[k] for k in keys]

    # Nothing measured yet: taken as busy, so the caller reads alone; no wait meanwhile.
    assert read(expect_fanned=0) == ["MainThread"] * 8
    assert b._fan_out.busy == 0
    # A free core: fanned out. The caller then waited for a CPU (10 s per batch).
    clock.step = 10**10
    who = read(expect_fanned=1)
    assert who[:2] == ["MainThread"] * 2
    assert all(t.startswith("hicache-file-read") for t in who[2:])
    assert b._fan_out.busy > 1
    # Busy cores: the caller reads the whole batch; same records, same corrupt page caught.
    # That inline batch is measured too: with no wait, the next batch fans out again.
    clock.step = 0
    assert read(expect_fanned=1) == ["MainThread"] * 8
    assert b._fan_out.busy == 0
    who = read(expect_fanned=2)
    assert all(t.startswith("hicache-file-read") for t in who[2:])
    st = b.stats()
    assert (st.get_pages, st.get_hits, st.corrupt_pages, st.errors) == (32, 28, 4, 0)
    b.close()


def test_unverified_reads_take_the_same_paths(tmp_path: Path) -> None:
    clock = _RunQueueClock()
    b = _backend_with_clock(tmp_path, clock)
    codec = make_codec(PARALLEL_READ_BYTES)
    keys = make_keys(8)
    recs = make_records(codec, keys)
    assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 8
    b.path_of(keys[3]).unlink()
    b._fan_out.busy = 0.0
    clock.step = 10**10
    for fanned in (1, 1):  # fanned out, then inline
        out = buffers(8, codec.record_bytes)
        n = codec.record_bytes
        assert b._get_into(keys, out) == [n, n, n, -1, n, n, n, n]
        assert [bytes(o) for i, o in enumerate(out) if i != 3] == [
            bytes(r) for i, r in enumerate(recs) if i != 3
        ]
        assert b.fanned_out_batches == fanned
    b.close()


def test_unknown_run_queue_delay_always_fans_out() -> None:
    seen: list[tuple[int, int, str]] = []
    fan = ReadFanOut(2, wait_clock=lambda: None, window_ns=0)
    fan.busy = 1.0  # would read inline, if the delay were known
    out = buffers(4, PARALLEL_READ_BYTES)
    fan.run(lambda lo, hi: seen.append((lo, hi, threading.current_thread().name)), out)
    assert sorted(seen)[0] == (0, 2, "MainThread")
    assert sorted(seen)[1][:2] == (2, 4) and sorted(seen)[1][2].startswith("hicache-file-read")
    assert fan.fanned_out == 1
    fan.close()


def test_small_batches_and_one_thread_never_measure() -> None:
    calls: list[int] = []

    def clock() -> int:
        calls.append(1)
        return 0

    seen: list[tuple[int, int]] = []
    small = ReadFanOut(4, wait_clock=clock)
    small.run(lambda lo, hi: seen.append((lo, hi)), buffers(3, 1000))
    single = ReadFanOut(1, wait_clock=clock)
    single.run(lambda lo, hi: seen.append((lo, hi)), buffers(8, PARALLEL_READ_BYTES))
    assert seen == [(0, 3), (0, 8)]
    assert calls == []
    assert small.fanned_out == single.fanned_out == 0


# -- the run-queue clock ------------------------------------------------------------------------


def _read_schedstat() -> int:
    return int(SCHEDSTAT.read_bytes().split()[1])


def _child_reading(q: mp.Queue) -> None:  # type: ignore[type-arg]
    before = _read_schedstat()
    value = cpu_wait_ns()
    q.put((before, value, _read_schedstat(), file_io._tls.schedstat_pid == os.getpid()))


@pytest.mark.skipif(not SCHEDSTAT.exists(), reason="the kernel keeps no schedstat")
def test_cpu_wait_ns_is_this_threads_delay_also_after_a_fork() -> None:
    first = cpu_wait_ns()
    assert first is not None and first >= 0
    before = _read_schedstat()
    value = cpu_wait_ns()
    assert value is not None and first <= before <= value <= _read_schedstat()
    in_thread: list[int | None] = []
    t = threading.Thread(target=lambda: in_thread.append(cpu_wait_ns()))
    t.start()
    t.join()
    assert isinstance(in_thread[0], int)
    # A forked child reads its own (new) thread's delay, not the parent's file.
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_reading, args=(q,))
    p.start()
    lo, got, hi, reopened = q.get(timeout=60)
    p.join(timeout=60)
    assert lo <= got <= hi
    assert reopened
