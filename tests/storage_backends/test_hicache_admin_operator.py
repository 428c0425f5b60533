"""The defects found when `hicache-server` and `hicache-admin` were tried as an operator would
(issue 38): a data token's whole-server `clear`, pins lost on a clean restart with a disk cap,
`hicache-admin`'s bad input, and what an operator sees (pins, disk-tier stats, Prometheus, the
log). Real server processes on loopback ports the tests pick; the CLI run as its console
script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from hicache_client.backend import StorageConfig
from hicache_client.remote import protocol as P
from hicache_client.remote.backend import HiCacheServerBackend
from tests.procs import free_port
from tests.storage_backends.conftest import buffers
from tests.storage_backends.hicache_server_proc import HiCacheServerProc, RawClient
from tests.storage_backends.test_hicache_admin import (
    NS_A,
    NS_B,
    REC,
    TOKEN,
    admin,
    admin_json,
    client,
    ids_arg,
    keys_of,
    prompt,
    write,
)


def one_line_error(r: subprocess.CompletedProcess[str], status: int, text: str) -> None:
    assert r.returncode == status, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert text in r.stderr, r.stderr


def test_a_data_token_cannot_clear_the_whole_server(tmp_path: Path) -> None:
    srv = HiCacheServerProc(tmp_path, capacity=str(64 * REC), auth_token="datatok",
                            args=["--admin-token", TOKEN]).start()
    a = HiCacheServerBackend(StorageConfig(
        extra={"url": srv.url, "timeout_ms": 5000, "auth_token": "datatok"}, namespace=NS_A))
    ka = keys_of(prompt(1, 3), NS_A)
    raw = RawClient(srv.url)
    try:
        write(a, NS_A, ka)
        r = raw.call(P.ClearRequest(token="datatok"))
        assert isinstance(r, P.ErrorReply) and r.code == P.ErrorCode.UNAUTHORIZED
        assert r.message == ("clear empties every namespace: it takes the admin token "
                             "(--admin-token), not the data token")
        assert a.batch_exists(ka) == 3  # nothing was cleared
        assert isinstance(raw.call(P.ClearRequest(token=TOKEN)), P.ClearReply)
        assert a.batch_exists(ka) == 0
    finally:
        raw.close()
        a.close()
        srv.stop()
    assert srv.log().count("cleared by a client") == 1  # the admin's clear only


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_pins_survive_a_flood_and_a_clean_restart_with_a_disk_cap(tmp_path: Path) -> None:
    """Pin 11 pages, flood the server past its disk cap, SIGTERM, restart: the 11 pages are
    still pinned, in memory and on disk; the flood's survivors are on disk only, and stats,
    the pin list and Prometheus say so."""
    disk = tmp_path / "disk"
    mport = free_port()
    srv = HiCacheServerProc(tmp_path, capacity=str(32 * REC), persist_dir=disk,
                            metrics_port=mport,
                            args=["--admin-token", TOKEN, "--persist-capacity", str(24 * REC)])
    srv.start()
    ids_a = prompt(1, 11)
    ka, kb = keys_of(ids_a, NS_A), keys_of(prompt(2, 60), NS_B)
    try:
        a, b = client(srv.url, NS_A), client(srv.url, NS_B)
        recs_a = write(a, NS_A, ka)
        # The pin limit is half the smaller tier (the 24-page disk): 12 pages.
        out = admin_json(srv.url, "pin", *ids_arg(ids_a), "--namespace", NS_A)
        assert out == {"pinned": 11, "absent": 0, "pinned_bytes": 11 * REC,
                       "limit_bytes": 12 * REC, "ttl_s": None}
        for i in range(0, 60, 10):  # the flood, in batches
            write(b, NS_B, kb[i:i + 10])
        a.close()
        b.close()
        assert srv.stop() == 0
        for k in ka:  # the disk's LRU kept the pinned pages' files
            assert (disk / k[:2] / k[2:4] / k).stat().st_size == REC
        srv.start()
        assert sorted(json.loads((disk / "pins.json").read_text())["pins"]) == sorted(ka)
        st = admin_json(srv.url, "stats")
        assert st["namespaces"] == {
            NS_A: {"pages": 11, "bytes": 11 * REC, "disk_pages": 11, "disk_bytes": 11 * REC,
                   "pinned_pages": 11, "pinned_bytes": 11 * REC, "hits": 0, "misses": 0},
            NS_B: {"pages": 0, "bytes": 0, "disk_pages": 13, "disk_bytes": 13 * REC,
                   "pinned_pages": 0, "pinned_bytes": 0, "hits": 0, "misses": 0}}
        a, b = client(srv.url, NS_A), client(srv.url, NS_B)
        got = buffers(11, REC)
        assert a.batch_get(ka, got) == [True] * 11
        assert [bytes(g) for g in got] == [bytes(r) for r in recs_a]
        # The flood's last 13 pages are on disk: reads of them are hits, not misses.
        assert b.batch_get(kb[47:], buffers(13, REC)) == [True] * 13
        assert b.batch_get(kb[:2], buffers(2, REC)) == [False, False]
        st = admin_json(srv.url, "stats")
        t = st["totals"]
        assert (t["hits"], t["misses"], t["memory_hits"], t["disk_hits"]) == (24, 2, 11, 13)
        assert (st["namespaces"][NS_B]["hits"], st["namespaces"][NS_B]["misses"]) == (13, 2)
        table = admin(srv.url, "stats").stdout.splitlines()
        assert table[-2].split()[:5] == ["total", "24", str(24 * REC), "24", str(24 * REC)]
        # The pin list: the 11 pinned pages, no lease; then one with a lease.
        pins = admin_json(srv.url, "pins")
        assert pins["limit_bytes"] == 12 * REC
        assert pins["pins"] == sorted(({"key": k, "namespace": NS_A, "bytes": REC,
                                        "ttl_left_s": None} for k in ka),
                                      key=lambda x: x["key"])
        text = admin(srv.url, "pins").stdout.splitlines()
        assert text[0].split() == ["namespace", "key", "bytes", "ttl_left_s"]
        assert text[-1] == f"11 pins, {11 * REC} of at most {12 * REC} bytes"
        # A pin of pages the server does not hold is refused whole, exit 1: nothing pinned.
        r = admin(srv.url, "pin", *ids_arg(prompt(3, 11)), "--namespace", NS_A)
        one_line_error(r, 1, "pin refused: the server holds 0 of the prompt's 11 pages, "
                             "pinned 0 (--allow-partial pins the ones held)")
        r = admin(srv.url, "pin", *ids_arg(prompt(3, 11)), "--namespace", NS_A,
                  "--allow-partial")
        one_line_error(r, 1, "pin refused: the server holds 0 of the prompt's 11 pages, "
                             "pinned 0")
        # A pin with a lease shows the seconds left.
        assert admin_json(srv.url, "unpin", *ids_arg(ids_a), "--namespace", NS_A) == {
            "unpinned": 11}
        assert admin_json(srv.url, "pin", *ids_arg(ids_a), "--namespace", NS_A,
                          "--ttl", "3600")["pinned"] == 11
        left = {x["ttl_left_s"] for x in admin_json(srv.url, "pins")["pins"]}
        assert len(left) == 1 and 3000 < left.pop() <= 3600
        metrics = scrape(mport)
        assert metrics["hicache_server_pinned_pages"] == 11
        assert metrics["hicache_server_pinned_bytes"] == 11 * REC
        assert metrics["hicache_server_pin_limit_bytes"] == 12 * REC
        assert metrics["hicache_server_read_leases"] == 0
        assert metrics["hicache_server_disk_hits"] == 13
        for ns, tier, pages in ((NS_A, "memory", 11), (NS_A, "disk", 11),
                                (NS_B, "memory", 13), (NS_B, "disk", 13)):
            label = f'{{namespace="{ns}",tier="{tier}"}}'
            assert metrics[f"hicache_server_namespace_pages{label}"] == pages
            assert metrics[f"hicache_server_namespace_bytes{label}"] == pages * REC
        a.close()
        b.close()
        # A pinned page's file gone while the server was down: that pin is dropped, logged.
        srv.stop()
        (disk / ka[0][:2] / ka[0][2:4] / ka[0]).unlink()
        srv.start()
        assert admin_json(srv.url, "stats")["totals"]["pinned_pages"] == 10
    finally:
        srv.stop()
    assert f"dropped 1 of 11 pins: their pages are gone (first: {ka[0][:16]})" in srv.log()


def test_hicache_admin_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    base = ["pin", "--token-ids", "1,2,3,4,5"]
    ns = ["--namespace", NS_A]
    url = f"tcp://127.0.0.1:{free_port()}"
    cases = [
        ([*base, "--namespace", "zz", "--page-size", "4"], "--namespace: 64 hex characters"),
        ([*base, "--namespace", "abcd", "--page-size", "4"], "--namespace: 64 hex characters"),
        ([*base, *ns, "--page-size", "0"], "--page-size must be > 0, got 0"),
        ([*base, *ns, "--page-size", "-4"], "--page-size must be > 0, got -4"),
        ([*base, *ns, "--page-size", "x"], "--page-size: an integer, not 'x'"),
        ([*base, *ns, "--page-size", "4", "--ttl", "nan"], "--ttl must be a finite number"),
        ([*base, *ns, "--page-size", "4", "--ttl", "inf"], "--ttl must be a finite number"),
        ([*base, *ns, "--page-size", "4", "--ttl", "0"], "--ttl must be a finite number"),
        ([*base, *ns, "--page-size", "4", "--ttl", "1e300"], "--ttl 1e300: too long"),
        (["clear", "--namespace", "zz"], "--namespace: 64 hex characters"),
        ([*base, *ns, "--page-size", "4", "--engine", "127.0.0.1:8000"],
         "--engine: an engine's HTTP URL"),
    ]
    for args, text in cases:
        one_line_error(admin(url, *args), 2, text)
    for bad in ("http://127.0.0.1:8000", "tcp://127.0.0.1", "127.0.0.1:7480"):
        one_line_error(admin(bad, "stats"), 2, "--url: ")
    one_line_error(admin(url, "--timeout-ms", "0", "stats"), 2, "--timeout-ms must be > 0")
    # Issue 46: these traced back.
    one_line_error(admin(url, "--timeout-ms", "99999999999999", "stats"), 2,
                   "--timeout-ms must be below 2147483648")
    one_line_error(admin(url, "pin", "--token-ids", "99999999999", *ns, "--page-size", "1"), 1,
                   "--token-ids: 99999999999 is not a token id")


def test_hicache_admin_output_into_a_closed_pipe(tmp_path: Path) -> None:
    """`hicache-admin --json stats | head -c0`: the reader is gone before anything is written."""
    srv = HiCacheServerProc(tmp_path, capacity=str(8 * REC), args=["--admin-token", TOKEN])
    srv.start()
    rd, wr = os.pipe()
    os.close(rd)  # no reader: the first write fails with EPIPE
    try:
        env = {**os.environ, "HICACHE_SERVER_ADMIN_TOKEN": TOKEN}
        r = subprocess.run([sys.executable, "-m", "storage_backends.server.admin_cli", "--url",
                            srv.url, "--json", "stats"], stdout=wr, stderr=subprocess.PIPE,
                           text=True, env=env, timeout=120)
    finally:
        os.close(wr)
        srv.stop()
    one_line_error(r, 1, "hicache-admin: output closed early (broken pipe)")


def test_a_tiny_ttl_is_a_lease_not_a_pin_forever(tmp_path: Path) -> None:
    """--ttl 0.0004 is a 1 ms lease, never rounded down to 0 (the server's "no lease")."""
    srv = HiCacheServerProc(tmp_path, capacity=str(8 * REC), args=["--admin-token", TOKEN])
    srv.start()
    a = client(srv.url, NS_A)
    try:
        ids = prompt(1, 1)
        write(a, NS_A, keys_of(ids, NS_A))
        out = admin_json(srv.url, "pin", *ids_arg(ids), "--namespace", NS_A, "--ttl", "0.0004")
        assert out["pinned"] == 1
        pins = admin_json(srv.url, "pins")["pins"]
        assert pins == [] or pins[0]["ttl_left_s"] is not None  # leased, maybe ended already
    finally:
        a.close()
        srv.stop()


def test_the_file_tiers_cap_never_evicts_a_kept_page(tmp_path: Path) -> None:
    """`FileBackend.keep` (the server's pins): the LRU skips kept pages' files, and a page that
    could only fit by evicting one is refused (False), evicting nothing."""
    from storage_backends.file_backend import FileBackend

    fb = FileBackend(StorageConfig(extra={"path": str(tmp_path / "d"),
                                          "capacity_bytes": 3 * 100}))
    keys = [f"{i:02x}" * 8 for i in range(6)]
    kept = {keys[0]}
    fb.keep = kept.__contains__
    page = memoryview(bytes(100))
    assert fb.batch_set(keys[:3], [page] * 3) == [True] * 3
    assert fb.batch_set([keys[3]], [page]) == [True]  # evicts keys[1], the oldest not kept
    assert [fb.batch_exists([k]) for k in keys[:4]] == [1, 0, 1, 1]
    kept.update(keys[2:4])
    assert fb.batch_set([keys[4]], [page]) == [False]  # only kept pages could make room
    assert [fb.batch_exists([k]) for k in keys[:5]] == [1, 0, 1, 1, 0]
    kept.discard(keys[2])
    assert fb.batch_set([keys[4]], [page]) == [True]
    assert [fb.batch_exists([k]) for k in keys[:5]] == [1, 0, 0, 1, 1]
    fb.close()
