"""`hf3fs` backend on a temporary directory standing in for the 3FS mount."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hicache_client.backend import StorageConfig
from hicache_client.errors import ConfigError
from storage_backends.hf3fs_backend import HF3FSBackend
from tests.storage_backends.conftest import NumberedPages, RecordsCheckerThreads
from tests.storage_backends.harness import config
from tests.storage_backends.harness_hf3fs import SLOT_BYTES, hf3fs_config

REPO = Path(__file__).resolve().parents[2]
PAGES = NumberedPages(1000)
CODEC, key, record, buffers = PAGES.codec, PAGES.key, PAGES.record, PAGES.buffers


def make(mount: Path, **extra: object) -> HF3FSBackend:
    return HF3FSBackend(config(hf3fs_config(mount, **extra)))


def test_roundtrip_exists_delete_clear(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        keys = [key(i) for i in range(5)]
        assert b.batch_set(keys, [memoryview(record(i)) for i in range(5)]) == [True] * 5
        PAGES.assert_first_stored(b, 5, missing=99)
        b.delete([key(1)])
        assert b.batch_exists(keys) == 1
        assert b.batch_get([key(1)], buffers(1)) == [False]
        s = b.stats()
        assert (s.stored_pages, s.deleted_pages, s.get_hits) == (4, 1, 5)
        b.clear()
        assert b.batch_exists(keys) == 0
        assert b.stats().stored_pages == 0


def test_corrupt_record_is_a_counted_miss_and_deleted(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        bad = record(3)
        bad[-1] ^= 0xFF
        assert b.batch_set([key(3)], [memoryview(bad)]) == [True]
        assert b.batch_get([key(3)], buffers(1)) == [False]
        assert b.stats().corrupt_pages == 1
        assert b.batch_exists([key(3)]) == 0


class _WhoChecks(RecordsCheckerThreads, HF3FSBackend):
    pass


def test_records_are_checked_by_the_io_threads_that_read_them(tmp_path: Path) -> None:
    with _WhoChecks(config(hf3fs_config(tmp_path, numjobs=4))) as b:
        keys = [key(i) for i in range(6)]
        recs = [record(i) for i in range(6)]
        recs[4][-1] ^= 0x01
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 6
        out = buffers(6)
        assert b.batch_get(keys, out) == [True] * 4 + [False, True]
        assert [bytes(o) for i, o in enumerate(out) if i != 4] == [
            bytes(r) for i, r in enumerate(recs) if i != 4]
        assert sorted(b.checked_by) == keys
        assert all(t.startswith("hf3fs-io") for t in b.checked_by.values())
        st = b.stats()
        assert (st.get_hits, st.corrupt_pages, st.stored_pages) == (5, 1, 5)


def test_oversized_record_is_refused(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        assert b.batch_set([key(1)], [memoryview(bytearray(SLOT_BYTES + 1))]) == [False]
        assert b.stats().set_failures == 1


def test_lru_eviction_when_the_file_is_full(tmp_path: Path) -> None:
    with make(tmp_path, file_size=4 * SLOT_BYTES) as b:
        assert b.batch_set([key(i) for i in range(4)],
                           [memoryview(record(i)) for i in range(4)]) == [True] * 4
        assert b.batch_get([key(0)], buffers(1)) == [True]  # 0 is now the most recent
        assert b.batch_set([key(4), key(5)], [memoryview(record(4)), memoryview(record(5))]) \
            == [True, True]
        present = [i for i in range(6) if b.batch_exists([key(i)]) == 1]
        assert present == [0, 3, 4, 5]
        assert b.stats().evicted_pages == 2
        out = buffers(4)
        assert b.batch_get([key(i) for i in present], out) == [True] * 4
        assert [bytes(o) for o in out] == [bytes(record(i)) for i in present]


def test_restart_keeps_pages(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        b.batch_set([key(i) for i in range(3)], [memoryview(record(i)) for i in range(3)])
    with make(tmp_path) as b2:
        out = buffers(3)
        assert b2.batch_get([key(i) for i in range(3)], out) == [True] * 3
        assert [bytes(o) for o in out] == [bytes(record(i)) for i in range(3)]
        assert b2.stats().stored_pages == 3


def test_dead_writer_slots_are_reclaimed(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        conn = b._db()
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        conn.execute("INSERT INTO pending VALUES (?, 0, ?, ?)",
                     (b.file, b._host, int(dead.stdout)))
        conn.execute("UPDATE files SET hwm = 1 WHERE file = ?", (b.file,))
    with make(tmp_path) as b2:
        rows = b2._db().execute("SELECT file, slot FROM free").fetchall()
        assert rows == [(b2.file, 0)]
        assert b2._db().execute("SELECT COUNT(*) FROM pending").fetchone() == (0,)


_WRITER = textwrap.dedent(
    """
    import json, sys
    from hicache_client.backend import StorageConfig
    from hicache_client.codec import PageCodec
    from storage_backends.hf3fs_backend import HF3FSBackend
    cfg, first, n = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    codec = PageCodec(namespace=b"\\0" * 32, dtype="uint8", shape=(1000,), layout="raw",
                      tokens_per_page=16, itemsize=1)
    b = HF3FSBackend(StorageConfig(extra=cfg, namespace="00" * 32))
    keys = [f"{i:064x}" for i in range(first, first + n)]
    for lo in range(0, n, 4):
        ks = keys[lo:lo + 4]
        recs = [memoryview(codec.encode(k, bytes([int(k, 16) % 251]) * 1000)) for k in ks]
        assert b.batch_set(ks, recs) == [True] * len(ks)
    b.close()
    print("ok")
    """
)


def test_two_processes_share_pages(tmp_path: Path) -> None:
    cfg = json.dumps(hf3fs_config(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, cfg, str(first), "24"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for first in (0, 24)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == "ok"
    with make(tmp_path) as b:
        keys = [key(i) for i in range(48)]
        assert b.batch_exists(keys) == 48
        out_bufs = buffers(48)
        assert b.batch_get(keys, out_bufs) == [True] * 48
        assert [bytes(o) for o in out_bufs] == [bytes(record(i)) for i in range(48)]
        assert b.stats().stored_pages == 48


def test_config_from_env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "hf3fs.json"
    path.write_text(json.dumps(hf3fs_config(tmp_path / "m", numjobs=3)))
    monkeypatch.setenv("HICACHE_HF3FS_CONFIG_PATH", str(path))
    with HF3FSBackend(StorageConfig(namespace="00" * 32)) as b:
        assert (b.numjobs, b.slot_bytes, b.root) == (3, SLOT_BYTES, tmp_path / "m" / "hicache")
    monkeypatch.delenv("HICACHE_HF3FS_CONFIG_PATH")
    with pytest.raises(ConfigError, match="mount_path"):
        HF3FSBackend(StorageConfig())
    with pytest.raises(ConfigError, match="unknown extra config"):
        HF3FSBackend(StorageConfig(extra={"mount_path": str(tmp_path), "bogus": 1}))


def test_usrbio_is_not_importable_here(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        assert b._usrbio is None  # POSIX fallback on this machine
    with pytest.raises(ConfigError, match="usrbio"):
        make(tmp_path, use_usrbio=True)


def test_setting_a_key_with_another_length_replaces_it(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        assert b.batch_set([key(1)], [memoryview(bytearray(500))]) == [True]
        assert b.batch_set([key(1)], [memoryview(record(1))]) == [True]
        out = buffers(1)
        assert b.batch_get([key(1)], out) == [True]
        assert bytes(out[0]) == bytes(record(1))
        assert b.stats().stored_pages == 1
        # The old slot was freed and taken again: one slot used in all.
        assert b._db().execute("SELECT hwm FROM files").fetchone() == (1,)


def test_slot_rewritten_by_another_process_during_a_read_is_a_plain_miss(tmp_path: Path) -> None:
    with make(tmp_path, file_size=SLOT_BYTES) as a, make(tmp_path, file_size=SLOT_BYTES) as other:
        assert a.batch_set([key(1)], [memoryview(record(1))]) == [True]
        real_io = a._io

        def racing_io(ios: list, read: bool, then: Any = None) -> list[int]:
            if read:  # between a's index look-up and its read, the only slot changes hands
                assert other.batch_set([key(2)], [memoryview(record(2))]) == [True]
            return real_io(ios, read, then)

        a._io = racing_io  # type: ignore[method-assign]
        assert a.batch_get([key(1)], buffers(1)) == [False]
        a._io = real_io  # type: ignore[method-assign]
        assert a.stats().corrupt_pages == 0  # a miss, not a corrupt page
        assert other.stats().evicted_pages == 1
        out = buffers(1)
        assert a.batch_get([key(2)], out) == [True]
        assert bytes(out[0]) == bytes(record(2))
