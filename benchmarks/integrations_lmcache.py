"""LMCache remote connectors side by side: set / get MB/s of LMCache chunks through LMCache's own
connector interface, our `hicache://` connector against LMCache's built-in `lm://` (its own
server, `lmcache_server`) and `mooncakestore://` (Mooncake store, `mooncake_master`), in one run.

Every target is built by LMCache's `CreateConnector` (what its `RemoteBackend` does) over a real
`LocalCPUBackend`, and driven the way `RemoteBackend` drives it: `batched_put` / `batched_get`
when the connector supports them, else one `put` / `get` coroutine per chunk, all on the
connector's event loop thread, with the reference counting LMCache does. Clients are forked
processes, each with its own chunks (`MemoryObj`s filled once, `working_set_mb` for all
clients together). Set writes each chunk once, under a key no earlier run wrote (LMCache stores
a chunk once; and Mooncake answers a put of a key it already holds at once without writing, so
a rewrite loop would time nothing); get then cycles over those chunks for `seconds`. Every
client starts each op at a barrier. A get counts only chunks handed back with the right bytes in
front. MB/s is MiB per second summed over clients (as benchmarks/bench_storage.py). Targets run
interleaved per (clients, repeat).

Targets: `hicache` (our connector, same-host shared memory: the default), `hicache-tcp` (ours
with `shm: false`, what a client on another host gets), `lm`, `mooncakestore`. Mooncake binds
every interface, so `mooncakestore` runs only inside the loopback-only namespace
(`scripts/in_netns.sh`); elsewhere it is skipped with a note.

    LMCACHE_TRACK_USAGE=false scripts/in_netns.sh .venv/bin/python \\
        benchmarks/integrations_lmcache.py --clients 1,8 --page-bytes 1MiB --seconds 2 --repeat 3

`measure(args)` is the entry point `benchmarks/bench_integrations.py` calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench_storage import client_failed, run_clients  # noqa: E402 (this file's folder is on sys.path)
from integrations_sweep import sweep  # noqa: E402

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

MiB = 1 << 20
OPS = ("set", "get")
TARGETS = ("hicache", "hicache-tcp", "lm", "mooncakestore")
BUILTIN = {"lm", "mooncakestore"}
CHUNK_TOKENS, LAYERS, ITEMSIZE = 256, 8, 2  # float16 KV_2LTD chunks of [2, 8, 256, hidden]
BATCH_BYTES = 8 * MiB  # chunks per put / get call: a request's worth of KV
# Mooncake segment each client contributes, in working sets (the warm-up's and the timed one's).
SEGMENT_FACTOR = float(os.environ.get("HICACHE_BENCH_MOONCAKE_SEGMENT_FACTOR", "2.25"))
ADAPTER = {
    "remote_storage_plugin.hicache.module_path": "hicache_client.lmcache.adapter",
    "remote_storage_plugin.hicache.class_name": "HiCacheConnectorAdapter",
}


@dataclass(frozen=True)
class Target:
    name: str
    url: str  # the remote URL LMCache resolves (plugin://hicache for ours)
    extra: dict[str, Any] = field(default_factory=dict)  # LMCache extra_config
    plugins: tuple[str, ...] = ()  # remote_storage_plugins

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN


@dataclass(frozen=True)
class Plan:
    page_bytes: int  # bytes of one chunk
    clients: int
    batch: int  # chunks per call
    chunks: int  # working set per client
    seconds: float  # get: time per run
    run: int  # this run's number: its chunks have keys no earlier run wrote
    warm: bool = True  # write the working set once, untimed, before the timed set


def hidden_size(page_bytes: int) -> int:
    per = 2 * LAYERS * CHUNK_TOKENS * ITEMSIZE
    if page_bytes % per:
        raise ValueError(f"page_bytes must be a multiple of {per} (chunks of {CHUNK_TOKENS} "
                         f"float16 tokens over {LAYERS} layers)")
    return page_bytes // per


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------


@contextmanager
def _hicache(tmp: Path, ws_bytes: int) -> Iterator[list[Target]]:
    from tests.storage_backends.hicache_server_proc import hicache_server

    # Room for one working set and the batches in flight: each run's warm-up pass is evicted
    # by its timed pass, whose records reuse the warm-up's blocks (see _client_main).
    cap = f"{ws_bytes // MiB + 64}MiB"
    with hicache_server(tmp / "hicache", capacity=cap) as srv:
        base = {**ADAPTER, "remote_storage_plugin.hicache.url": f"hicache://127.0.0.1:{srv.port}",
                "remote_storage_plugin.hicache.timeout_ms": 30000}
        yield [Target("hicache", "plugin://hicache", base, ("hicache",)),
               Target("hicache-tcp", "plugin://hicache",
                      {**base, "remote_storage_plugin.hicache.shm": False}, ("hicache",))]


@contextmanager
def _lm(tmp: Path, ws_bytes: int) -> Iterator[list[Target]]:
    from tests.storage_backends.harness_lmcache import lmcache_server

    with lmcache_server(tmp) as url:
        yield [Target("lm", url)]


@contextmanager
def _mooncake(tmp: Path, ws_bytes: int) -> Iterator[list[Target]]:
    from tests.storage_backends.mooncake_procs import ENV, mooncake_master, skip_reason

    reason = skip_reason()
    if reason:
        print(f"  mooncakestore skipped: {reason}", file=sys.stderr)
        yield []
        return
    os.environ.update(ENV)  # clients forked from here bind loopback only
    with mooncake_master(tmp) as master:
        host, port = master.rsplit(":", 1)
        # NOTE: LMCache 0.5.6 hands Mooncake's dict `setup()` the key `master_server_address`,
        # which mooncake 0.3.13 does not know (it then dials its default master and fails);
        # LMCache forwards `mooncake_*` keys with the prefix stripped, which carries the name
        # this Mooncake reads.
        extra = {"master_server_address": master, "mooncake_master_server_addr": master,
                 "metadata_server": "P2PHANDSHAKE",
                 "local_hostname": "127.0.0.1", "protocol": "tcp",
                 "local_buffer_size": 64 * MiB, "transfer_timeout": 30}
        yield [Target("mooncakestore", f"mooncakestore://{host}:{port}", extra)]


STARTERS: dict[str, Callable[[Path, int], Any]] = {
    "hicache": _hicache, "hicache-tcp": _hicache, "lm": _lm, "mooncakestore": _mooncake}


# --------------------------------------------------------------------------------------------
# One client process
# --------------------------------------------------------------------------------------------


class _Connector:
    """One LMCache connector in this process, driven like LMCache's `RemoteBackend`."""

    def __init__(self, t: Target, plan: Plan) -> None:
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector import CreateConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.md = LMCacheMetadata(
            model_name="bench", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.float16, chunk_size=CHUNK_TOKENS,
            kv_shape=(LAYERS, 2, CHUNK_TOKENS, 1, hidden_size(plan.page_bytes)))
        extra = dict(t.extra)
        if t.name == "mooncakestore":  # each client contributes room for its own chunks
            extra["global_segment_size"] = max(64 * MiB, int(SEGMENT_FACTOR * plan.chunks
                                                             * plan.page_bytes))
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS, local_cpu=False, max_local_cpu_size=0.01,
            remote_serde="naive", remote_storage_plugins=list(t.plugins) or None,
            extra_config=extra)
        pool = (plan.chunks + 2 * plan.batch) * plan.page_bytes + 16 * MiB
        self.cpu = LocalCPUBackend(cfg, self.md, memory_allocator=TensorMemoryAllocator(
            torch.empty(pool, dtype=torch.uint8)))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.conn = CreateConnector(t.url, self.loop, self.cpu, cfg, self.md,
                                    plugin_name=t.plugins[0] if t.plugins else None)

    def _wait(self, coros: list[Any]) -> list[Any]:
        futs = [asyncio.run_coroutine_threadsafe(c, self.loop) for c in coros]
        return [f.result(timeout=300) for f in futs]

    def put(self, keys: list[Any], objs: list[Any]) -> None:
        for o in objs:
            o.ref_count_up()  # RemoteBackend's; the connector wrapper drops it after the put
        if self.conn.support_batched_put():
            self._wait([self.conn.batched_put(keys, objs)])
        else:
            self._wait([self.conn.put(k, o) for k, o in zip(keys, objs)])

    def get(self, keys: list[Any]) -> list[Any]:
        if self.conn.support_batched_get():
            return list(self._wait([self.conn.batched_get(keys)])[0])
        return self._wait([self.conn.get(k) for k in keys])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._wait([self.conn.close()])
        self.loop.call_soon_threadsafe(self.loop.stop)


