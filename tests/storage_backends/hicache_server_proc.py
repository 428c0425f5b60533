"""A real `hicache-server` process for tests (contract harness, server tests, reliability tests),
plus client-process workers that tests start with multiprocessing ("spawn")."""

from __future__ import annotations

import hashlib
import random
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zmq

from hicache_client.backend import StorageConfig
from hicache_client.codec import PageCodec
from hicache_client.errors import StorageError
from hicache_client.remote import protocol as P
from hicache_client.remote.backend import HiCacheServerBackend
from tests.procs import ManagedProcess, free_port, wait_for_port
from tests.storage_backends.conftest import NAMESPACE, make_codec

REPO_ROOT = Path(__file__).resolve().parents[2]


class HiCacheServerProc:
    """One `python -m storage_backends.server` on a free loopback port.

    `restart()` keeps the port (and so the clients' URL). Logs go to `<tmp>/hicache-server.log`.
    """

    def __init__(
        self,
        tmp: Path,
        *,
        capacity: str = "1GiB",
        persist_dir: Path | None = None,
        auth_token: str | None = None,
        metrics_port: int | None = None,
        args: Sequence[str] = (),
        port: int | None = None,
        file_size_limit: int | None = None,
        die_on_file_limit: bool = False,
    ) -> None:
        self.tmp = Path(tmp)
        self.port = port or free_port()
        self.capacity = capacity
        self.persist_dir = persist_dir
        self.auth_token = auth_token
        self.metrics_port = metrics_port
        self.args = list(args)
        # RLIMIT_FSIZE for the server process: a write past it fails with EFBIG (a full disk,
        # for real), or with `die_on_file_limit` kills the process mid-write (SIGXFSZ).
        self.file_size_limit = file_size_limit
        self.die_on_file_limit = die_on_file_limit
        self.proc: ManagedProcess | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _launcher(self) -> list[str]:
        if self.file_size_limit is None:
            return [sys.executable, "-m", "storage_backends.server"]
        n = int(self.file_size_limit)
        action = "SIG_DFL" if self.die_on_file_limit else "SIG_IGN"
        boot = (
            "import resource, runpy, signal, sys; sys.dont_write_bytecode = True; "
            f"signal.signal(signal.SIGXFSZ, signal.{action}); "
            "resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({n}, {n})); "
            "sys.argv[0] = 'hicache-server'; "
            "runpy.run_module('storage_backends.server', run_name='__main__', alter_sys=True)"
        )
        return [sys.executable, "-c", boot]

    def argv(self) -> list[str]:
        argv = [
            *self._launcher(),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--capacity",
            self.capacity,
            "--log-level",
            "INFO",  # a later --log-level in `args` wins
        ]
        if self.persist_dir is not None:
            argv += ["--persist-dir", str(self.persist_dir)]
        if self.metrics_port is not None:
            argv += ["--metrics-port", str(self.metrics_port)]
        return argv + self.args

    def start(self) -> HiCacheServerProc:
        env = {}
        if self.auth_token is not None:
            env["HICACHE_SERVER_AUTH_TOKEN"] = self.auth_token
        self.starts += 1
        self.proc = ManagedProcess(
            self.argv(), self.tmp / "hicache-server.log", env=env, cwd=REPO_ROOT
        ).start()
        wait_for_port(self.port, proc=self.proc.proc, timeout=60)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stop(self) -> int | None:
        """Clean shutdown (SIGTERM: the write-behind queue is flushed); returns the exit code."""
        if self.proc is None:
            return None
        self.proc.stop(timeout=60)
        return self.proc.proc.returncode if self.proc.proc else None

    def kill(self) -> None:
        """kill -9."""
        if self.proc is not None:
            self.proc.kill()

    def restart(self) -> HiCacheServerProc:
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.proc.log() if self.proc is not None else ""

    def client(self, **extra: Any) -> HiCacheServerBackend:
        return client_of(self.url, self.auth_token, **{"timeout_ms": 5000, **extra})


def client_of(url: str, token: str | None = None, **extra: Any) -> HiCacheServerBackend:
    """A backend of the test namespace on the server at `url` (10 s timeout unless `extra` says
    otherwise), with `token` when one is given."""
    cfg: dict[str, Any] = {"url": url, "timeout_ms": 10000}
    if token is not None:
        cfg["auth_token"] = token
    cfg.update(extra)
    return HiCacheServerBackend(StorageConfig(extra=cfg, namespace=NAMESPACE.hex()))


