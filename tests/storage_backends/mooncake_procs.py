"""Mooncake processes for tests and benchmarks: `mooncake_master` and helper store clients.

`mooncake_master` and Mooncake's clients listen on every interface whatever they are told, so
they may only run inside a network namespace that has nothing but loopback (`make test` runs
pytest through `scripts/in_netns.sh`). `netns_skip_reason()` says why not, when not.

A helper store client (`SegmentHolder`) is a separate process that contributes a memory segment
to the store (objects live in contributed segments and vanish with their process) and can write
pages through `MooncakeBackend` before it waits for its stdin to close.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.procs import ManagedProcess, free_port, wait_for_port

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "00" * 32
ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "LMCACHE_TRACK_USAGE": "false"}


def netns_skip_reason() -> str | None:
    """None inside a loopback-only network namespace, else why Mooncake must not run here."""
    if os.environ.get("HICACHE_IN_NETNS") != "1":
        return ("mooncake binds every interface: run inside the loopback-only namespace "
                "(scripts/in_netns.sh python -m pytest ..., or make test)")
    try:
        out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot list network interfaces ({e})"
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    others = [n for n in names if n != "lo"]
    if others:
        return f"network namespace has interfaces other than lo: {others}"
    return None


def master_binary() -> str | None:
    """Path of the `mooncake_master` shipped in the Mooncake wheel (None if not installed)."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.exists():
        return str(beside)
    try:
        import mooncake
    except ImportError:
        return None
    inside = Path(mooncake.__file__).parent / "mooncake_master"
    return str(inside) if inside.exists() else None


def skip_reason() -> str | None:
    """Why the Mooncake store cannot be started here (None: it can)."""
    reason = netns_skip_reason()
    if reason:
        return reason
    if master_binary() is None:
        return "mooncake_master not found: pip install 'hicache[mooncake]'"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"mooncake.store does not import ({e}); Debian's libibverbs1 may be missing"
    return None


@contextmanager
def mooncake_master(log_dir: Path) -> Iterator[str]:
    """Start `mooncake_master` on free loopback ports; yield its RPC address host:port."""
    reason = netns_skip_reason()
    if reason:
        raise RuntimeError(f"refusing to start mooncake_master: {reason}")
    binary = master_binary()
    if binary is None:
        raise RuntimeError("mooncake_master not found")
    port, metrics = free_port(), free_port()
    argv = [
        binary,
        f"--rpc_port={port}",
        "--rpc_address=127.0.0.1",
        f"--metrics_port={metrics}",
        "--metrics_host=127.0.0.1",
        "--enable_metric_reporting=false",
        "--enable_http_metadata_server=false",
    ]
    proc = ManagedProcess(argv, log_dir / f"mooncake_master-{port}.log", env=ENV)
    with proc:
        wait_for_port(port, proc=proc.proc)
        yield f"127.0.0.1:{port}"


def client_config(master: str, segment_bytes: int, **extra: Any) -> dict[str, Any]:
    return {
        "master_server_address": master,
        "global_segment_size": segment_bytes,
        "local_buffer_size": 16 << 20,
        "staging_bytes": 8 << 20,
        "staging_buffers": 1,
        **extra,
    }


class SegmentHolder:
    """A store client in its own process that contributes `segment_bytes` and, optionally,
    writes `count` pages (`page_records(first, count, payload_bytes)`) before it signals ready.
    Its objects live until `stop()`."""

    def __init__(self, master: str, segment_bytes: int, log_dir: Path, *, first: int = 0,
                 count: int = 0, payload_bytes: int = 1000, **extra: Any) -> None:
        cfg = client_config(master, segment_bytes, **extra)
        self.argv = [sys.executable, "-m", "tests.storage_backends.mooncake_procs", "holder",
                     json.dumps(cfg), str(first), str(count), str(payload_bytes)]
        self.log_path = log_dir / f"mooncake-holder-{free_port()}.log"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> SegmentHolder:
        env = {**os.environ, **ENV, "PYTHONPATH": str(REPO)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=env, cwd=REPO, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.stop()
            raise RuntimeError(f"mooncake segment holder failed ({line!r}); see {self.log_path}")
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> SegmentHolder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def page_key(i: int) -> str:
    return f"{i:064x}"


def page_records(first: int, count: int, payload_bytes: int) -> list[bytearray]:
    """Deterministic page records for keys `page_key(first..first+count-1)`."""
    from hicache_client.codec import PageCodec

    codec = PageCodec(namespace=bytes.fromhex(NAMESPACE), dtype="uint8", shape=(payload_bytes,),
                      layout="raw", tokens_per_page=16, itemsize=1)
    return [codec.encode(page_key(i), bytes([i % 251]) * payload_bytes)
            for i in range(first, first + count)]


def _holder(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mooncake_procs holder")
    p.add_argument("config")
    p.add_argument("first", type=int)
    p.add_argument("count", type=int)
    p.add_argument("payload_bytes", type=int)
    a = p.parse_args(argv)
    from hicache_client.backend import StorageConfig
    from storage_backends.mooncake_backend import MooncakeBackend

    backend = MooncakeBackend(StorageConfig(extra=json.loads(a.config), namespace=NAMESPACE))
    if a.count:
        keys = [page_key(i) for i in range(a.first, a.first + a.count)]
        recs = [memoryview(r) for r in page_records(a.first, a.count, a.payload_bytes)]
        ok = backend.batch_set(keys, recs)
        if not all(ok):
            print(f"failed {ok.count(False)}", flush=True)
            return 1
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    backend.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "holder":
        sys.exit(_holder(sys.argv[2:]))
    sys.exit("usage: python -m tests.storage_backends.mooncake_procs holder CONFIG FIRST N BYTES")
