"""The shared pieces under every backend: the batch_get / batch_set template methods of
`StorageBackend`, `LRUByteStore`, the one size parser, the backend registry's import graph."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

import pytest

from hicache.lru import LRUByteStore
from hicache.memory_backend import MemoryBackend
from hicache_client.backend import (
    OFFLOAD_CHECK_BYTES,
    Checked,
    RecordChecker,
    StorageBackend,
    StorageConfig,
)
from hicache_client.codec import HEADER_BYTES
from hicache_client.errors import ConfigError
from hicache_client.units import Size, kv_bytes_per_token, parse_bytes, parse_size
from tests.storage_backends.conftest import (
    NAMESPACE,
    RecordsCheckerThreads,
    buffers,
    make_codec,
    make_keys,
    make_records,
)

REPO = Path(__file__).resolve().parents[2]


class _DictBackend(StorageBackend):
    """The smallest backend: a dict, through `_get_into` and `_set_from` only."""

    name = "dict"

    def __init__(self, config: StorageConfig, refuse: Sequence[str] = ()) -> None:
        super().__init__(config)
        self.data: dict[str, bytes] = {}
        self.refuse = set(refuse)
        self.set_calls = 0

    def batch_exists(self, keys: Sequence[str]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.data), len(keys))

    def _get_into(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[int]:
        res = []
        for k, o in zip(keys, out):
            v = self.data.get(k)
            if v is not None and len(v) == len(o):
                o[:] = v
            res.append(-1 if v is None else len(v))
        return res

    def _set_from(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        self.set_calls += 1
        for k, v in zip(keys, values):
            if k not in self.refuse:
                self.data[k] = bytes(v)
        return [k not in self.refuse for k in keys]

    def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.data.pop(k, None)

    def clear(self) -> None:
        self.data.clear()


class _OwnBatchSet(_DictBackend):
    """A backend that still overrides batch_set itself (as hicache_backend does)."""

    _set_from = StorageBackend._set_from  # type: ignore[assignment]

    def batch_set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        self.set_calls += 1
        for k, v in zip(keys, values):
            self.data[k] = bytes(v)
        self._count(set_pages=len(keys))
        return [True] * len(keys)


def _config() -> StorageConfig:
    return StorageConfig(namespace=NAMESPACE.hex())


def test_batch_set_template_checks_and_counts() -> None:
    codec = make_codec(100)
    keys = make_keys(3)
    recs = [memoryview(r) for r in make_records(codec, keys)]
    b = _DictBackend(_config(), refuse=[keys[1]])
    with pytest.raises(ValueError, match="3 keys but 2 values"):
        b.batch_set(keys, recs[:2])
    assert b.batch_set([], []) == []
    assert b.set_calls == 0  # neither call reached the backend
    assert b.batch_set(keys, recs) == [True, False, True]
    st = b.stats()
    assert (st.set_pages, st.set_failures, st.bytes_written) == (3, 1, 2 * codec.record_bytes)


def test_backend_overriding_batch_set_still_works() -> None:
    b = _OwnBatchSet(_config())
    codec = make_codec(10)
    keys = make_keys(2)
    assert b.batch_set(keys, [memoryview(r) for r in make_records(codec, keys)]) == [True, True]
    assert (b.set_calls, b.stats().set_pages, b.stats().set_failures) == (1, 2, 0)
    out = buffers(2, codec.record_bytes)
    assert b.batch_get(keys, out) == [True, True]


def test_backend_without_a_set_path_is_refused() -> None:
    class NoSet(_DictBackend):
        _set_from = StorageBackend._set_from  # type: ignore[assignment]

    with pytest.raises(TypeError, match="neither _set_from nor batch_set"):
        NoSet(_config())


def test_batch_get_template_checks_its_arguments() -> None:
    codec = make_codec(100)
    keys = make_keys(3)
    b = _DictBackend(_config())
    assert b.batch_set(keys, [memoryview(r) for r in make_records(codec, keys)]) == [True] * 3
    with pytest.raises(ValueError, match="3 keys but 2 buffers"):
        b.batch_get(keys, buffers(2, codec.record_bytes))
    assert b.batch_get([], []) == []
    assert b.stats().get_pages == 0  # neither call was counted


def test_batch_get_counts_corrupt_pages_once() -> None:
    codec = make_codec(64)
    keys = make_keys(4)
    recs = make_records(codec, keys)
    b = _DictBackend(_config())
    assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 4
    bad = bytearray(recs[1])
    bad[-1] ^= 1
    b.data[keys[1]] = bytes(bad)  # payload bit flip
    b.data[keys[2]] = bytes(recs[2][:-1])  # truncated
    del b.data[keys[3]]  # missing: a miss, not corrupt
    out = buffers(4, codec.record_bytes)
    assert b.batch_get(keys, out) == [True, False, False, False]
    st = b.stats()
    assert (st.get_pages, st.get_hits, st.corrupt_pages) == (4, 1, 2)
    assert st.bytes_read == codec.record_bytes
    assert sorted(b.data) == [keys[0]]  # both corrupt records deleted
    b.report_corrupt([keys[0]])  # a caller's finding (e.g. another page format) adds to it
    assert b.stats().corrupt_pages == 3 and b.data == {}


def test_lru_byte_store() -> None:
    s: LRUByteStore[bytes] = LRUByteStore(10)
    assert s.put("a", b"1234") == [] and s.put("b", b"123") == []
    assert s.get("a") == b"1234"  # a is now the most recent
    assert s.put("c", b"12345") == [("b", b"123")]
    assert (list(s), s.nbytes, len(s)) == (["a", "c"], 9, 2)
    assert s.put("big", b"x" * 11) is None and "big" not in s
    assert s.put("a", b"1") == [] and s.nbytes == 6  # replaced, not added
    assert s.get("c", touch=False) == b"12345" and list(s) == ["c", "a"]
    assert s.pop("c") == b"12345" and s.pop("c") is None and s.nbytes == 1
    s["d"] = b"22"
    assert s["d"] == b"22" and list(s) == ["a", "d"]
    with pytest.raises(ValueError):
        s["e"] = b"x" * 11
    s.clear()
    assert (len(s), s.nbytes) == (0, 0)
    unbounded: LRUByteStore[bytes] = LRUByteStore()
    assert unbounded.put("x", b"y" * 10**6) == []


def test_memory_backend_capacity_as_a_size() -> None:
    b = MemoryBackend(StorageConfig(extra={"capacity_bytes": "1KiB"}))
    codec = make_codec(300)  # 428-byte records: two fit in 1024
    keys = make_keys(3)
    assert b.batch_set(keys, [memoryview(r) for r in make_records(codec, keys)]) == [True] * 3
    st = b.stats()
    assert (st.stored_pages, st.stored_bytes, st.evicted_pages) == (2, 856, 1)
    assert b.batch_exists(keys[1:]) == 2 and b.batch_exists(keys) == 0


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("64KiB", 65536),
        ("512MiB", 512 << 20),
        ("8GiB", 8 << 30),
        ("8G", 8 << 30),
        ("8GB", 8 * 10**9),
        ("1.5KiB", 1536),
        (" 2 mib ", 2 << 20),
        ("1TiB", 1 << 40),
    ],
)
def test_parse_bytes(text: str | int, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1.5", "-1", "4096p", "2k tokens", "5XB", True])
def test_parse_bytes_rejects(text: object) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        parse_bytes(text, what="capacity")  # type: ignore[arg-type]


def test_parse_size_units() -> None:
    assert parse_size("64p") == Size("pages", 64)
    assert parse_size("64 pages") == Size("pages", 64)
    assert parse_size("4096 tokens") == Size("tokens", 4096)
    assert parse_size("2k", bare="tokens") == Size("tokens", 2000)
    assert parse_size("2M", bare="tokens") == Size("tokens", 2 * 10**6)
    assert parse_size("2M") == Size("bytes", 2 << 20)
    assert parse_size("2GiB", bare="tokens") == Size("bytes", 2 << 30)
    assert parse_size("500MB", bare="tokens") == Size("bytes", 500 * 10**6)
    with pytest.raises(ConfigError):
        parse_size("2k", bare="pages")


def test_kv_bytes_per_token() -> None:
    # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16: 128 KiB a token.
    assert kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024


def _imports(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return mods


class _WhoChecks(RecordsCheckerThreads, _DictBackend):
    pass


def test_default_get_checks_large_records_on_check_threads() -> None:
    b = _WhoChecks(_config())
    big, small = make_codec(OFFLOAD_CHECK_BYTES), make_codec(1000)
    keys = make_keys(6)
    recs = make_records(big, keys[:4]) + make_records(small, keys[4:])
    assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 6
    bad = bytearray(recs[2])
    bad[HEADER_BYTES + 12345] ^= 0x08  # a payload bit of a record checked off-thread
    b.data[keys[2]] = bytes(bad)
    out = buffers(4, big.record_bytes) + buffers(2, small.record_bytes)
    assert b.batch_get(keys, out) == [True, True, False, True, True, True]
    assert [bytes(o) for i, o in enumerate(out) if i != 2] == [
        bytes(r) for i, r in enumerate(recs) if i != 2]
    assert all(b.checked_by[k].startswith("hicache-check") for k in keys[:4])
    assert [b.checked_by[k] for k in keys[4:]] == ["MainThread"] * 2
    st = b.stats()
    assert (st.get_hits, st.corrupt_pages) == (5, 1) and keys[2] not in b.data


def test_record_checker_without_offload_checks_in_the_calling_thread() -> None:
    b = _WhoChecks(_config())
    big = make_codec(OFFLOAD_CHECK_BYTES)
    keys = make_keys(3)
    recs = make_records(big, keys)
    bad = bytearray(recs[1])
    bad[HEADER_BYTES + 4321] ^= 0x01
    c = RecordChecker(b, 3, offload=False)
    for i, (k, r) in enumerate(zip(keys, [recs[0], bad, recs[2]])):
        c.add(i, k, len(r), memoryview(r))
        assert b.checked_by[k] == "MainThread"  # checked at once, before the next add
    res = c.results()
    assert [r.problem is None for r in res] == [True, False, True]
    assert "checksum" in (res[1].problem or "")


def test_record_checker_reports_absent_and_wrong_length() -> None:
    b = _DictBackend(_config())
    codec = make_codec(OFFLOAD_CHECK_BYTES)
    rec = make_records(codec, make_keys(1))[0]
    buf = memoryview(bytearray(rec))
    c = RecordChecker(b, 3)
    c.add(0, make_keys(1)[0], len(rec), buf)
    c.add(2, "k", len(rec) + 5, buf)  # the store holds a longer record: corrupt, not a hit
    res = c.results()
    assert res[0] == Checked(len(rec), None)
    assert res[1] == Checked(-1, None)  # never added: absent
    assert res[2].length == len(rec) + 5 and "expected" in (res[2].problem or "")