class OldProtocolServer(HiCacheServerProc):
    """A server that speaks only protocol `versions`, as released before a newer one: every
    message of a later version gets `bad_version`."""

    def __init__(self, tmp: Path, versions: Sequence[int], **kw: Any) -> None:
        super().__init__(tmp, **kw)
        self.versions = tuple(versions)

    def _launcher(self) -> list[str]:
        boot = (
            "import runpy, sys; import hicache_client.remote.protocol as P; "
            f"P.CODEC.versions = {self.versions!r}; sys.argv[0] = 'hicache-server'; "
            "runpy.run_module('storage_backends.server', run_name='__main__', alter_sys=True)"
        )
        return [sys.executable, "-c", boot]


@contextmanager
def hicache_server(tmp: Path, **kw: Any) -> Iterator[HiCacheServerProc]:
    """Start a server, yield it, always stop it."""
    srv = HiCacheServerProc(tmp, **kw)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


# --------------------------------------------------------------------------------------------
# Deterministic pages, so separate processes agree on what was written
# --------------------------------------------------------------------------------------------


def codec(payload_bytes: int = 4096 - 128) -> PageCodec:
    return make_codec(payload_bytes)


def page_key(space: str, i: int) -> str:
    return hashlib.sha256(f"{space}/{i}".encode()).hexdigest()


def page_record(c: PageCodec, space: str, i: int, version: int = 0) -> bytearray:
    payload = random.Random(f"{space}/{i}/{version}").randbytes(c.payload_bytes)
    return c.encode(page_key(space, i), payload)


def pages(space: str, n: int, payload: int) -> tuple[list[str], list[bytearray]]:
    """Pages 0..n-1 of `space` with `payload`-byte payloads: their keys and records."""
    c = codec(payload)
    return [page_key(space, i) for i in range(n)], [page_record(c, space, i) for i in range(n)]


# --------------------------------------------------------------------------------------------
# Client-process workers (module-level so multiprocessing "spawn" can import them)
# --------------------------------------------------------------------------------------------


def _batches(n: int, batch: int) -> Iterator[range]:
    """0..n-1 in runs of `batch`."""
    return (range(start, min(n, start + batch)) for start in range(0, n, batch))


def write_pages(
    url: str, token: str | None, space: str, n: int, batch: int = 128, payload: int = 3968
) -> dict[str, int]:
    """Write pages 0..n-1 of `space`; return counters (the process exit code says success)."""
    c = codec(payload)
    b = client_of(url, token)
    failed = 0
    try:
        for idx in _batches(n, batch):
            recs = [memoryview(page_record(c, space, i)) for i in idx]
            ok = b.batch_set([page_key(space, i) for i in idx], recs)
            failed += ok.count(False)
        st = b.stats()
    finally:
        b.close()
    if failed or st.errors:
        raise StorageError(f"writer: {failed} pages not stored, {st.errors} errors")
    return {"written": n}


def read_pages(
    url: str, token: str | None, space: str, n: int, batch: int = 128, payload: int = 3968
) -> dict[str, int]:
    """Read pages 0..n-1 of `space` and compare each with what `write_pages` wrote; raise on any
    miss or difference."""
    c = codec(payload)
    b = client_of(url, token)
    hits = 0
    try:
        for idx in _batches(n, batch):
            keys = [page_key(space, i) for i in idx]
            out = [memoryview(bytearray(c.record_bytes)) for _ in idx]
            ok = b.batch_get(keys, out)
            for i, good, buf in zip(idx, ok, out):
                if not good:
                    raise StorageError(f"reader: page {i} missing")
                if bytes(buf) != bytes(page_record(c, space, i)):
                    raise StorageError(f"reader: page {i} differs")
                hits += 1
        st = b.stats()
    finally:
        b.close()
    if st.errors or st.corrupt_pages:
        raise StorageError(f"reader: {st.errors} errors, {st.corrupt_pages} corrupt")
    return {"hits": hits}


