"""Fixtures of the storage tests: started harnesses (once per session), record factories."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import pytest

from hicache_client.backend import StorageBackend
from hicache_client.codec import PageCodec
from hicache_client.keys import key_str, page_keys
from tests.storage_backends.harness import BackendFactory, Harness

# The namespace of tests.storage_backends.harness.config() ("00" * 32).
NAMESPACE = bytes(32)
OTHER_NAMESPACE = b"\x01" * 32


def make_codec(payload_bytes: int, namespace: bytes = NAMESPACE) -> PageCodec:
    """A codec of raw uint8 pages of `payload_bytes` bytes."""
    return PageCodec(
        namespace=namespace,
        dtype="uint8",
        shape=(payload_bytes,),
        layout="raw",
        tokens_per_page=16,
        itemsize=1,
    )


def make_keys(n: int, salt: int = 0, page_size: int = 4) -> list[str]:
    """`n` chained 64-hex page keys (distinct for distinct `salt`)."""
    tokens = [(salt * 7919 + i) % 50000 for i in range(n * page_size)]
    return [key_str(d) for d in page_keys(tokens, page_size, NAMESPACE)]


def make_records(codec: PageCodec, keys: list[str], seed: int = 0) -> list[bytearray]:
    """One valid record per key with a payload that differs per key and per seed."""
    out: list[bytearray] = []
    for i, k in enumerate(keys):
        pattern = bytes(((seed * 31 + i * 7 + j) % 251) for j in range(251))
        reps = codec.payload_bytes // 251 + 1
        out.append(codec.encode(k, (pattern * reps)[: codec.payload_bytes]))
    return out


def make_pages(
    payload_bytes: int, n: int, salt: int = 0
) -> tuple[PageCodec, list[str], list[bytearray]]:
    """A codec of `payload_bytes`-byte pages, `n` keys (`salt` as in make_keys) and one valid
    record per key."""
    codec = make_codec(payload_bytes)
    keys = make_keys(n, salt=salt)
    return codec, keys, make_records(codec, keys)


def buffers(n: int, size: int) -> list[memoryview]:
    """`n` zeroed, writable views of `size` bytes carved out of one block (like a host pool)."""
    block = memoryview(bytearray(n * size + 64))[64:]
    return [block[i * size : (i + 1) * size] for i in range(n)]


def assert_all_miss(b: StorageBackend, codec: PageCodec, keys: list[str]) -> None:
    """`b.batch_get` finds none of `keys`."""
    assert b.batch_get(keys, buffers(len(keys), codec.record_bytes)) == [False] * len(keys)


def assert_reads_back(
    b: StorageBackend, codec: PageCodec, keys: list[str], recs: list[bytearray]
) -> None:
    """Every key of `keys` is a hit of `b.batch_get` and reads back exactly its record."""
    out = buffers(len(keys), codec.record_bytes)
    assert b.batch_get(keys, out) == [True] * len(keys)
    assert [bytes(o) for o in out] == [bytes(r) for r in recs]


class NumberedPages:
    """Pages numbered i: key `f"{i:064x}"`, a record whose `payload_bytes`-byte payload is the
    byte i % 251 repeated, and separately allocated buffers to read them into."""

    def __init__(self, payload_bytes: int) -> None:
        self.codec = make_codec(payload_bytes)

    @staticmethod
    def key(i: int) -> str:
        return f"{i:064x}"

    def record(self, i: int) -> bytearray:
        return self.codec.encode(self.key(i), bytes([i % 251]) * self.codec.payload_bytes)

    def buffers(self, n: int) -> list[memoryview]:
        return [memoryview(bytearray(self.codec.record_bytes)) for _ in range(n)]

    def assert_first_stored(self, b: StorageBackend, n: int, missing: int) -> None:
        """`b` holds pages 0..n-1 and not page `missing`: exists counts the leading run of a
        batch, get hits every held page (reading back its record) and misses `missing`."""
        keys = [self.key(i) for i in range(n)]
        assert b.batch_exists(keys + [self.key(missing)]) == n
        assert b.batch_exists([self.key(missing)] + keys) == 0
        out = self.buffers(n + 1)
        assert b.batch_get(keys + [self.key(missing)], out) == [True] * n + [False]
        assert [bytes(o) for o in out[:n]] == [bytes(self.record(i)) for i in range(n)]


class RecordsCheckerThreads:
    """Mixin for a backend class: `checked_by` maps each key whose record it checked to the
    name of the thread that checked it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checked_by: dict[str, str] = {}

    def check_record(self, key: str, length: int, buf: memoryview) -> str | None:
        self.checked_by[key] = threading.current_thread().name
        return super().check_record(key, length, buf)  # type: ignore[misc]


class HarnessPool:
    """Starts each harness at most once per session; stops them all at the end."""

    def __init__(self, stack: ExitStack, tmp_factory: pytest.TempPathFactory) -> None:
        self._stack = stack
        self._tmp = tmp_factory
        self._started: dict[str, BackendFactory] = {}

    def factory(self, h: Harness) -> BackendFactory:
        if h.name not in self._started:
            reason = h.skip_reason()
            if reason:
                pytest.skip(reason)
            tmp = self._tmp.mktemp(f"harness-{h.name}")
            self._started[h.name] = self._stack.enter_context(h.start(tmp))
        return self._started[h.name]


@pytest.fixture(scope="session")
def harness_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HarnessPool]:
    with ExitStack() as stack:
        yield HarnessPool(stack, tmp_path_factory)


@dataclass
class Store:
    """One contract test's view of a harness: its factory and the objects it made."""

    harness: Harness
    factory: BackendFactory
    objects: list[StorageBackend] = field(default_factory=list)

    def new(self, **extra: object) -> StorageBackend:
        b = self.factory(**extra)
        self.objects.append(b)
        return b

    def put_raw(self, key: str, raw: bytes) -> None:
        if self.harness.put_raw is not None:
            self.harness.put_raw(self.factory, key, raw)
        else:
            b = self.new()
            assert b.batch_set([key], [memoryview(raw)]) == [True]

    def close(self) -> None:
        for b in self.objects:
            b.close()
