"""`hicache-server` memory under clients that never read their replies.

The documented bound (docs/hicache-server.md, "Memory"): the server holds at most `--capacity`
bytes of pages plus `--reply-budget` bytes for its clients (replies not yet written to a socket
and requests waiting for room). Measured here on the real server process (VmRSS in /proc), with
two clients that pipeline thousands of gets and never read, and one that repeats one key 10,000
times per request (refused: repeated keys would multiply a page in the reply).
"""

from __future__ import annotations

from pathlib import Path

import zmq

from hicache_client.remote import protocol as P
from tests.procs import wait_until
from tests.reliability.test_server_fuzz import rss_kib
from tests.storage_backends.hicache_server_proc import HiCacheServerProc, page_key

CAPACITY = 64 << 20
REPLY_BUDGET = 32 << 20
CLIENT_BUDGET = 8 << 20  # two non-readers hold at most half the total: others are served
PAGE = 60_000  # under 64 KiB: such pages are copied into each reply
PAGES = 1000  # 57 MiB, within the capacity
SLACK = 24 << 20  # allocator and interpreter slack on top of the documented bound
GETS = 3000  # per hostile connection, 64 distinct keys (3.7 MiB of pages) each


def _page(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (PAGE // 4 + 1))[:PAGE]


def _hostile(ctx: zmq.Context, url: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)  # read (almost) nothing: replies stay on the server's side
    s.setsockopt(zmq.RCVBUF, 64 << 10)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(url)
    return s


def test_clients_that_do_not_read_keep_rss_within_capacity_plus_reply_budget(
    tmp_path: Path,
) -> None:
    srv = HiCacheServerProc(
        tmp_path,
        capacity=str(CAPACITY),
        args=[
            "--reply-budget", str(REPLY_BUDGET),
            "--client-reply-budget", str(CLIENT_BUDGET),
            "--max-frame-bytes", str(1 << 20),
        ],
    ).start()
    ctx = zmq.Context()
    good = srv.client()
    hostile: list[zmq.Socket] = []
    try:
        keys = [page_key("m", i) for i in range(PAGES)]
        for start in range(0, PAGES, 50):
            part = list(range(start, start + 50))
            ok = good.batch_set([keys[i] for i in part], [memoryview(_page(i)) for i in part])
            assert ok == [True] * len(part)
        before = good.server_stats()
        assert before["pages"] == PAGES and before["bytes"] == PAGES * PAGE
        rss0 = rss_kib(srv.proc.pid) << 10  # type: ignore[union-attr]

        sent = 0
        dup = _hostile(ctx, srv.url)
        hostile.append(dup)
        for r in range(6):  # one key 10,000 times: refused, not 10,000 copies of a page
            dup.send_multipart(P.encode(P.GetRequest(request_id=r + 1, keys=[keys[0]] * 10_000)))
            sent += 1
        for _ in range(2):
            s = _hostile(ctx, srv.url)
            hostile.append(s)
            for r in range(GETS):
                first = (r * 64) % (PAGES - 64)
                s.send_multipart(
                    P.encode(P.GetRequest(request_id=r + 1, keys=keys[first : first + 64]))
                )
                sent += 1
        # Every request has reached the server: answered, waiting, or refused as busy.
        wait_until(
            lambda: good.server_stats()["requests"] >= before["requests"] + 1 + sent,
            timeout=300,
            what="all hostile requests received",
        )
        st = good.server_stats()
        rss = rss_kib(srv.proc.pid) << 10  # type: ignore[union-attr]
        assert st["reply_held_bytes"] <= REPLY_BUDGET
        assert st["reply_held_peak_bytes"] <= REPLY_BUDGET
        assert st["requests_refused_busy"] > 0  # the rest were turned away, not buffered
        assert st["error_replies"] >= 6 + st["requests_refused_busy"]
        # The documented bound: pages (already in rss0) + the reply budget.
        assert rss - rss0 <= REPLY_BUDGET + SLACK, (rss0, rss, st)

        # A well-behaved client is still served, bit for bit, while the others hold theirs.
        polite = ctx.socket(zmq.DEALER)
        polite.setsockopt(zmq.LINGER, 0)
        polite.connect(srv.url)
        polite.send_multipart(P.encode(P.GetRequest(request_id=7, keys=keys[:8])))
        assert polite.poll(60000)
        reply = P.decode(polite.recv_multipart(), expect="reply")
        polite.close(0)
        assert isinstance(reply, P.GetReply) and reply.lengths == [PAGE] * 8
        assert [bytes(f) for f in reply.frames] == [_page(i) for i in range(8)]
        # Dropping the hostile connections frees what was held for them.
        for s in hostile:
            s.close(0)
        hostile.clear()
        wait_until(lambda: good.server_stats()["reply_held_bytes"] == 0, timeout=120,
                   what="held reply bytes released")
        assert srv.alive()
    finally:
        for s in hostile:
            s.close(0)
        good.close()
        ctx.destroy(linger=0)
        srv.stop()
    assert "Traceback" not in srv.log()
