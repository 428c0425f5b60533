"""`file` backend specifics: layout, restart, byte cap + LRU, on-disk corruption, crash debris,
write failures (that really fail for root), several processes on one directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from hicache_client.backend import StorageConfig
from hicache_client.codec import HEADER_BYTES
from hicache_client.errors import ConfigError
from storage_backends.file_backend import FileBackend, default_dir, page_name
from storage_backends.file_io import PARALLEL_READ_BYTES, default_read_threads
from tests.storage_backends.conftest import NAMESPACE, buffers, make_codec, make_keys, make_records

REPO = Path(__file__).resolve().parents[2]


def fb(root: Path, **extra: object) -> FileBackend:
    return FileBackend(StorageConfig(extra={"path": str(root), **extra},
                                     namespace=NAMESPACE.hex()))


def views(recs: list[bytearray]) -> list[memoryview]:
    return [memoryview(r) for r in recs]


def page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*/*") if not p.name.startswith("."))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*/.*.tmp"))


def present(b: FileBackend, keys: list[str]) -> list[bool]:
    return [b.batch_exists([k]) == 1 for k in keys]


# -- layout and config -------------------------------------------------------------------------


def test_sharded_layout(tmp_path: Path) -> None:
    b = fb(tmp_path)
    codec = make_codec(100)
    keys = make_keys(3)
    assert b.batch_set(keys, views(make_records(codec, keys))) == [True] * 3
    for k in keys:
        assert b.path_of(k) == tmp_path / k[0:2] / k[2:4] / k
        assert b.path_of(k).stat().st_size == codec.record_bytes
    assert page_files(tmp_path) == sorted(b.path_of(k) for k in keys)
    assert temp_files(tmp_path) == []
    # A key that is not lower-case hex is stored under a hashed name.
    odd = "Some/Key with spaces"
    assert page_name(odd).startswith("x") and len(page_name(odd)) == 65
    rec = make_records(codec, [odd])[0]
    assert b.batch_set([odd], [memoryview(rec)]) == [True]
    assert b.path_of(odd).parent.parent.parent == tmp_path
    out = buffers(1, codec.record_bytes)
    assert b.batch_get([odd], out) == [True]
    assert bytes(out[0]) == bytes(rec)


def test_directory_from_env_and_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_FILE_BACKEND_DIR", str(tmp_path / "from-env"))
    assert FileBackend(StorageConfig()).root == tmp_path / "from-env"
    monkeypatch.delenv("HICACHE_FILE_BACKEND_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_dir() == tmp_path / "xdg" / "hicache" / "pages"
    assert FileBackend(StorageConfig()).root == tmp_path / "xdg" / "hicache" / "pages"
    assert (tmp_path / "xdg" / "hicache" / "pages").is_dir()
    # The extra config wins over the env var.
    monkeypatch.setenv("HICACHE_FILE_BACKEND_DIR", str(tmp_path / "from-env"))
    assert fb(tmp_path / "explicit").root == tmp_path / "explicit"


def test_bad_config_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fsync"):
        fb(tmp_path, fsync="sometimes")
    with pytest.raises(ConfigError, match="unknown extra config"):
        fb(tmp_path, capacity=10)
    with pytest.raises(ConfigError, match="capacity_bytes"):
        fb(tmp_path, capacity_bytes=-1)
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a directory"):
        fb(tmp_path / "afile")


@pytest.mark.parametrize("fsync", ["none", "data", "always"])
def test_fsync_policies_round_trip(tmp_path: Path, fsync: str) -> None:
    b = fb(tmp_path, fsync=fsync)
    codec = make_codec(10000)
    keys = make_keys(2)
    recs = make_records(codec, keys)
    assert b.batch_set(keys, views(recs)) == [True, True]
    out = buffers(2, codec.record_bytes)
    assert b.batch_get(keys, out) == [True, True]
    assert [bytes(o) for o in out] == [bytes(r) for r in recs]


def _fs_takes_o_direct(d: Path) -> bool:
    probe = d / ".probe"
    probe.write_bytes(b"x")
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


def _aligned_views(n_records: int, record_bytes: int) -> list[memoryview]:
    """Views of `record_bytes` each, the first at a 4 KiB-aligned address, back to back."""
    block = torch.zeros(n_records * record_bytes + 4096, dtype=torch.uint8)
    base = (-block.data_ptr()) % 4096
    mv = memoryview(block.numpy())
    return [mv[base + i * record_bytes : base + (i + 1) * record_bytes] for i in range(n_records)]


@pytest.mark.parametrize("payload", [4 * 4096 - HEADER_BYTES, 5000])
def test_o_direct_aligned_or_fallback(tmp_path: Path, payload: int) -> None:
    b = fb(tmp_path, o_direct=True)
    codec = make_codec(payload)
    keys = make_keys(2, salt=payload)
    recs = make_records(codec, keys)
    # Records in 4 KiB-aligned host memory (the case O_DIRECT can take).
    n = codec.record_bytes
    src_views = [_aligned_views(1, n)[0] for _ in range(2)]
    for v, r in zip(src_views, recs):
        v[:] = r
    assert b.batch_set(keys, src_views) == [True, True]
    assert b.path_of(keys[0]).read_bytes() == bytes(recs[0])
    out = [_aligned_views(1, n)[0] for _ in range(2)]  # each read buffer aligned
    assert b.batch_get(keys, out) == [True, True]
    assert [bytes(o) for o in out] == [bytes(r) for r in recs]
    assert b.stats().errors == 0
    assert [b.path_of(k).stat().st_size for k in keys] == [n, n]
    if _fs_takes_o_direct(tmp_path):
        # Whole blocks straight from / into the buffers; a partial last block (payload 5000)
        # through a bounce buffer (the write's padding cut off again).
        assert (b.o_direct, b.direct_writes, b.direct_reads) == (True, 2, 2)
    else:
        assert (b.o_direct, b.direct_writes, b.direct_reads) == (False, 0, 0)


def test_o_direct_unaligned_buffers_use_buffered_io(tmp_path: Path) -> None:
    b = fb(tmp_path, o_direct=True)
    codec = make_codec(3 * 4096)
    keys = make_keys(2)
    recs = make_records(codec, keys)
    src = [v[1:] for v in _aligned_views(2, codec.record_bytes + 1)]  # never 4 KiB-aligned
    for v, r in zip(src, recs):
        v[:] = r
    assert b.batch_set(keys, src) == [True, True]
    out = [v[1:] for v in _aligned_views(2, codec.record_bytes + 1)]
    assert b.batch_get(keys, out) == [True, True]
    assert [bytes(o) for o in out] == [bytes(r) for r in recs]
    assert (b.direct_writes, b.direct_reads, b.stats().errors) == (0, 0, 0)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs a tmpfs at /dev/shm")
def test_o_direct_refused_by_the_file_system_falls_back(tmp_path: Path) -> None:
    """tmpfs refuses O_DIRECT (EINVAL at open): the backend switches to buffered I/O once."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        if _fs_takes_o_direct(Path(d)):
            pytest.skip("this /dev/shm takes O_DIRECT")
        b = fb(Path(d), o_direct=True)
        codec = make_codec(4 * 4096 - HEADER_BYTES)
        keys = make_keys(3)
        recs = make_records(codec, keys)
        src = _aligned_views(3, codec.record_bytes)
        for v, r in zip(src, recs):
            v[:] = r
        assert b.batch_set(keys, src) == [True] * 3
        out = _aligned_views(3, codec.record_bytes)
        assert b.batch_get(keys, out) == [True] * 3
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
        assert (b.o_direct, b.direct_writes, b.direct_reads, b.stats().errors) == (
            False, 0, 0, 0)


