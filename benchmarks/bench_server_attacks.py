"""Issue 46: `hicache-server`'s peak RSS under the audit's memory attacks, and its get/set
throughput, for today's tree against an older one (`--before DIR`: a `git worktree` of the start
commit), in one run.

Each server is a child `python -m storage_backends.server` on a loopback port, from its own
source tree (PYTHONPATH). Peak RSS is the child's VmHWM (/proc) after the attack minus before it.
Throughput: one DEALER client, get and set of 64 KiB pages in batches of 16, the two servers
alternating 0.5 s slices (so machine load hits both alike); medians of the slices, ratio
after / before. (bench_storage.py measures backends through their client, one tree at a time;
this compares two trees' servers side by side, so it stands apart.)

    .venv/bin/python benchmarks/bench_server_attacks.py --before /tmp/wt46-before \\
        --out benchmarks/results/server-attacks-2026-12-07/bench_server_attacks.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-attack-token-0001"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(tree: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(tree), "HICACHE_SERVER_AUTH_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "storage_backends.server", "--port",
                             str(port), "--capacity", "1GiB", "--no-shm", "--log-level", "ERROR"],
                            cwd=tree, env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    raise RuntimeError(f"server from {tree} did not start")


def hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


class Client:
    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.rid = 0

    def call(self, frames: list[bytes]) -> list[bytes]:
        self.sock.send_multipart(frames)
        if not self.sock.poll(60_000):
            raise RuntimeError("no reply")
        return self.sock.recv_multipart()

    def header(self, t: str, **fields: object) -> bytes:
        self.rid += 1
        return msgpack.packb({"v": 1, "t": t, "id": self.rid, "auth": TOKEN, **fields},
                             use_bin_type=True)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


ATTACKS = {
    # defect 1: 8 MiB of empty maps in one header, before any token check
    "header_of_8M_empty_maps": lambda c: c.call(
        [b"\xdd" + (8 << 20).to_bytes(4, "big") + b"\x80" * (8 << 20)]),
    # the same 8M maps as a get's keys (a request's map around them)
    "get_keys_of_1M_empty_maps": lambda c: c.call(
        [msgpack.packb({"v": 1, "t": "get", "id": 1, "auth": "", "keys": [{}] * (1 << 16)})]),
}


def attack_rss(tree: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, attack in ATTACKS.items():
        port = free_port()
        proc = start(tree, port)
        c = Client(port)
        try:
            c.call([c.header("ping")])
            before = hwm_kib(proc.pid)
            attack(c)
            out[name + "_peak_rss_growth_kib"] = hwm_kib(proc.pid) - before
        finally:
            c.close()
            proc.terminate()
            proc.wait()
    return out


def throughput(trees: dict[str, Path], slices: int) -> dict[str, dict[str, float]]:
    procs, clients = {}, {}
    page = os.urandom(64 << 10)
    keys = [f"{i:064x}" for i in range(16)]
    rates: dict[str, dict[str, list[float]]] = {n: {"get": [], "set": []} for n in trees}
    try:
        for name, tree in trees.items():
            port = free_port()
            procs[name] = start(tree, port)
            clients[name] = Client(port)
            clients[name].call([clients[name].header("set", keys=keys), *[page] * 16])
        for k in range(slices):
            order = list(clients.items())
            for name, c in (order if k % 2 == 0 else order[::-1]):  # neither always first
                for op in ("set", "get"):
                    n, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < 0.5:
                        frames = [c.header(op, keys=keys)]
                        if op == "set":
                            frames += [page] * 16
                        c.call(frames)
                        n += 16
                    rates[name][op].append(n * len(page) / (time.perf_counter() - t0) / 1e6)
    finally:
        for c in clients.values():
            c.close()
        for p in procs.values():
            p.terminate()
            p.wait()
    return {n: {op + "_MBps_median": statistics.median(v) for op, v in r.items()}
            for n, r in rates.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="source tree of the old server")
    p.add_argument("--slices", type=int, default=10)
    p.add_argument("--out", default="")
    a = p.parse_args()
    trees = {"before": Path(a.before).resolve(), "after": REPO}
    result: dict[str, object] = {"load_average": os.getloadavg()}
    result["attacks"] = {n: attack_rss(t) for n, t in trees.items()}
    tp = throughput(trees, a.slices)
    result["throughput"] = tp
    result["ratio_after_before"] = {
        op: tp["after"][op + "_MBps_median"] / tp["before"][op + "_MBps_median"]
        for op in ("get", "set")}
    result["load_average_end"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
