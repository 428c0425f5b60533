"""`hicache-admin` and the admin API of `hicache-server` (protocol 6): the admin token, lookup,
pins (kept under capacity pressure, bounded, leased, persisted across a restart), clears by
namespace and of everything, and per-namespace stats. Real server processes on loopback; the
CLI run as its console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hicache_client.backend import StorageConfig
from hicache_client.keys import page_keys
from hicache_client.remote import protocol as P
from hicache_client.remote.backend import HiCacheServerBackend
from storage_backends.server.admin_cli import AdminClient, AdminError
from tests.storage_backends.conftest import buffers, make_codec
from tests.storage_backends.hicache_server_proc import HiCacheServerProc, RawClient

TOKEN = "admin-secret"
PS = 4  # tokens per page
REC = 4096  # bytes per record: a 128-byte header and 3968 payload bytes
NS_A, NS_B, NS_C = "aa" * 32, "bb" * 32, "cc" * 32
CAPACITY = str(8 * REC)  # eight records; pins may hold half of it (four)


def prompt(salt: int, pages: int) -> list[int]:
    """Token ids of `pages` full pages and one token more (every page reusable)."""
    return [salt * 1000 + i for i in range(pages * PS + 1)]


def keys_of(ids: list[int], ns: str) -> list[str]:
    return [d.hex() for d in page_keys(ids, PS, bytes.fromhex(ns))]


def client(url: str, ns: str) -> HiCacheServerBackend:
    return HiCacheServerBackend(StorageConfig(extra={"url": url, "timeout_ms": 5000},
                                              namespace=ns))


def write(b: HiCacheServerBackend, ns: str, keys: list[str]) -> list[bytearray]:
    codec = make_codec(REC - 128, namespace=bytes.fromhex(ns))
    recs = [codec.encode(k, bytes([i % 251]) * codec.payload_bytes) for i, k in enumerate(keys)]
    assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * len(keys)
    return recs


def admin(url: str, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_SERVER_ADMIN_TOKEN"}
    if token is not None:
        env["HICACHE_SERVER_ADMIN_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "storage_backends.server.admin_cli",
                           "--url", url, *args], capture_output=True, text=True, env=env,
                          timeout=120)


def admin_json(url: str, *args: str) -> Any:
    r = admin(url, "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def ids_arg(ids: list[int]) -> list[str]:
    return ["--token-ids", ",".join(map(str, ids)), "--page-size", str(PS)]


def test_the_admin_api_needs_the_admin_token(tmp_path: Path) -> None:
    srv = HiCacheServerProc(tmp_path, capacity=CAPACITY, auth_token="data-token",
                            args=["--admin-token", TOKEN]).start()
    raw = RawClient(srv.url)
    try:
        for token in ("", "data-token", "wrong"):  # the data path's token is not the admin's
            r = raw.call(P.AdminStatsRequest(token=token))
            assert isinstance(r, P.ErrorReply) and r.code == P.ErrorCode.UNAUTHORIZED
            assert r.message == "missing or wrong admin token"
        assert isinstance(raw.call(P.AdminStatsRequest(token=TOKEN)), P.AdminStatsReply)
        # ...and the admin token is not the data path's.
        r = raw.call(P.StatsRequest(token=TOKEN))
        assert isinstance(r, P.ErrorReply) and r.code == P.ErrorCode.UNAUTHORIZED
        no = admin(srv.url, "stats", token=None)
        assert no.returncode == 1
        assert "no admin token: pass --admin-token or set HICACHE_SERVER_ADMIN_TOKEN" in no.stderr
        bad = admin(srv.url, "stats", token="wrong")
        assert bad.returncode == 1
        assert "refused admin_stats: unauthorized: missing or wrong admin token" in bad.stderr
    finally:
        raw.close()
        srv.stop()
    off = HiCacheServerProc(tmp_path / "off", capacity=CAPACITY)
    (tmp_path / "off").mkdir()
    off.start()
    try:
        r = admin(off.url, "stats")
        assert r.returncode == 1
        assert "the admin API is off: start hicache-server with --admin-token" in r.stderr
    finally:
        off.stop()


def test_lookup_pin_clear_and_stats(tmp_path: Path) -> None:
    srv = HiCacheServerProc(tmp_path, capacity=CAPACITY, args=["--admin-token", TOKEN]).start()
    a, b, c = (client(srv.url, ns) for ns in (NS_A, NS_B, NS_C))
    try:
        ids_a, ids_b = prompt(1, 4), prompt(2, 2)
        ka, kb = keys_of(ids_a, NS_A), keys_of(ids_b, NS_B)
        recs_a = write(a, NS_A, ka[:3])  # three of the prompt's four pages
        write(b, NS_B, kb)
        out = admin_json(srv.url, "lookup", *ids_arg(ids_a), "--namespace", NS_A)
        assert out["server"] == {"pages": 3, "tokens": 3 * PS, "in_memory_pages": 3,
                                 "pinned_pages": 0, "reusable_tokens": 3 * PS}
        assert out["prompt_tokens"] == len(ids_a) and out["engines"] == []
        # Another namespace holds none of this prompt's pages.
        out = admin_json(srv.url, "lookup", *ids_arg(ids_a), "--namespace", NS_B)
        assert out["server"]["pages"] == 0
        # Pin A's prompt: the three pages held are pinned, the fourth is not held.
        out = admin_json(srv.url, "pin", *ids_arg(ids_a), "--namespace", NS_A,
                         "--allow-partial")
        assert out == {"pinned": 3, "absent": 1, "pinned_bytes": 3 * REC,
                       "limit_bytes": 4 * REC, "ttl_s": None}
        # B's two pages would take the pins past half the capacity: refused whole.
        r = admin(srv.url, "pin", *ids_arg(ids_b), "--namespace", NS_B)
        assert r.returncode == 1
        assert "pin_limit: pinning 2 pages would pin 20480 bytes in all; the limit is 16384" \
            in r.stderr
        # Capacity pressure: 8 pages of C evict B's pages and C's own oldest, never A's pins.
        kc = keys_of(prompt(3, 8), NS_C)
        write(c, NS_C, kc)
        assert a.batch_exists(ka) == 3
        assert b.batch_exists(kb) == 0
        assert c.server_stats()["pages"] == 8
        assert c.batch_exists(kc[:3]) == 0 and c.batch_exists(kc[3:]) == 5
        out_a = buffers(3, REC)
        assert a.batch_get(ka[:3], out_a) == [True] * 3
        assert [bytes(o) for o in out_a] == [bytes(r) for r in recs_a]
        assert b.batch_get(kb, buffers(2, REC)) == [False, False]  # two misses, B's
        st = admin_json(srv.url, "stats")
        rows = st["namespaces"]
        nodisk = {"disk_pages": 0, "disk_bytes": 0}
        assert rows[NS_A] == {"pages": 3, "bytes": 3 * REC, "pinned_pages": 3,
                              "pinned_bytes": 3 * REC, "hits": 3, "misses": 0, **nodisk}
        assert rows[NS_B] == {"pages": 0, "bytes": 0, "pinned_pages": 0, "pinned_bytes": 0,
                              "hits": 0, "misses": 2, **nodisk}
        assert rows[NS_C] == {"pages": 5, "bytes": 5 * REC, "pinned_pages": 0,
                              "pinned_bytes": 0, "hits": 0, "misses": 0, **nodisk}
        assert st["totals"]["pinned_pages"] == 3 and st["totals"]["pages"] == 8
        table = admin(srv.url, "stats").stdout.splitlines()
        assert table[0].split() == ["namespace", "pages", "bytes", "disk_pages", "disk_bytes",
                                    "hits", "misses", "pinned_pages", "pinned_bytes"]
        assert table[1].split() == [NS_A[:16], "3", str(3 * REC), "0", "0", "3", "0", "3",
                                    str(3 * REC)]
        # Unpinned, A's pages are evicted like any others.
        assert admin_json(srv.url, "unpin", *ids_arg(ids_a), "--namespace", NS_A) == {
            "unpinned": 3}
        write(c, NS_C, keys_of(prompt(4, 8), NS_C))
        assert a.batch_exists(ka) == 0
        # clear --namespace removes that namespace only; clear --all the rest.
        assert admin_json(srv.url, "clear", "--namespace", NS_C) == {
            "namespace": NS_C, "deleted": 8, "unpinned": 0}
        assert c.server_stats()["pages"] == 0
        write(a, NS_A, ka)
        write(b, NS_B, kb)
        assert admin_json(srv.url, "pin", *ids_arg(ids_b), "--namespace", NS_B)["pinned"] == 2
        r = admin(srv.url, "clear", "--all")
        assert r.returncode == 0 and r.stdout.strip() == (
            "cleared *: 6 pages deleted, 2 pins dropped")
        st = admin_json(srv.url, "stats")["totals"]
        assert (st["pages"], st["pinned_pages"]) == (0, 0)
        assert admin(srv.url, "clear").returncode == 1  # neither --namespace nor --all
    finally:
        for x in (a, b, c):
            x.close()
        srv.stop()
    log = srv.log()
    assert f"admin: cleared namespace {NS_C} (8 pages, 0 pins)" in log
    assert "admin: cleared the whole server (6 pages, 2 pins)" in log


def test_a_pin_lease_ends_on_its_own(tmp_path: Path) -> None:
    srv = HiCacheServerProc(tmp_path, capacity=CAPACITY, args=["--admin-token", TOKEN]).start()
    a = client(srv.url, NS_A)
    adm = AdminClient(srv.url, TOKEN)
    try:
        ka = keys_of(prompt(1, 2), NS_A)
        write(a, NS_A, ka)
        r = adm.call(P.PinRequest(keys=ka, ttl_ms=300), P.PinReply)
        assert (r.pinned, r.absent, r.pinned_bytes) == (2, 0, 2 * REC)
        write(a, NS_A, keys_of(prompt(2, 7), NS_A))  # the pins hold: 6 of the 7 stay
        assert a.batch_exists(ka) == 2
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the lease is 0.3 s; bounded wait
            totals = adm.call(P.AdminStatsRequest(), P.AdminStatsReply).totals
            if totals["pinned_pages"] == 0:
                break
            time.sleep(0.1)
        assert totals["pinned_pages"] == 0 and totals["pins_expired"] == 2
        write(a, NS_A, keys_of(prompt(3, 8), NS_A))
        assert a.batch_exists(ka) == 0  # evicted like any page now
        with pytest.raises(AdminError, match="ttl_ms must be >= 0"):
            adm.call(P.PinRequest(keys=ka, ttl_ms=-1), P.PinReply)
    finally:
        adm.close()
        a.close()
        srv.stop()
    assert "2 pins' leases ended (first: " in srv.log()


def test_pins_persist_with_the_store_across_a_restart(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    srv = HiCacheServerProc(tmp_path, capacity=CAPACITY, persist_dir=disk,
                            args=["--admin-token", TOKEN]).start()
    try:
        a = client(srv.url, NS_A)
        ids = prompt(1, 3)
        ka = keys_of(ids, NS_A)
        recs = write(a, NS_A, ka)
        write(a, NS_A, keys_of(prompt(2, 3), NS_A))
        assert admin_json(srv.url, "pin", *ids_arg(ids), "--namespace", NS_A)["pinned"] == 3
        a.close()
        srv.restart()  # memory is empty; the pinned pages are read back from disk
        totals = admin_json(srv.url, "stats")["totals"]
        assert (totals["pages"], totals["pinned_pages"]) == (3, 3)
        assert json.loads((disk / "pins.json").read_text())["pins"] == {k: 0.0 for k in ka}
        a = client(srv.url, NS_A)
        write(a, NS_A, keys_of(prompt(3, 8), NS_A))  # pressure: the pins hold
        out = buffers(3, REC)
        assert a.batch_get(ka, out) == [True] * 3
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
        out = admin_json(srv.url, "lookup", *ids_arg(ids), "--namespace", NS_A)["server"]
        assert (out["pages"], out["in_memory_pages"], out["pinned_pages"]) == (3, 3, 3)
        a.close()
    finally:
        srv.stop()