class _WhoReads(FileBackend):
    """Records which thread read and which thread checked each page."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.read_by: dict[str, str] = {}
        self.checked_by: dict[str, str] = {}

    def _read(self, path: str, dst: memoryview) -> int:
        self.read_by[Path(path).name] = threading.current_thread().name
        return super()._read(path, dst)

    def check_record(self, key: str, length: int, buf: memoryview) -> str | None:
        self.checked_by[key] = threading.current_thread().name
        return super().check_record(key, length, buf)


def test_batch_reads_run_in_parallel_into_caller_buffers(tmp_path: Path) -> None:
    b = _WhoReads(StorageConfig(extra={"path": str(tmp_path), "read_threads": 4,
                                       "fan_out": "always"}, namespace=NAMESPACE.hex()))
    codec = make_codec(PARALLEL_READ_BYTES)  # 8 x 256 KiB: four slices of two pages
    keys = make_keys(8)
    recs = make_records(codec, keys)
    assert b.batch_set(keys, views(recs)) == [True] * 8
    bad = b.path_of(keys[5])
    data = bytearray(bad.read_bytes())
    data[HEADER_BYTES + 7] ^= 0x20
    bad.write_bytes(bytes(data))
    pool = torch.zeros((10, codec.record_bytes), dtype=torch.uint8)
    slots = [9, 0, 4, 2, 7, 1, 3, 8]
    out = [memoryview(pool[s].numpy()) for s in slots]
    assert b.batch_get(keys, out) == [True] * 5 + [False] + [True] * 2
    for i, (s, r) in enumerate(zip(slots, recs)):
        if i != 5:
            assert pool[s].numpy().tobytes() == bytes(r)
    assert int(pool[5].sum()) == int(pool[6].sum()) == 0  # slots nobody read into
    # Four slices of two pages: the caller reads the first, pool threads the others; each
    # page is checked by the thread that read it, right after reading it.
    assert [b.read_by[k] for k in keys[:2]] == ["MainThread"] * 2
    assert all(b.read_by[k].startswith("hicache-file-read") for k in keys[2:])
    assert b.checked_by == b.read_by
    st = b.stats()
    assert (st.get_pages, st.get_hits, st.corrupt_pages, st.errors) == (8, 7, 1, 0)
    assert not bad.exists()  # the corrupt page was deleted
    b.close()


def test_small_batches_are_read_by_the_caller(tmp_path: Path) -> None:
    b = _WhoReads(StorageConfig(extra={"path": str(tmp_path), "read_threads": 4,
                                       "fan_out": "always"}, namespace=NAMESPACE.hex()))
    codec = make_codec(PARALLEL_READ_BYTES // 4)  # 8 records: two slices' worth of bytes
    keys = make_keys(8)
    assert b.batch_set(keys, views(make_records(codec, keys))) == [True] * 8
    assert b.batch_get(keys, buffers(8, codec.record_bytes)) == [True] * 8
    assert [b.read_by[k] for k in keys[:4]] == ["MainThread"] * 4
    assert all(b.read_by[k].startswith("hicache-file-read") for k in keys[4:])
    # Three records are less than one slice's worth: all read (and checked) by the caller.
    assert b.batch_get(keys[5:], buffers(3, codec.record_bytes)) == [True] * 3
    assert [b.read_by[k] for k in keys[5:]] == ["MainThread"] * 3
    assert b.checked_by == b.read_by
    b.close()


def test_read_threads_config(tmp_path: Path) -> None:
    assert fb(tmp_path).read_threads == default_read_threads()
    assert default_read_threads() == max(1, min(4, len(os.sched_getaffinity(0))))
    assert fb(tmp_path, read_threads=1).read_threads == 1
    with pytest.raises(ConfigError, match="read_threads"):
        fb(tmp_path, read_threads=0)
    assert fb(tmp_path)._fan_out.auto
    assert not fb(tmp_path, fan_out="always")._fan_out.auto
    with pytest.raises(ConfigError, match="fan_out"):
        fb(tmp_path, fan_out="never")
    assert fb(tmp_path, capacity_bytes="2MiB").capacity_bytes == 2 << 20


def test_reads_into_a_torch_host_pool(tmp_path: Path) -> None:
    """readinto goes straight into (a slice of) a tensor's memory."""
    b = fb(tmp_path)
    codec = make_codec(3000)
    keys = make_keys(4)
    recs = make_records(codec, keys)
    assert b.batch_set(keys, views(recs)) == [True] * 4
    pool = torch.zeros((8, codec.record_bytes), dtype=torch.uint8)
    slots = [5, 1, 7, 2]
    out = [memoryview(pool[s].numpy()) for s in slots]
    assert b.batch_get(keys, out) == [True] * 4
    for s, r in zip(slots, recs):
        assert pool[s].numpy().tobytes() == bytes(r)
    assert int(pool[0].sum()) == 0


