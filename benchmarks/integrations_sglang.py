"""SGLang HiCache storage backends side by side: set / get MB/s of SGLang KV pages through
SGLang's own storage interface, our plugin (`hicache_client.sglang`, over `hicache-server`)
against SGLang's built-in `file` and `mooncake` backends, in one run.

Every target is built by SGLang's `StorageBackendFactory` (ours as `dynamic`), given a real
SGLang host pool (`MHATokenToKVPoolHost`, `page_first`, bfloat16; `--page-bytes` sets the
tokens per page), and driven as SGLang's cache controller drives it: the zero-copy v1 calls
(`batch_get_v1` / `batch_set_v1` with host slot indices) for ours (`interface_v1`) and
`mooncake`, the generic v0 calls (`batch_get` into `get_dummy_flat_data_page()` tensors then
`set_from_flat_data_page`; `batch_set` of `get_data_page()` tensors) for `file`, as SGLang
does. Clients are forked processes, each with its own host pool; every set writes pages never
written before (SGLang's `file` and `mooncake` skip keys they hold), at least one pass over the
client's working set, for `seconds` (after one untimed pass, for every target alike); then gets
cycle over the last pass. A client checks its
first get batch byte for byte (outside the timing). MB/s is MiB of SGLang pages per second
summed over clients. Targets run interleaved per (clients, repeat). A repeat in which a
client failed (its first get batch missed, or it raised) counts as no measurement: `mb_s`
shows it as 0.0 with `misses` -1, and the median is over the other repeats.

Targets: `hicache` (our plugin, same-host shared memory: its default), `hicache-tcp` (ours with
`shm: false`, what an engine on another host gets), `file` (SGLang's `HiCacheFile` in a temp
directory), `mooncake` (SGLang's `MooncakeStore`: `mooncake_master` + TCP transport). Mooncake
binds every interface, so `mooncake` runs only inside the loopback-only namespace
(`scripts/in_netns.sh`); elsewhere it is skipped with a note.

    LMCACHE_TRACK_USAGE=false scripts/in_netns.sh .venv/bin/python \\
        benchmarks/bench_integrations.py --plugins sglang

`measure(args)` is the entry point `benchmarks/bench_integrations.py` calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench_storage import client_failed, run_clients  # noqa: E402 (this file's folder is on sys.path)
from integrations_sweep import sweep  # noqa: E402

MiB = 1 << 20
OPS = ("set", "get")
TARGETS = ("hicache", "hicache-tcp", "file", "mooncake")
BUILTIN = {"file", "mooncake"}
LAYERS, HEADS, HEAD_DIM, ITEMSIZE = 8, 8, 64, 2  # bfloat16; 16 KiB of K+V per token
BATCH_BYTES = 16 * MiB  # pages per storage call


@dataclass
class Target:
    name: str
    backend: str  # SGLang's --hicache-storage-backend
    extra: dict[str, Any]  # its --hicache-storage-backend-extra-config
    zero_copy: bool  # SGLang's controller calls v1 (else the generic v0 calls)
    cleanup: Callable[[], None] | None = None


@dataclass
class Plan:
    page_bytes: int
    clients: int
    batch_pages: int
    ws_pages: int  # per client
    seconds: float
    tag: str  # makes every run's keys new


def tokens_per_page(page_bytes: int) -> int:
    per_token = 2 * LAYERS * HEADS * HEAD_DIM * ITEMSIZE
    if page_bytes % per_token:
        raise ValueError(f"page bytes must be a multiple of {per_token} (one token of KV)")
    return page_bytes // per_token


# --------------------------------------------------------------------------------------------
# Targets (each started once per measure())
# --------------------------------------------------------------------------------------------


@contextmanager
def start_hicache(tmp: Path, ws_bytes: int) -> Iterator[list[Target]]:
    from tests.storage_backends.hicache_server_proc import HiCacheServerProc

    cap = max(256 * MiB, 2 * ws_bytes)  # holds every client's last pass; recycles its slots
    # The store (arena) holds the pages (up to `cap`) and the slots reserved for writes in
    # place (every client's batch in flight and the next one reserved ahead): the server's
    # default room beyond the capacity (the larger of 1/8 and 256 MiB) covers 8 clients.
    srv = HiCacheServerProc(tmp / "hicache", capacity=str(cap), args=["--log-level", "WARNING"])
    (tmp / "hicache").mkdir(parents=True, exist_ok=True)
    srv.start()
    plugin = {"backend_name": "hicache", "module_path": "hicache_client.sglang",
              "class_name": "HiCacheServerStorage", "interface_v1": 1, "url": srv.url,
              "timeout_ms": 20000}
    try:
        yield [Target("hicache", "dynamic", plugin, True),
               Target("hicache-tcp", "dynamic", {**plugin, "shm": False}, True)]
    finally:
        srv.stop()


@contextmanager
def start_file(tmp: Path, ws_bytes: int) -> Iterator[list[Target]]:
    d = tmp / "file"

    def wipe() -> None:  # every run writes new pages: do not fill the disk
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)

    wipe()
    yield [Target("file", "file", {"file_storage_path": str(d)}, False, wipe)]


@contextmanager
def start_mooncake(tmp: Path, ws_bytes: int) -> Iterator[list[Target]]:
    from tests.storage_backends import mooncake_procs

    reason = mooncake_procs.skip_reason()
    if reason:
        print(f"  sglang: mooncake skipped: {reason}", file=sys.stderr)
        yield []
        return
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with mooncake_procs.mooncake_master(tmp) as master:
        yield [Target("mooncake", "mooncake", {
            "master_server_address": master, "protocol": "tcp", "device_name": "",
            "metadata_server": "P2PHANDSHAKE", "global_segment_size": max(512 * MiB, ws_bytes),
        }, True)]


STARTERS = {"hicache": start_hicache, "hicache-tcp": start_hicache, "file": start_file,
            "mooncake": start_mooncake}


# --------------------------------------------------------------------------------------------
# One client process
# --------------------------------------------------------------------------------------------


def _backend(t: Target, host: Any, page_size: int, client: int) -> Any:
    from tests.integrations.sglang_env import load_sglang_pools

    s = load_sglang_pools()
    cfg = s.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/model", extra_config=dict(t.extra))
    b = s.StorageBackendFactory.create_backend(t.backend, cfg, host)
    b.register_mem_pool_host(host)
    return b


def _ops(t: Target, b: Any, host: Any) -> tuple[Callable[..., int], Callable[..., int]]:
    """(set, get) of a batch, each returning the pages done, as SGLang's controller calls them
    (cache_controller.py: `_page_set_zero_copy` / `_page_get_zero_copy`, else
    `_generic_page_set` / `_generic_page_get`)."""
    ps = host.page_size
    if t.zero_copy:
        return (lambda keys, idx: sum(b.batch_set_v1(keys, idx)),
                lambda keys, idx: sum(b.batch_get_v1(keys, idx)))

    def gset(keys: list[str], idx: Any) -> int:
        data = [host.get_data_page(int(idx[i * ps])) for i in range(len(keys))]
        return len(keys) if b.batch_set(keys, data) else 0

    def gget(keys: list[str], idx: Any) -> int:
        pages = b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
        n = 0
        for i, page in enumerate(pages or []):
            if page is None:
                break
            host.set_from_flat_data_page(int(idx[i * ps]), page)
            n += 1
        return n

    return gset, gget


def _client(t: Target, plan: Plan, client: int, barrier: Any, queue: Any) -> None:
    try:
        import torch

        from tests.integrations.sglang_env import mha_host_pool

        ps = tokens_per_page(plan.page_bytes)
        host = mha_host_pool(layout="page_first", page_size=ps, layers=LAYERS, heads=HEADS,
                             head_dim=HEAD_DIM, pages=plan.ws_pages + plan.batch_pages)
        src = host.alloc(plan.ws_pages * ps)
        dst = host.alloc(plan.batch_pages * ps)
        host.kv_buffer.view(torch.int16).random_(generator=torch.Generator().manual_seed(client))
        b = _backend(t, host, ps, client)
        do_set, do_get = _ops(t, b, host)
        bp = plan.batch_pages
        result: dict[str, Any] = {}
        for i in range(0, plan.ws_pages, bp):  # warm-up, untimed: connections, buffers, slots
            do_set([hashlib.sha256(f"{plan.tag}/{client}/warm/{i + j}".encode()).hexdigest()
                    for j in range(bp)], src[i * ps : (i + bp) * ps])
        barrier.wait(timeout=600)
        t0 = time.perf_counter()
        done = rounds = 0
        last: list[list[str]] = []
        while rounds == 0 or time.perf_counter() - t0 < plan.seconds:
            last = []
            for i in range(0, plan.ws_pages, bp):
                keys = [hashlib.sha256(f"{plan.tag}/{client}/{rounds}/{i + j}".encode())
                        .hexdigest() for j in range(bp)]
                done += do_set(keys, src[i * ps : (i + bp) * ps])
                last.append(keys)
            rounds += 1
        result["set"] = {"start": t0, "end": time.perf_counter(), "pages": done}
        first = last[0]
        assert do_get(first, dst) == bp, "first get batch missed"
        for i in range(bp):
            got = host.get_data_page(int(dst[i * ps]))
            want = host.get_data_page(int(src[i * ps]))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"page {i} differs"
        barrier.wait(timeout=600)
        t0 = time.perf_counter()
        done = misses = n = 0
        while n == 0 or time.perf_counter() - t0 < plan.seconds:
            keys = last[n % len(last)]
            got = do_get(keys, dst)
            done += got
            misses += len(keys) - got
            n += 1
        result["get"] = {"start": t0, "end": time.perf_counter(), "pages": done,
                         "misses": misses}
        with contextlib.suppress(Exception):
            b.close()
        queue.put((client, result, ""))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        client_failed(client, e, barrier, queue)


def run_one(t: Target, plan: Plan) -> dict[str, dict[str, float]]:
    if t.cleanup is not None:
        t.cleanup()
    results, errors = run_clients(_client, (t, plan), plan.clients, 900)
    out: dict[str, dict[str, float]] = {}
    for op in OPS:
        if errors or not results:
            print(f"  ! sglang {t.name} {op}: {errors[0] if errors else 'no result'}",
                  file=sys.stderr)
            out[op] = {"mb_s": 0.0, "misses": -1}
            continue
        parts = [r[op] for r in results]
        secs = max(p["end"] for p in parts) - min(p["start"] for p in parts)
        pages = sum(p["pages"] for p in parts)
        out[op] = {"mb_s": pages * plan.page_bytes / MiB / secs if secs > 0 else 0.0,
                   "misses": sum(p.get("misses", 0) for p in parts)}
    return out


# --------------------------------------------------------------------------------------------
# measure(args) -> rows
# --------------------------------------------------------------------------------------------


def measure(args: Any) -> list[dict[str, Any]]:
    """Rows `{"plugin": "sglang", "target", "builtin", "op", "clients", "page_bytes", "mb_s":
    [per repeat], "mb_s_median"}` (plus `misses` per repeat) for every started target, op and
    client count. `args`: `clients` (list of int), `page_bytes`, `seconds`, `repeat`; optional
    `sglang_targets` (names, default all) and `working_set_mb` (all clients together, 128)."""
    from tests.integrations.sglang_env import load_sglang_pools

    load_sglang_pools()  # once, before the clients fork
    tokens_per_page(int(args.page_bytes))

    def run(t: Target, n: int, batch: int, ws: int, rep: int, runs: int) -> dict[str, Any]:
        plan = Plan(int(args.page_bytes), n, batch, ws, float(args.seconds), f"{t.name}{n}r{rep}")
        return run_one(t, plan)

    # A repeat that failed (misses -1: e.g. Mooncake evicted the pages a client had just
    # written, so its first get batch missed) measured no speed: the median is over the
    # repeats that ran (0 when none did).
    return sweep("sglang", args, getattr(args, "sglang_targets", None) or TARGETS, STARTERS,
                 BUILTIN, OPS, BATCH_BYTES, 128, run)


if __name__ == "__main__":
    sys.exit("run it through benchmarks/bench_integrations.py --plugins sglang")
