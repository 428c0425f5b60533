"""Tenants on one `hicache-server` (`--tenants-file`): two tenants with the same keys and the same
record namespace try every message type on each other's pages and get a miss or a refusal; the
persistence directory keeps partitions apart across a restart; the tenants file is reloaded on
SIGHUP and by the admin call, and a removed token is refused from the next request on."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_client.errors import ConfigError
from hicache_client.remote import protocol as P
from storage_backends.server.tenants import (
    Tenants,
    TenantsError,
    parse_tenants,
    partition_tag,
)
from tests.procs import free_port, wait_until
from tests.storage_backends.conftest import NAMESPACE, buffers
from tests.storage_backends.hicache_server_proc import (
    HiCacheServerProc,
    RawClient,
    client_of,
    codec,
    hicache_server,
    page_record,
    pages,
)
from tests.storage_backends.test_hicache_admin_operator import scrape

TOK_A = "tenant-a-token-0001"
TOK_A2 = "tenant-a-token-0002"
TOK_B = "tenant-b-token-0001"
TOK_A_READER = "tenant-a-reader-0001"
ADMIN = "admin-token-000001"
N = 6


def tenants_toml(a_tokens: list[str]) -> str:
    quoted = ", ".join(f'"{t}"' for t in a_tokens)
    return f"""
[tenants.team-a]
tokens = [{quoted}]

[tenants.team-b]
rights = ["read", "write", "clear"]
tokens = ["{TOK_B}"]