# -- restart, cap and LRU ------------------------------------------------------------------------


def test_restart_keeps_pages(tmp_path: Path) -> None:
    codec = make_codec(2000)
    keys = make_keys(5)
    recs = make_records(codec, keys)
    b = fb(tmp_path)
    assert b.batch_set(keys, views(recs)) == [True] * 5
    b.close()
    b2 = fb(tmp_path)
    st = b2.stats()
    assert (st.stored_pages, st.stored_bytes) == (5, 5 * codec.record_bytes)
    assert b2.batch_exists(keys) == 5
    out = buffers(5, codec.record_bytes)
    assert b2.batch_get(keys, out) == [True] * 5
    assert [bytes(o) for o in out] == [bytes(r) for r in recs]


def test_capacity_evicts_least_recently_used_pages(tmp_path: Path) -> None:
    codec = make_codec(1000)
    rb = codec.record_bytes
    keys = make_keys(6)
    recs = make_records(codec, keys)
    b = fb(tmp_path, capacity_bytes=3 * rb)
    assert b.batch_set(keys[:3], views(recs[:3])) == [True] * 3
    assert b.batch_get(keys[:1], buffers(1, rb)) == [True]  # k0 is now most recent
    assert b.batch_set(keys[3:4], views(recs[3:4])) == [True]  # evicts k1
    assert present(b, keys) == [True, False, True, True, False, False]
    assert not b.path_of(keys[1]).exists()
    assert b.batch_set(keys[4:5], views(recs[4:5])) == [True]  # evicts k2
    assert present(b, keys) == [True, False, False, True, True, False]
    assert b.batch_set(keys[3:4], views(recs[3:4])) == [True]  # overwrite: k3 most recent
    assert b.batch_set(keys[5:6], views(recs[5:6])) == [True]  # evicts k0
    assert present(b, keys) == [False, False, False, True, True, True]
    st = b.stats()
    assert (st.evicted_pages, st.stored_pages, st.stored_bytes) == (3, 3, 3 * rb)
    assert len(page_files(tmp_path)) == 3
    # A record larger than the whole cap is refused, nothing else is evicted for it.
    big = make_codec(4 * rb)
    bk = make_keys(1, salt=9)
    assert b.batch_set(bk, views(make_records(big, bk))) == [False]
    assert b.stats().set_failures == 1
    assert present(b, keys) == [False, False, False, True, True, True]