def mixed_worker(
    url: str, worker: int, seconds: float, result_path: str, payload: int = 3968
) -> None:
    """Mixed operations on a private key space and a shared one for `seconds`: set, get
    (checked bit-identical), exists, delete of own pages. Writes a JSON summary to
    `result_path`: the pages this worker last left stored (to be read back afterwards) and its
    error counts."""
    import json

    c = codec(payload)
    rng = random.Random(worker)
    b = client_of(url, timeout_ms=20000)
    mine = f"w{worker}"
    stored: set[int] = set()
    mismatches = ops = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            ops += 1
            op = rng.random()
            idx = [rng.randrange(2000) for _ in range(rng.randint(1, 32))]
            idx = sorted(set(idx))
            if op < 0.35:
                recs = [memoryview(page_record(c, mine, i)) for i in idx]
                ok = b.batch_set([page_key(mine, i) for i in idx], recs)
                stored.update(i for i, o in zip(idx, ok) if o)
            elif op < 0.45:
                shared = [i % 200 for i in idx]
                shared = sorted(set(shared))
                recs = [memoryview(page_record(c, "shared", i)) for i in shared]
                b.batch_set([page_key("shared", i) for i in shared], recs)
            elif op < 0.80:
                space = mine if op < 0.70 else "shared"
                keys = [page_key(space, i) for i in idx]
                out = [memoryview(bytearray(c.record_bytes)) for _ in idx]
                for i, good, buf in zip(idx, b.batch_get(keys, out), out):
                    if space == mine and (good != (i in stored)):
                        mismatches += 1
                    if good and bytes(buf) != bytes(page_record(c, space, i)):
                        mismatches += 1
            elif op < 0.93:
                b.batch_exists([page_key(mine, i) for i in idx])
            else:
                b.delete([page_key(mine, i) for i in idx])
                stored.difference_update(idx)
        st = b.stats()
    finally:
        b.close()
    Path(result_path).write_text(
        json.dumps(
            {
                "stored": sorted(stored),
                "ops": ops,
                "mismatches": mismatches,
                "errors": st.errors,
                "corrupt": st.corrupt_pages,
                "set_failures": st.set_failures,
            }
        )
    )


class RawClient:
    """A bare protocol client (one DEALER socket, messages built by hand): for tests that need
    what the backend never sends, or to see each reply as it is."""

    def __init__(self, url: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.rid = 0

    def ask(self, msg: P.Request) -> P.Message:
        """Send `msg` as it is (its own request id) and return the next reply."""
        self.sock.send_multipart(P.encode(msg))
        assert self.sock.poll(20000), "server did not answer"
        return P.decode(self.sock.recv_multipart(), expect="reply")

    def call(self, req: P.Request, timeout_ms: int = 20000) -> P.Message | None:
        """The reply, or None when none came in time (the server died)."""
        self.rid += 1
        req.request_id = self.rid
        self.sock.send_multipart(P.encode(req))
        while self.sock.poll(timeout_ms):
            msg = P.decode(self.sock.recv_multipart(), expect="reply")
            if msg.request_id == self.rid:
                return msg
        return None

    def set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        r = self.call(P.SetRequest(keys=keys, frames=list(values)))
        assert isinstance(r, P.SetReply), r
        return r.stored

    def get(self, keys: list[str]) -> list[bytes | None]:
        r = self.call(P.GetRequest(keys=keys))
        assert isinstance(r, P.GetReply), r
        frames = iter(r.frames)
        return [None if n < 0 else bytes(next(frames)) for n in r.lengths]

    def stats(self) -> dict[str, int]:
        r = self.call(P.StatsRequest())
        assert isinstance(r, P.StatsReply), r
        return r.stats

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@contextmanager
def raw_clients() -> Iterator[list[RawClient]]:
    """A list for a test's `RawClient`s: each one put in it is closed on exit."""
    made: list[RawClient] = []
    try:
        yield made
    finally:
        for c in made:
            c.close()


def churn_worker(url: str, worker: int, rounds: int, result_path: str, payload: int) -> None:
    """`rounds` random sets and gets of up to 8 pages among 96 keys shared by every worker (one
    record per key, so any hit has exactly one right value), against a server too small for
    them all: records are evicted, and their blocks reused, while others read. Writes a JSON
    summary to `result_path`."""
    import json

    c = codec(payload)
    rng = random.Random(1000 + worker)
    b = client_of(url, timeout_ms=20000)
    recs = {i: page_record(c, "churn", i) for i in range(96)}
    res = {"hits": 0, "misses": 0, "wrong": 0}
    try:
        for _ in range(rounds):
            idx = sorted({rng.randrange(96) for _ in range(rng.randint(1, 8))})
            keys = [page_key("churn", i) for i in idx]
            if rng.random() < 0.4:
                b.batch_set(keys, [memoryview(recs[i]) for i in idx])
                continue
            out = [memoryview(bytearray(c.record_bytes)) for _ in idx]
            for i, hit, buf in zip(idx, b.batch_get(keys, out), out):
                res["hits" if hit else "misses"] += 1
                res["wrong"] += hit and bytes(buf) != bytes(recs[i])
        st = b.stats()
        res.update(errors=st.errors, corrupt=st.corrupt_pages, arena_reads=b.arena.reads,
                   arena_fallbacks=b.arena.fallbacks)
    finally:
        b.close()
    Path(result_path).write_text(json.dumps(res))