[tenants.team-a-readers]
namespace = "team-a"
rights = ["read"]
tokens = ["{TOK_A_READER}"]
"""


def write_tenants(path: Path, a_tokens: list[str]) -> Path:
    path.write_text(tenants_toml(a_tokens))
    path.chmod(0o600)
    return path


def tenants_server(tmp_path: Path) -> contextlib.AbstractContextManager[HiCacheServerProc]:
    """A server with the two tenants (A holding TOK_A), an admin token and persistence."""
    tfile = write_tenants(tmp_path / "tenants.toml", [TOK_A])
    args = ["--tenants-file", str(tfile), "--admin-token", ADMIN]
    return hicache_server(tmp_path, persist_dir=tmp_path / "persist", args=args)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[HiCacheServerProc]:
    with tenants_server(tmp_path) as srv:
        yield srv


@pytest.fixture
def raw(server: HiCacheServerProc) -> Iterator[Any]:
    made: list[RawClient] = []

    def make(token: str) -> RawClient:
        c = RawClient(server.url)
        made.append(c)
        c.token = token  # type: ignore[attr-defined]
        return c

    yield make
    for c in made:
        c.close()


def ask(c: RawClient, req: P.Request) -> P.Message:
    req.token = c.token  # type: ignore[attr-defined]
    reply = c.call(req)
    assert reply is not None, f"no reply to {req.TYPE}"
    return reply


def error_code(reply: P.Message) -> str:
    assert isinstance(reply, P.ErrorReply), reply
    return reply.code


def test_two_tenants_with_the_same_keys_never_see_each_others_pages(
        server: HiCacheServerProc, raw: Any) -> None:
    keys, recs_a = pages("a", N, 1000)
    # Other payloads under the same keys, in the same record namespace.
    recs_b = [page_record(codec(1000), "a", i, version=1) for i in range(N)]
    a, b = client_of(server.url, TOK_A), client_of(server.url, TOK_B)
    try:
        assert a.batch_set(keys, [memoryview(r) for r in recs_a]) == [True] * N
        # B: exists, get (region path and TCP), stats: A's pages are absent.
        assert b.batch_exists(keys) == 0
        out = buffers(N, len(recs_a[0]))
        assert b.batch_get(keys, out) == [False] * N
        rb = raw(TOK_B)
        assert ask(rb, P.ExistsRequest(keys=keys)) == P.ExistsReply(request_id=rb.rid, count=0)
        got = ask(rb, P.GetRequest(keys=keys))
        assert isinstance(got, P.GetReply) and got.lengths == [-1] * N and got.frames == []
        assert ask(rb, P.StatsRequest()) == P.StatsReply(request_id=rb.rid,
                                                         stats={"pages": 0, "bytes": 0,
                                                                "max_bytes": 0})
        # B: delete, namespace clear and clear reach nothing of A's.
        assert ask(rb, P.DeleteRequest(keys=keys)) == P.DeleteReply(request_id=rb.rid,
                                                                    deleted=0)
        ns = ask(rb, P.ClearNamespaceRequest(namespace=NAMESPACE.hex()))
        assert ns == P.ClearNamespaceReply(request_id=rb.rid, deleted=0)
        assert isinstance(ask(rb, P.ClearRequest()), P.ClearReply)
        # The shared-memory store (it maps every partition) is refused to tenants.
        for req in (P.MapStoreRequest(), P.ShmLocateRequest(arena_id=1, keys=keys),
                    P.ShmReserveRequest(arena_id=1, lengths=[1128]),
                    P.ShmCommitRequest(arena_id=1, keys=keys[:1], offsets=[0]),
                    P.ShmReleaseRequest(arena_id=1, offsets=[0])):
            assert error_code(ask(rb, req)) == P.ErrorCode.NO_SHM, req.TYPE
        assert a.batch_exists(keys) == N
        assert a.batch_get(keys, out) == [True] * N
        assert [bytes(o) for o in out] == [bytes(r) for r in recs_a]
        # B writes the same keys: its own pages, A's are not overwritten.
        assert b.batch_set(keys, [memoryview(r) for r in recs_b]) == [True] * N
        assert a.batch_get(keys, out) == [True] * N
        assert [bytes(o) for o in out] == [bytes(r) for r in recs_a]
        assert b.batch_get(keys, out) == [True] * N
        assert [bytes(o) for o in out] == [bytes(r) for r in recs_b]
        size = len(recs_b[0])
        assert ask(rb, P.StatsRequest()) == P.StatsReply(
            request_id=rb.rid, stats={"pages": N, "bytes": N * size, "max_bytes": 0})
        # B's clear empties B's partition only.
        assert ask(rb, P.ClearNamespaceRequest(namespace=NAMESPACE.hex())) == \
            P.ClearNamespaceReply(request_id=rb.rid, deleted=N)
        assert b.batch_exists(keys) == 0 and a.batch_exists(keys) == N
    finally:
        a.close()
        b.close()


def test_rights_and_unknown_tokens(server: HiCacheServerProc, raw: Any) -> None:
    keys, recs = pages("a", N, 1000)
    ra, reader, stranger = raw(TOK_A), raw(TOK_A_READER), raw("not-a-tenant-token-01")
    stored = ask(ra, P.SetRequest(keys=keys, frames=[bytes(r) for r in recs]))
    assert stored == P.SetReply(request_id=ra.rid, stored=[True] * N)
    # A read-only tenant of the same partition reads A's pages and can change nothing.
    got = ask(reader, P.GetRequest(keys=keys))
    assert isinstance(got, P.GetReply) and [bytes(f) for f in got.frames] == \
        [bytes(r) for r in recs]
    for req in (P.SetRequest(keys=keys[:1], frames=[bytes(recs[0])]),
                P.DeleteRequest(keys=keys), P.ClearRequest(),
                P.ClearNamespaceRequest(namespace=NAMESPACE.hex())):
        assert error_code(ask(reader, req)) == P.ErrorCode.FORBIDDEN, req.TYPE
    for req in (P.PingRequest(), P.ExistsRequest(keys=keys), P.GetRequest(keys=keys),
                P.StatsRequest()):
        assert error_code(ask(stranger, req)) == P.ErrorCode.UNAUTHORIZED, req.TYPE
    # A tenant token is no admin token.
    assert error_code(ask(ra, P.ReloadTenantsRequest())) == P.ErrorCode.UNAUTHORIZED
    assert ask(ra, P.ExistsRequest(keys=keys)) == P.ExistsReply(request_id=ra.rid, count=N)
    # The backend names a wrong token at start-up.
    with pytest.raises(ConfigError, match=r"does not know \(missing or wrong auth token\)"):
        client_of(server.url, "not-a-tenant-token-01")


def test_partitions_survive_a_restart_and_files_name_their_partition(
        server: HiCacheServerProc, raw: Any, tmp_path: Path) -> None:
    keys, recs = pages("a", N, 1000)
    ra = raw(TOK_A)
    assert ask(ra, P.SetRequest(keys=keys, frames=[bytes(r) for r in recs])) == \
        P.SetReply(request_id=ra.rid, stored=[True] * N)
    server.restart()
    ra2, rb = raw(TOK_A), raw(TOK_B)
    assert ask(rb, P.ExistsRequest(keys=keys)) == P.ExistsReply(request_id=rb.rid, count=0)
    got = ask(ra2, P.GetRequest(keys=keys))
    assert isinstance(got, P.GetReply) and [bytes(f) for f in got.frames] == \
        [bytes(r) for r in recs]
    names = sorted(p.name for p in (tmp_path / "persist").rglob("*") if p.is_file()
                   and not p.name.endswith((".json", ".tmp")))
    tag = partition_tag("team-a")
    assert names == sorted(tag + k for k in keys)


def test_rotation_by_sighup_and_by_the_admin_call(server: HiCacheServerProc, raw: Any,
                                                  tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    keys, recs = pages("a", N, 1000)
    old = raw(TOK_A)
    assert ask(old, P.SetRequest(keys=keys, frames=[bytes(r) for r in recs])) == \
        P.SetReply(request_id=old.rid, stored=[True] * N)
    tfile = tmp_path / "tenants.toml"
    # Add the new token next to the old one: both work.
    write_tenants(tfile, [TOK_A, TOK_A2])
    assert server.proc is not None and server.proc.proc is not None
    os.kill(server.proc.proc.pid, signal.SIGHUP)
    new = raw(TOK_A2)
    wait_until(lambda: isinstance(ask(new, P.PingRequest()), P.PingReply),
               what="the new token accepted after SIGHUP")
    assert ask(new, P.ExistsRequest(keys=keys)) == P.ExistsReply(request_id=new.rid, count=N)
    # Remove the old one with the admin call: refused from the next request; nothing lost.
    write_tenants(tfile, [TOK_A2])
    admin = raw(ADMIN)
    reply = ask(admin, P.ReloadTenantsRequest())
    assert reply == P.ReloadTenantsReply(
        request_id=admin.rid, summary="3 tenants, 3 tokens (0 added, 1 removed)")
    assert error_code(ask(old, P.ExistsRequest(keys=keys))) == P.ErrorCode.UNAUTHORIZED
    got = ask(new, P.GetRequest(keys=keys))
    assert isinstance(got, P.GetReply) and [bytes(f) for f in got.frames] == \
        [bytes(r) for r in recs]
    # A file that does not load changes nothing, and says why (no token in the message).
    tfile.write_text('[tenants.x]\ntokens = ["short"]\n')
    bad = ask(admin, P.ReloadTenantsRequest())
    assert isinstance(bad, P.ErrorReply) and "at least 16 characters" in bad.message
    assert ask(new, P.ExistsRequest(keys=keys)) == P.ExistsReply(request_id=new.rid, count=N)
    # hicache-admin reload-tenants: the same call; a failure is one line and exit status 1.
    from storage_backends.server.admin_cli import main as admin_main

    cli = ["--url", server.url, "--admin-token", ADMIN, "reload-tenants"]
    capsys.readouterr()
    assert admin_main(cli) == 1
    err = capsys.readouterr().err
    assert err.startswith("hicache-admin: ") and "at least 16 characters" in err
    assert err.count("\n") == 1
    write_tenants(tfile, [TOK_A2, TOK_A])
    assert admin_main(cli) == 0
    assert capsys.readouterr().out == \
        "tenants reloaded: 3 tenants, 4 tokens (1 added, 0 removed)\n"
    assert isinstance(ask(old, P.PingRequest()), P.PingReply)
    assert TOK_A2 not in server.log() and TOK_A not in server.log()


@pytest.mark.parametrize("text, problem", [
    ('[tenants.a]\ntokens = []\n', "tokens must be a non-empty list"),
    ('[tenants.a]\ntokens = ["0123456789abcdef"]\nrights = ["admin"]\n', "unknown right"),
    ('[tenants.a]\ntokens = ["0123456789abcdef"]\n[tenants.b]\ntokens = ["0123456789abcdef"]\n',
     "also a token of tenant 'a'"),
    ('[tenant.a]\ntokens = ["0123456789abcdef"]\n', "unknown top-level key"),
    ('[tenants.a]\ntokens = ["0123456789abcdef"]\nnamspace = "x"\n', "unknown key(s)"),
    ('tokens = "0123456789abcdef', "not valid TOML"),
])
def test_bad_tenants_files_are_refused_without_quoting_tokens(
        tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TenantsError) as e:
        Tenants(path)
    assert problem in str(e.value)
    assert "0123456789abcdef" not in str(e.value)


def test_the_admin_token_is_no_tenant_token_and_keys_stay_apart(tmp_path: Path) -> None:
    path = write_tenants(tmp_path / "t.toml", [TOK_A])
    with pytest.raises(TenantsError, match="equals the admin token"):
        Tenants(path, admin_token=TOK_A)
    table = parse_tenants({"tenants": {"a": {"tokens": [TOK_A]}, "b": {"tokens": [TOK_B]}}})
    ta, tb = sorted(table.values(), key=lambda t: t.name)
    key = "ab" * 32
    assert ta.key(key) == partition_tag("a") + key != tb.key(key)
    assert len(ta.key("not hex")) == 16 + 64 and ta.owns(ta.key("not hex"))


def test_server_refuses_a_tenants_file_with_a_shared_token(tmp_path: Path) -> None:
    from storage_backends.server.cli import config_from_args

    path = write_tenants(tmp_path / "t.toml", [TOK_A])
    with pytest.raises(SystemExit):
        config_from_args(["--tenants-file", str(path), "--auth-token", "x" * 16])


def _from_sglang(url: str, token: str, key: str) -> dict[str, Any]:
    from hicache_client.sglang.settings import parse_settings

    return {"url": url, **parse_settings({"auth_token": token, "encryption_key": key}).client}


def _from_lmcache(url: str, token: str, key: str) -> dict[str, Any]:
    from hicache_client.lmcache.settings import resolve

    p = "remote_storage_plugin.hicache."
    extra = {p + "auth_token": token, p + "encryption_key": key}
    return resolve(extra, "hicache://" + url.removeprefix("tcp://"), None).backend_extra


@pytest.mark.parametrize("settings", [_from_sglang, _from_lmcache], ids=["sglang", "lmcache"])
def test_plugins_pass_the_tenant_token_and_key_through(
        server: HiCacheServerProc, settings: Any) -> None:
    from hicache_client.backend import StorageConfig
    from hicache_client.remote.backend import HiCacheServerBackend

    key = "33" * 32

    def backend(token: str) -> HiCacheServerBackend:
        cfg = {**settings(server.url, token, key), "timeout_ms": 5000}
        return HiCacheServerBackend(StorageConfig(extra=cfg, namespace=NAMESPACE.hex()))

    with pytest.raises(ConfigError, match=r"does not know \(missing or wrong auth token\)"):
        backend("not-a-tenant-token-01")
    keys, recs = pages("plugin", 2, 1000)
    b = backend(TOK_B)
    try:
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True, True]
        out = buffers(2, len(recs[0]))
        assert b.batch_get(keys, out) == [True, True]
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
    finally:
        b.close()
    got = RawClient(server.url)
    try:
        got.token = TOK_B  # type: ignore[attr-defined]
        reply = ask(got, P.GetRequest(keys=keys))
        assert isinstance(reply, P.GetReply)
        assert all(bytes(f)[:4] == b"HKVS" for f in reply.frames) and len(reply.frames) == 2
    finally:
        got.close()


def test_admin_lookup_and_pins_by_partition(server: HiCacheServerProc,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from hicache_client.keys import page_keys, request_seed
    from storage_backends.server.admin_cli import main as admin_main
    from tests.storage_backends.conftest import make_codec

    ids, page = list(range(1, 66)), 16  # 4 whole pages (the last token is never reused)
    keys = [d.hex() for d in page_keys(ids, page, request_seed(NAMESPACE, None))]
    c = make_codec(1000)
    recs = [c.encode(k, bytes(1000)) for k in keys]
    a = client_of(server.url, TOK_A)
    try:
        assert a.batch_set(keys, [memoryview(r) for r in recs]) == [True] * len(keys)
    finally:
        a.close()
    base = ["--url", server.url, "--admin-token", ADMIN, "--json"]
    prompt = ["--token-ids", ",".join(map(str, ids)), "--namespace", NAMESPACE.hex(),
              "--page-size", str(page)]

    def lookup(*extra: str) -> int:
        capsys.readouterr()
        assert admin_main([*base, "lookup", *prompt, *extra]) == 0
        return int(json.loads(capsys.readouterr().out)["server"]["pages"])

    assert lookup("--partition", "team-a") == 4
    assert lookup("--partition", "team-b") == 0
    assert lookup() == 0  # keys of no partition
    assert admin_main([*base, "pin", *prompt, "--partition", "team-a"]) == 0
    assert json.loads(capsys.readouterr().out)["pinned"] == 4


def test_a_partition_over_its_max_bytes_evicts_its_own_pages_only(tmp_path: Path) -> None:
    """Team A may hold three pages in memory (`max_bytes`); its flood of eight evicts its own
    oldest, never team B's, and a page larger than the cap is refused. Stats and metrics say
    so; a reload that lifts the cap lets A grow again."""
    keys_a, recs_a = pages("a", 8, 1000)
    keys_b, recs_b = pages("b", 2, 1000)
    size = len(recs_a[0])
    tfile = tmp_path / "tenants.toml"
    capped = tenants_toml([TOK_A]).replace(
        "[tenants.team-a]\n", f"[tenants.team-a]\nmax_bytes = {3 * size}\n")
    tfile.write_text(capped)
    tfile.chmod(0o600)
    mport = free_port()
    with hicache_server(tmp_path, metrics_port=mport,
                        args=["--tenants-file", str(tfile), "--admin-token", ADMIN]) as srv:
        a, b = client_of(srv.url, TOK_A), client_of(srv.url, TOK_B)
        rb = RawClient(srv.url)
        rb.token = TOK_A  # type: ignore[attr-defined]
        try:
            assert b.batch_set(keys_b, [memoryview(r) for r in recs_b]) == [True] * 2
            for k, r in zip(keys_a, recs_a):  # one at a time: a clear LRU order
                assert a.batch_set([k], [memoryview(r)]) == [True]
            out = buffers(8, size)
            assert a.batch_get(keys_a, out) == [False] * 5 + [True] * 3
            assert [bytes(o) for o in out[5:]] == [bytes(r) for r in recs_a[5:]]
            assert b.batch_get(keys_b, out[:2]) == [True] * 2
            assert ask(rb, P.StatsRequest()) == P.StatsReply(
                request_id=rb.rid, stats={"pages": 3, "bytes": 3 * size, "max_bytes": 3 * size})
            # A page larger than the whole cap is refused; A keeps what it had.
            big = pages("big", 1, 4 * size)
            assert a.batch_set(big[0], [memoryview(r) for r in big[1]]) == [False]
            assert a.batch_exists(keys_a[5:]) == 3
            m = scrape(mport)
            assert m['hicache_server_partition_bytes{partition="team-a"}'] == 3 * size
            assert m['hicache_server_partition_max_bytes{partition="team-a"}'] == 3 * size
            assert m['hicache_server_partition_bytes{partition="team-b"}'] == 2 * size
            assert m['hicache_server_partition_max_bytes{partition="team-b"}'] == 0
            assert m["hicache_server_quota_evictions"] == 5
            assert m["hicache_server_quota_rejected"] == 1
            # Lift the cap (the admin's reload): A's next writes evict nothing.
            tfile.write_text(tenants_toml([TOK_A]))
            rb.token = ADMIN  # type: ignore[attr-defined]
            assert isinstance(ask(rb, P.ReloadTenantsRequest()), P.ReloadTenantsReply)
            assert a.batch_set(keys_a[:5], [memoryview(r) for r in recs_a[:5]]) == [True] * 5
            assert a.batch_exists(keys_a) == 8
            assert scrape(mport)['hicache_server_partition_max_bytes{partition="team-a"}'] == 0
        finally:
            rb.close()
            a.close()
            b.close()


def test_max_bytes_is_one_cap_per_partition() -> None:
    base = {"tokens": ["x" * 16]}
    table = parse_tenants({"tenants": {
        "w": {**base, "namespace": "p", "max_bytes": "1MiB"},
        "r": {"tokens": ["y" * 16], "namespace": "p", "rights": ["read"]}}})
    assert sorted(t.max_bytes for t in table.values()) == [1 << 20, 1 << 20]
    with pytest.raises(TenantsError, match="differs from the 1048576 another tenant of "
                                           "partition 'p' names"):
        parse_tenants({"tenants": {"w": {**base, "namespace": "p", "max_bytes": "1MiB"},
                                   "r": {"tokens": ["y" * 16], "namespace": "p",
                                         "max_bytes": 4096}}})
    for bad, why in ((-4, "negative"), ("-4", "not a size"), ("64p", "in pages"),
                     (True, "a byte count"), ("lots", "not a size")):
        with pytest.raises(TenantsError, match=why):
            parse_tenants({"tenants": {"w": {**base, "max_bytes": bad}}})