def test_restart_lru_order_follows_mtime(tmp_path: Path) -> None:
    codec = make_codec(500)
    rb = codec.record_bytes
    keys = make_keys(4)
    recs = make_records(codec, keys)
    b = fb(tmp_path)
    assert b.batch_set(keys[:3], views(recs[:3])) == [True] * 3
    for k, t in zip(keys[:3], (2_000_000, 1_000_000, 3_000_000)):  # k1 oldest, then k0
        os.utime(b.path_of(k), (t, t))
    b2 = fb(tmp_path, capacity_bytes=3 * rb)
    assert b2.batch_set(keys[3:], views(recs[3:])) == [True]
    assert present(b2, keys) == [True, False, True, True]
    assert b2.batch_set(make_keys(1, salt=5), views(make_records(codec, make_keys(1, salt=5)))) \
        == [True]
    assert present(b2, keys) == [False, False, True, True]


def test_scan_removes_pages_over_capacity_lazily(tmp_path: Path) -> None:
    """A restart with a smaller cap keeps pages until the next write needs room."""
    codec = make_codec(500)
    rb = codec.record_bytes
    keys = make_keys(4)
    b = fb(tmp_path)
    assert b.batch_set(keys[:3], views(make_records(codec, keys[:3]))) == [True] * 3
    b2 = fb(tmp_path, capacity_bytes=2 * rb)
    assert b2.stats().stored_pages == 3
    assert b2.batch_set(keys[3:], views(make_records(codec, keys[3:]))) == [True]
    st = b2.stats()
    assert (st.stored_pages, st.evicted_pages) == (2, 2)
    assert len(page_files(tmp_path)) == 2