def _marker(client: int, i: int) -> bytes:
    return (client * 1_000_003 + i).to_bytes(8, "little")


def _client_main(t: Target, plan: Plan, client: int, barrier: Any, queue: Any) -> None:
    try:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat

        c = _Connector(t, plan)
        gen = torch.Generator().manual_seed(client)
        objs, keys = [], []
        for i in range(plan.chunks):
            obj = c.cpu.allocate(c.md.get_shapes(), c.md.get_dtypes(), MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LocalCPUBackend could not allocate the working set")
            raw = obj.raw_data.view(torch.uint8)[: plan.page_bytes]
            raw.copy_(torch.randint(0, 256, (plan.page_bytes,), generator=gen, dtype=torch.uint8))
            raw[:8].copy_(torch.frombuffer(bytearray(_marker(client, i)), dtype=torch.uint8))
            objs.append(obj)
            chunk_hash = (plan.run * 1_000_003 + client) * 1_000_003 + i
            keys.append(CacheEngineKey("bench", 1, 0, chunk_hash, torch.float16))
        batches = [(list(range(i, min(i + plan.batch, plan.chunks))))
                   for i in range(0, plan.chunks, plan.batch)]
        if plan.warm:  # untimed: the store has seen a working set of traffic before we time it
            warm = [CacheEngineKey("warm", 1, 0, k.chunk_hash, torch.float16) for k in keys]
            for idx in batches:
                c.put([warm[i] for i in idx], [objs[i] for i in idx])
        result: dict[str, Any] = {}
        for op in OPS:
            barrier.wait(timeout=600)
            pages = misses = n = 0
            t0 = time.perf_counter()
            deadline = t0 + plan.seconds
            # set: each chunk once (first writes, as LMCache stores a chunk); get: `seconds`
            while (n < len(batches)) if op == "set" else (time.perf_counter() < deadline):
                idx = batches[n % len(batches)]
                n += 1
                if op == "set":
                    c.put([keys[i] for i in idx], [objs[i] for i in idx])
                else:
                    for i, got in zip(idx, c.get([keys[i] for i in idx])):
                        if got is None:
                            misses += 1
                            continue
                        ok = (got.get_size() == plan.page_bytes
                              and bytes(memoryview(got.byte_array)[:8]) == _marker(client, i))
                        misses += not ok
                        got.ref_count_down()
                pages += len(idx)
            result[op] = {"start": t0, "end": time.perf_counter(), "pages": pages,
                          "misses": misses}
        for obj in objs:
            obj.ref_count_down()
        c.close()
        queue.put((client, result, ""))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        client_failed(client, e, barrier, queue)


def run_one(t: Target, plan: Plan) -> dict[str, dict[str, float]]:
    """Fork `plan.clients` clients against `t`; per op: MB/s and misses (all clients)."""
    results, errors = run_clients(_client_main, (t, plan), plan.clients, 1800)
    if errors:
        raise RuntimeError(f"{t.name}: {errors[0]}")
    out: dict[str, dict[str, float]] = {}
    for op in OPS:
        parts = [r[op] for r in results]
        secs = max(p["end"] for p in parts) - min(p["start"] for p in parts)
        pages = sum(p["pages"] for p in parts)
        misses = sum(p["misses"] for p in parts)
        good = pages - misses if op == "get" else pages
        out[op] = {"mb_s": good * plan.page_bytes / MiB / secs, "misses": misses}
    return out


# --------------------------------------------------------------------------------------------
# measure(args) -> rows
# --------------------------------------------------------------------------------------------


def measure(args: Any) -> list[dict[str, Any]]:
    """Rows `{"plugin": "lmcache", "target", "builtin", "op", "clients", "page_bytes", "mb_s":
    [per repeat], "mb_s_median"}` (plus `misses` per repeat) for every started target, op and
    client count. `args`: `clients` (list of int), `page_bytes`, `seconds`, `repeat`; optional
    `lmcache_targets` (names, default all) and `working_set_mb` (all clients together, 256)."""
    hidden_size(int(args.page_bytes))

    def run(t: Target, n: int, batch: int, chunks: int, rep: int, runs: int) -> dict[str, Any]:
        return run_one(t, Plan(int(args.page_bytes), n, batch, chunks, float(args.seconds), runs))

    return sweep("lmcache", args, getattr(args, "lmcache_targets", None) or TARGETS, STARTERS,
                 BUILTIN, OPS, BATCH_BYTES, 256, run)


def ratios(rows: list[dict[str, Any]], ours: str = "hicache") -> list[dict[str, Any]]:
    """Per (op, clients): our median / the best built-in median."""
    out = []
    for r in rows:
        if r["target"] != ours:
            continue
        best = max((b for b in rows if b["builtin"] and b["op"] == r["op"]
                    and b["clients"] == r["clients"]), key=lambda b: b["mb_s_median"],
                   default=None)
        if best and best["mb_s_median"] > 0:
            out.append({"op": r["op"], "clients": r["clients"], "ours": r["mb_s_median"],
                        "best_builtin": best["target"], "builtin": best["mb_s_median"],
                        "ratio": round(r["mb_s_median"] / best["mb_s_median"], 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    from hicache_client.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,8")
    p.add_argument("--page-bytes", default="1MiB")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--working-set-mb", type=int, default=256)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" /
                                        "integrations_lmcache.json"))
    a = p.parse_args(argv)
    args = argparse.Namespace(clients=[int(c) for c in a.clients.split(",")],
                              page_bytes=parse_bytes(a.page_bytes, what="--page-bytes"),
                              seconds=a.seconds, repeat=a.repeat,
                              lmcache_targets=[t for t in a.targets.split(",") if t],
                              working_set_mb=a.working_set_mb)
    rows = measure(args)
    rows.sort(key=lambda r: (r["clients"], r["op"], r["target"]))
    for r in rows:
        print(f"{r['clients']:>3} {r['op']:<4} {r['target']:<14} {r['mb_s_median']:>9.1f} MB/s"
              f"  {r['mb_s']}" + (f"  misses {r['misses']}" if any(r["misses"]) else ""))
    rs = ratios(rows)
    for r in rs:
        print(f"hicache / best built-in ({r['best_builtin']}) {r['op']} x{r['clients']}: "
              f"{r['ratio']:.2f}x")
    from benchmarks.common import save_json

    save_json(a.out, {"benchmark": "integrations_lmcache", "args": vars(a), "rows": rows,
                      "ratios": rs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
