"""Attacks on `hicache-server` from the audit of issue 46, each kept fixed by a test that
makes it the way the audit did (in-process servers on a loopback port the OS picks, their
`handle()` fed the attacker's frames; the command line through `main` / `config_from_args`)."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_client.remote import protocol as P
from storage_backends.server.admin import MAX_MISS_ROWS, OTHER, NamespaceCounters
from storage_backends.server.cli import ServerConfig, config_from_args
from storage_backends.server.server import HiCacheServer, main
from storage_backends.server.tenants import Tenants, TenantsError
from tests.storage_backends.hicache_server_proc import codec, page_key, page_record

TOKEN = "attack-data-token-0001"
ADMIN = "attack-admin-token-0001"
TENANTS = '[tenants.a]\ntokens = ["tenant-a-token-00001"]\n'


@contextlib.contextmanager
def server(**kw: Any) -> Iterator[HiCacheServer]:
    srv = HiCacheServer(ServerConfig(**{"port": 0, "capacity_bytes": 64 << 20,
                                        "shm_max_bytes": 0, **kw}))
    try:
        yield srv
    finally:
        srv._shutdown()


def header(**fields: Any) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


# -- 1: memory exhaustion before any token check ----------------------------------------------


def _peak_decoding(srv: HiCacheServer, frames: list[bytes]) -> tuple[P.Message, int]:
    tracemalloc.start()
    try:
        reply = srv.handle(frames, b"attacker")
        return reply, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_header_of_a_million_empty_maps_is_refused_before_it_is_built() -> None:
    n = 1 << 20  # 1 MiB of header: ~80 MiB of dicts when decoded whole (633 MiB at 8 MiB)
    bomb = b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    with server(auth_token=TOKEN) as srv:
        reply, peak = _peak_decoding(srv, [bomb])
        assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.MALFORMED
        assert peak < 8 << 20, peak
        # The same inside a request's map (where the type checks would have run later).
        nested = header(v=1, t="get", id=5, auth="", keys=[{}] * 4096)
        reply, peak = _peak_decoding(srv, [nested])
        assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.MALFORMED
        assert peak < 8 << 20, peak


def test_header_bytes_and_list_lengths_are_capped() -> None:
    with server(auth_token=TOKEN, max_keys=100, max_header_bytes=4096) as srv:
        big = header(v=1, t="get", id=3, auth=TOKEN, keys=["k" * 100] * 50)
        reply = srv.handle([big])
        assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.MALFORMED
        assert "at most 4096" in reply.message
        many = header(v=1, t="exists", id=4, auth=TOKEN, keys=["k"] * 101)
        reply = srv.handle([many])
        assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.MALFORMED
        fine = srv.handle([header(v=1, t="exists", id=6, auth=TOKEN, keys=["k"] * 100)])
        assert isinstance(fine, P.ExistsReply) and fine.request_id == 6


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.binary(max_size=256),
    st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=8)
                 | st.binary(max_size=8),
                 lambda inner: st.lists(inner, max_size=4)
                 | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                 max_leaves=16).map(lambda v: msgpack.packb(v, use_bin_type=True)),
    st.fixed_dictionaries({"v": st.integers(0, 8), "t": st.sampled_from(sorted(P.SCHEMAS)),
                           "id": st.integers(-2**63, 2**64 - 1),
                           "keys": st.lists(st.text(max_size=4) | st.integers(-2**63, 2**64 - 1),
                                             max_size=3)})
    .map(lambda v: msgpack.packb(v, use_bin_type=True)),
), st.lists(st.binary(max_size=16), max_size=2))
def test_fuzz_the_wire_decoder_raises_only_protocol_errors(head: bytes,
                                                          payload: list[bytes]) -> None:
    for expect in ("request", "reply"):
        with contextlib.suppress(P.ProtocolError):
            P.decode([head, *payload], expect=expect)


# -- 11: the request id on every error, one log line ------------------------------------------


def test_a_token_proof_with_the_largest_request_id_is_answered_with_that_id(
        caplog: pytest.LogCaptureFixture) -> None:
    rid = 2**64 - 1
    with server(auth_token=TOKEN) as srv:
        hello = srv.handle(P.encode(P.HelloRequest(request_id=1, token_id=P.token_id(TOKEN),
                                                   client_nonce="ab" * 16)), b"c")
        assert isinstance(hello, P.HelloReply)
        proof = P.request_proof(TOKEN, bytes.fromhex(hello.nonce), rid, "exists")
        reply = srv.handle(P.encode(P.ExistsRequest(request_id=rid, token=proof, keys=["k"])),
                           b"c")
        assert isinstance(reply, P.ExistsReply) and reply.request_id == rid
        # An internal failure echoes the id and logs one line, no traceback.
        srv.tiers.exists = None  # type: ignore[assignment, method-assign]
        reply = srv.handle(P.encode(P.ExistsRequest(request_id=77, token=TOKEN, keys=["k"])))
        assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.INTERNAL
        assert reply.request_id == 77
        failed = [r for r in caplog.records if "request 77 failed" in r.getMessage()]
        assert len(failed) == 1 and not failed[0].exc_info


# -- 5, 13: tenants files, at start-up and on reload -------------------------------------------

BAD_TENANTS = [
    ("t.json", '{"tenants": {"a": {"tokens": ["tenant-a-token-00001"]}, '
               '"a": {"tokens": ["tenant-b-token-00001"]}}}', "named twice"),
    ("t.json", '{"tenants": {"a": {"tokens": ["\\ud800tenant-a-token-0001"]}}}', "not UTF-8"),
    ("t.json", '{"tenants": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ("t.json", '{"tenants": {"a": {"tokens": ' + "[" * 50 + "]" * 50 + "}}}",
     "nested too deeply"),
    ("t.toml", "[tenants.a]\ntokens = " + "[" * 50_000 + "]" * 50_000 + "\n",
     "nested too deeply"),
]


@pytest.mark.parametrize(("name", "text", "problem"), BAD_TENANTS)
def test_bad_tenants_files_are_one_line_errors(tmp_path: Path, name: str, text: str,
                                               problem: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    path.chmod(0o600)
    with pytest.raises(TenantsError, match=problem):
        Tenants(path)
    assert main(["--port", "0", "--no-shm", "--tenants-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hicache-server: error: tenants file") and "\n" not in err


@pytest.mark.parametrize(("name", "text", "problem"), BAD_TENANTS[:3])
def test_a_bad_tenants_file_on_reload_keeps_the_table_and_the_request_id(
        tmp_path: Path, name: str, text: str, problem: str) -> None:
    path = tmp_path / name
    path.write_text(TENANTS if name.endswith(".toml") else json.dumps(
        {"tenants": {"a": {"tokens": ["tenant-a-token-00001"]}}}))
    path.chmod(0o600)
    with server(tenants_file=str(path), admin_token=ADMIN) as srv:
        assert srv.tenants is not None
        before = dict(srv.tenants.table)
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        srv.ask_reload()  # what SIGHUP does: the loop reloads before the next request
        assert srv.reload_tenants()[0] is False
        reply = srv.handle(P.encode(P.ReloadTenantsRequest(request_id=41, token=ADMIN)))
        assert isinstance(reply, P.ErrorReply) and reply.request_id == 41
        assert problem in reply.message
        assert srv.tenants.table == before and srv.tenants.reload_failures == 2


# -- 12: bad command lines: one line, exit 2 ---------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--port", "99999"], ["--port", "-1"], ["--metrics-port", "99999"], ["--io-threads", "0"],
    ["--persist-queue", "0"], ["--max-frame-bytes", "0"], ["--max-keys", "-1"],
    ["--max-header-bytes", "0"], ["--host", "256.1.1.1"],
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        config_from_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hicache-server: error: ") and argv[0] in err[-1]


def test_a_persist_dir_naming_a_file_exits_2(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        config_from_args(["--persist-dir", str(f)])
    assert e.value.code == 2
    assert main(["--port", "0", "--no-shm", "--persist-dir", str(f / "under")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("hicache-server: error:")


# -- 8: private persistence --------------------------------------------------------------------


def test_persisted_pages_and_pins_are_private(tmp_path: Path) -> None:
    from tests.storage_backends.hicache_server_proc import RawClient, hicache_server

    persist = tmp_path / "persist"
    persist.mkdir(mode=0o755)  # as an older server, or the operator, left it
    with hicache_server(tmp_path, persist_dir=persist, args=["--admin-token", ADMIN]) as srv:
        c = RawClient(srv.url)
        try:
            key, record = page_key("ns", 0), page_record(codec(), "ns", 0)
            assert c.set([key], [bytes(record)]) == [True]
            assert isinstance(c.ask(P.PinRequest(request_id=2, token=ADMIN, keys=[key],
                                                 ttl_ms=60_000)), P.PinReply)
        finally:
            c.close()
    found = [persist, *persist.rglob("*")]
    assert any(p.is_file() and p.name != "pins.json" for p in found)
    assert any(p.name == "pins.json" for p in found)
    for p in found:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode & 0o077 == 0, (p, oct(mode))
    # In process (no main: no umask), the top folder alone closes the tree to others.
    inproc = tmp_path / "inproc"
    with server(persist_dir=str(inproc)):
        pass
    assert stat.S_IMODE(inproc.stat().st_mode) == 0o700


# -- 10: bounded stats rows --------------------------------------------------------------------


def test_bind_namespace_misses_do_not_grow_the_stats_rows() -> None:
    with server(admin_token=ADMIN) as srv:
        for i in range(3 * MAX_MISS_ROWS):
            ns = f"{i:064x}"
            ident = f"conn-{i}".encode()
            assert isinstance(srv.handle(P.encode(P.BindNamespaceRequest(
                request_id=1, namespace=ns)), ident), P.BindNamespaceReply)
            srv.handle(P.encode(P.GetRequest(request_id=2, keys=[f"{i:064x}"])), ident)
        rows = srv.tiers.namespaces.misses
        assert len(rows) == MAX_MISS_ROWS + 1 and rows[OTHER] == 2 * MAX_MISS_ROWS


def test_bindings_are_bounded() -> None:
    counters = NamespaceCounters()
    from storage_backends.server import admin

    for i in range(admin.MAX_BOUND + 10):
        counters.bind(i.to_bytes(4, "big"), "a" * 64)
    assert len(counters.bound) == admin.MAX_BOUND
    assert (0).to_bytes(4, "big") not in counters.bound


def test_json_tenants_file_of_a_good_table_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tenants": {"a": {"tokens": ["tenant-a-token-00001"]}}}))
    path.chmod(0o600)
    assert Tenants(path).names() == ["a"]


# -- 6: per-tenant reply budgets ---------------------------------------------------------------


class _Unread:
    done = False  # a reply its client never reads: ZeroMQ never finishes with it


def test_one_tenants_unread_replies_do_not_make_every_tenant_busy() -> None:
    from storage_backends.server.budget import ReplyBudget

    mib = 1 << 20
    budget = ReplyBudget(total_bytes=96 * mib, per_client_bytes=8 * mib)
    budget.set_groups(2)  # two partitions: 48 MiB each
    for i in range(12):  # 12 connections of tenant A that never read their get replies
        ident = f"a-{i}".encode()
        budget.assign(ident, "tag-a")
        while budget.fits(ident, 4 * mib):
            budget.sent(ident, _Unread(), 4 * mib)
    assert budget.held == 48 * mib  # A's share, not the whole 96 MiB
    budget.assign(b"b", "tag-b")
    assert budget.fits(b"b", 8 * mib)  # tenant B is still served
    assert not budget.park(b"a-0", object(), 1) and budget.park(b"b", object(), 1)


# -- 3, 4: shared-memory regions ---------------------------------------------------------------


def test_a_data_token_cannot_attach_the_servers_own_store_as_its_region() -> None:
    from storage_backends.server.arena import supported

    if not supported():
        pytest.skip("the shared-memory store needs x86-64")
    with server(auth_token=TOKEN, shm_max_bytes=1 << 30, shm_store_bytes=8 << 20) as srv:
        store = srv.handle(P.encode(P.MapStoreRequest(request_id=1, token=TOKEN)), b"c")
        assert isinstance(store, P.MapStoreReply)
        reply = srv.handle(P.encode(P.AttachShmRequest(request_id=2, token=TOKEN,
                                                       name=store.name, size=store.size)), b"c")
        assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.NO_SHM
        assert reply.request_id == 2
        # The refusal reads as one for a file that is not there: no /dev/shm facts.
        absent = srv.handle(P.encode(P.AttachShmRequest(
            request_id=3, token=TOKEN, name=f"hicache-absent-{os.getpid()}", size=store.size)),
            b"c")
        assert isinstance(absent, P.ErrorReply)
        assert absent.message == reply.message.replace(store.name, f"hicache-absent-{os.getpid()}")
        dump = srv.handle(P.encode(P.ShmGetRequest(request_id=4, token=TOKEN, keys=["k"],
                                                   offsets=[0], capacities=[16])), b"c")
        assert isinstance(dump, P.ErrorReply) and dump.code == P.ErrorCode.NO_SHM


def test_a_region_is_its_tenants_not_its_routing_ids(tmp_path: Path) -> None:
    from hicache_client.remote.shm import ClientRegion

    tok_a, tok_b = "tenant-a-token-00001", "tenant-b-token-00001"
    path = tmp_path / "t.toml"
    path.write_text(f'[tenants.a]\ntokens = ["{tok_a}"]\n[tenants.b]\ntokens = ["{tok_b}"]\n')
    path.chmod(0o600)
    region = ClientRegion(1 << 16)
    try:
        with server(tenants_file=str(path), shm_max_bytes=1 << 30) as srv:
            ident = b"routing-id-of-b"
            assert isinstance(srv.handle(P.encode(P.AttachShmRequest(
                request_id=1, token=tok_b, name=region.name, size=region.size)), ident),
                P.AttachShmReply)
            # B's connection dies without detach_shm; A connects with B's routing id.
            for req in (P.ShmGetRequest(request_id=2, token=tok_a, keys=["k"], offsets=[0],
                                        capacities=[16]),
                        P.ShmSetRequest(request_id=3, token=tok_a, keys=["k"], offsets=[0],
                                        lengths=[16])):
                reply = srv.handle(P.encode(req), ident)
                assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.NO_SHM
            mine = srv.handle(P.encode(P.ShmGetRequest(request_id=4, token=tok_b, keys=["k"],
                                                       offsets=[0], capacities=[16])), ident)
            assert isinstance(mine, P.ShmGetReply) and mine.lengths == [-1]
    finally:
        region.close()


# -- 2: memory a page holds beyond its record -------------------------------------------------


def test_huge_keys_are_refused_so_uncounted_key_bytes_stay_small() -> None:
    from storage_backends.server.server import MAX_KEY_CHARS

    with server() as srv:
        big = "k" * (1 << 20)  # 100 such keys of empty pages held 403 MiB counted as 0
        for req in (P.SetRequest(request_id=9, keys=[big], frames=[b""]),
                    P.GetRequest(request_id=10, keys=[big])):
            reply = srv.handle(P.encode(req))
            assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.TOO_LARGE
            assert reply.request_id == req.request_id
        assert srv.store.pages == 0
        ok = srv.handle(P.encode(P.SetRequest(request_id=11, keys=["k" * MAX_KEY_CHARS],
                                              frames=[b"x" * 200])))
        assert isinstance(ok, P.SetReply) and ok.stored == [True]