# -- corruption and crash debris -----------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "bit-flip", "misplaced", "empty", "extended"])
def test_damaged_file_is_a_counted_miss_and_deleted(tmp_path: Path, damage: str) -> None:
    codec = make_codec(4000)
    keys = make_keys(3)
    recs = make_records(codec, keys)
    b = fb(tmp_path)
    assert b.batch_set(keys, views(recs)) == [True] * 3
    victim = b.path_of(keys[0])
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(data[:-10])
    elif damage == "bit-flip":
        data[HEADER_BYTES + 17] ^= 0x04
        victim.write_bytes(data)
    elif damage == "misplaced":
        os.replace(b.path_of(keys[2]), victim)  # another key's valid record, renamed in place
    elif damage == "extended":
        victim.write_bytes(data + b"tail")  # a valid record and then some
    else:
        victim.write_bytes(b"")
    out = buffers(2, codec.record_bytes)
    assert b.batch_get(keys[:2], out) == [False, True]
    st = b.stats()
    assert (st.corrupt_pages, st.get_hits, st.errors) == (1, 1, 0)
    assert not victim.exists()
    assert b.batch_exists(keys) == 0
    assert b.batch_exists(keys[1:2]) == 1


def test_stale_temp_files_are_ignored_and_cleaned(tmp_path: Path) -> None:
    codec = make_codec(300)
    keys = make_keys(2)
    b = fb(tmp_path)
    assert b.batch_set(keys[:1], views(make_records(codec, keys[:1]))) == [True]
    shard = b.path_of(keys[1]).parent
    shard.mkdir(parents=True, exist_ok=True)
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    name = page_name(keys[1])
    crashed = shard / f".{name}.{b._host}.{dead_pid.pid}.0.tmp"  # writer died mid-write
    crashed.write_bytes(b"half a record")
    old_foreign = shard / f".{name}.otherhost.123.0.tmp"  # another host, long ago
    old_foreign.write_bytes(b"old")
    os.utime(old_foreign, (1_000_000, 1_000_000))
    live_foreign = shard / f".{name}.otherhost.456.1.tmp"  # another host, writing right now
    live_foreign.write_bytes(b"in flight")
    # The temp files are never pages.
    assert b.batch_exists(keys) == 1
    assert b.batch_get(keys[1:], buffers(1, codec.record_bytes)) == [False]
    b2 = fb(tmp_path)
    assert not crashed.exists()
    assert not old_foreign.exists()
    assert live_foreign.exists()
    assert b2.stats().stored_pages == 1
    assert b2.batch_exists(keys) == 1
    b2.clear()  # clear removes pages, not another writer's temp file
    assert live_foreign.exists()
    assert page_files(tmp_path) == []


# -- write failures that fail for root too ---------------------------------------------------


def test_unwritable_shard_fails_that_write_only(tmp_path: Path) -> None:
    """A regular file where a shard directory should be: mkdir fails (ENOTDIR/EEXIST), even
    for root. Only that page fails; the batch goes on; nothing is left behind."""
    codec = make_codec(700)
    keys = make_keys(4)
    recs = make_records(codec, keys)
    b = fb(tmp_path)
    blocker = tmp_path / keys[1][0:2]
    if any(k[0:2] == keys[1][0:2] for k in keys if k != keys[1]):
        pytest.skip("test keys share a shard")
    blocker.write_bytes(b"not a directory")
    assert b.batch_set(keys, views(recs)) == [True, False, True, True]
    st = b.stats()
    assert (st.set_pages, st.set_failures, st.errors) == (4, 1, 1)
    assert st.bytes_written == 3 * codec.record_bytes
    assert st.stored_pages == 3
    assert b.batch_exists(keys) == 1
    assert b.batch_get(keys, buffers(4, codec.record_bytes)) == [True, False, True, True]
    assert temp_files(tmp_path) == []
    blocker.unlink()  # the fault goes away: writes work again
    assert b.batch_set(keys[1:2], views(recs[1:2])) == [True]
    assert b.batch_exists(keys) == 4


def test_unwritable_root_fails_writes_cleanly(tmp_path: Path) -> None:
    """/proc refuses mkdir to everyone, root included: the backend starts, every write is a
    counted failure, reads are misses."""
    b = fb(Path("/proc/hicache-no-such-dir"))
    codec = make_codec(100)
    keys = make_keys(2)
    assert b.batch_set(keys, views(make_records(codec, keys))) == [False, False]
    st = b.stats()
    assert (st.set_failures, st.errors) == (2, 2)
    assert b.batch_exists(keys) == 0
    assert b.batch_get(keys, buffers(2, codec.record_bytes)) == [False, False]


_RUN = textwrap.dedent(
    """
    import json, resource, signal, sys
    sys.path.insert(0, {repo!r})
    from hicache_client.backend import StorageConfig
    from tests.storage_backends.conftest import make_codec, make_keys, make_records
    from storage_backends.file_backend import FileBackend
    {prelude}
    b = FileBackend(StorageConfig(extra={{"path": {root!r}}}, namespace="00" * 32))
    small, big = make_codec(60000), make_codec(1 << 20)
    keys = make_keys(3, salt={salt})
    recs = [make_records(small, keys[:1])[0], make_records(big, keys[1:2])[0],
            make_records(small, keys[2:])[0]]
    {body}
    """
)


def _python(root: Path, body: str, prelude: str = "", salt: int = 0) -> dict:
    code = _RUN.format(repo=str(REPO), root=str(root), prelude=prelude, body=body, salt=salt)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_file_size_limit_fails_the_write_cleanly(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (applies to root) makes a large write fail half-way with EFBIG, like a
    full disk: that page is a counted failure, its temp file is gone, the others are stored."""
    res = _python(
        tmp_path,
        prelude="signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (200000, 200000))",
        body="ok = b.batch_set(keys, [memoryview(r) for r in recs]); "
        "print(json.dumps({'ok': ok, 'keys': keys, 'stats': b.stats().as_dict()}))",
    )
    assert res["ok"] == [True, False, True]
    assert res["stats"]["set_failures"] == 1
    assert res["stats"]["errors"] == 1
    assert res["stats"]["stored_pages"] == 2
    assert temp_files(tmp_path) == []
    b = fb(tmp_path)
    assert [b.batch_exists([k]) for k in res["keys"]] == [1, 0, 1]


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    reader = fb(tmp_path)  # started before the writer wrote anything
    assert reader.stats().stored_pages == 0
    res = _python(
        tmp_path,
        body="ok = b.batch_set(keys, [memoryview(r) for r in recs]); "
        "print(json.dumps({'ok': ok, 'keys': keys}))",
        salt=3,
    )
    assert res["ok"] == [True, True, True]
    keys = res["keys"]
    # Another process reads them back bit-identical.
    check = _python(
        tmp_path,
        body="out = [bytearray(len(r)) for r in recs]; "
        "got = b.batch_get(keys, [memoryview(o) for o in out]); "
        "print(json.dumps({'got': got, 'same': [bytes(o) == bytes(r) for o, r in "
        "zip(out, recs)], 'n': b.batch_exists(keys)}))",
        salt=3,
    )
    assert check == {"got": [True, True, True], "same": [True, True, True], "n": 3}
    # This process's object, whose index knew none of them, finds them too.
    small = make_codec(60000)
    assert reader.batch_exists(keys) == 3
    out = buffers(1, small.record_bytes)
    assert reader.batch_get(keys[:1], out) == [True]
    assert reader.stats().stored_pages == 3
    # A page deleted by another process is a plain miss here, not an error.
    _python(tmp_path, body="b.delete(keys[:1]); print('{}')", salt=3)
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get(keys[:1], buffers(1, small.record_bytes)) == [False]
    st = reader.stats()
    assert (st.errors, st.corrupt_pages) == (0, 0)
    assert st.stored_pages == 2
