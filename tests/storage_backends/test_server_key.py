"""The server's identity key (`hicache-server --server-key`): a real server signs its hello
replies, and a client pinning its public key (`server_public_key`: the backend, the SGLang plugin,
the LMCache connector; `hicache-admin --server-public-key`) takes the right server and refuses,
at start-up and naming why, a server with another key, a server without a key, and a server
older than protocol 7. Key files: made by `--generate-server-key`, mode 600, and a private key
that group or others can read is refused."""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_client.backend import StorageConfig
from hicache_client.errors import ConfigError
from hicache_client.remote.backend import HiCacheServerBackend
from storage_backends.server.cli import config_from_args
from tests.storage_backends.conftest import buffers
from tests.storage_backends.hicache_server_proc import (
    NAMESPACE,
    HiCacheServerProc,
    OldProtocolServer,
    client_of,
    hicache_server,
    pages,
)
from tests.storage_backends.test_tenants import ADMIN, TOK_A, TOK_B, write_tenants

N = 3


def keygen(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """`hicache-server --generate-server-key path`: the public key it prints."""
    with pytest.raises(SystemExit) as e:
        config_from_args(["--generate-server-key", str(path)])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip().splitlines()
    return out[-1]


@pytest.fixture
def keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    right, wrong = tmp_path / "server.key", tmp_path / "other.key"
    return {"path": right, "pub": keygen(right, capsys), "wrong": keygen(wrong, capsys)}


@pytest.fixture
def keyed_server(tmp_path: Path, keys: dict[str, Any]) -> Iterator[HiCacheServerProc]:
    tfile = write_tenants(tmp_path / "tenants.toml", [TOK_A])
    args = ["--tenants-file", str(tfile), "--admin-token", ADMIN, "--server-key", str(keys["path"])]
    with hicache_server(tmp_path, args=args) as srv:
        yield srv


def test_generated_key_files(tmp_path: Path, keys: dict[str, Any],
                             capsys: pytest.CaptureFixture[str]) -> None:
    path: Path = keys["path"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert Path(str(path) + ".pub").read_text() == keys["pub"] + "\n"
    assert len(keys["pub"]) == 64 and keys["pub"] != keys["wrong"]
    before = path.read_bytes()
    with pytest.raises(SystemExit) as e:
        config_from_args(["--generate-server-key", str(path)])
    assert e.value.code == 2
    assert "the file exists (not overwritten)" in capsys.readouterr().err
    assert path.read_bytes() == before


def test_a_key_others_can_read_is_refused(tmp_path: Path, keys: dict[str, Any],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path: Path = keys["path"]
    config, _ = config_from_args(["--server-key", str(path)])
    assert config.server_key == str(path)
    path.chmod(0o640)
    with pytest.raises(SystemExit) as e:
        config_from_args(["--server-key", str(path)])
    assert e.value.code == 2
    assert "readable by group or others (mode 640); chmod 600 it" in capsys.readouterr().err
    pub = Path(str(path) + ".pub")
    pub.chmod(0o600)
    with pytest.raises(SystemExit):
        config_from_args(["--server-key", str(pub)])
    assert "not an unencrypted PEM private key" in capsys.readouterr().err


def _roundtrip(b: HiCacheServerBackend, tag: str) -> None:
    ks, recs = pages(tag, N, 1000)
    assert b.batch_set(ks, [memoryview(r) for r in recs]) == [True] * N
    out = buffers(N, len(recs[0]))
    assert b.batch_get(ks, out) == [True] * N
    assert [bytes(o) for o in out] == [bytes(r) for r in recs]
    assert b.stats().errors == 0


def test_the_right_key_is_taken_as_hex_or_file(keyed_server: HiCacheServerProc,
                                               keys: dict[str, Any]) -> None:
    for pinned in (keys["pub"], str(keys["path"]) + ".pub", keys["pub"].upper()):
        b = client_of(keyed_server.url, TOK_A, server_public_key=pinned, shm=False)
        try:
            _roundtrip(b, "right")
        finally:
            b.close()


def test_a_server_with_another_key_is_refused(keyed_server: HiCacheServerProc,
                                              keys: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"does not hold the server key of server_public_key "
                                          r"\(its hello signature does not verify\)"):
        client_of(keyed_server.url, TOK_A, server_public_key=keys["wrong"])
    # Also with token proofs off: the hello is said for the key alone.
    with pytest.raises(ConfigError, match="its hello signature does not verify"):
        client_of(keyed_server.url, TOK_A, server_public_key=keys["wrong"], token_proof="off")
    # A tenant token the server does not know is still named as such.
    with pytest.raises(ConfigError, match=r"does not know \(missing or wrong auth token\)"):
        client_of(keyed_server.url, "not-a-tenant-token-01", server_public_key=keys["pub"])


def test_a_server_without_a_key_is_refused(tmp_path: Path, keys: dict[str, Any]) -> None:
    with hicache_server(tmp_path, auth_token=TOK_B) as srv:
        with pytest.raises(ConfigError, match=r"holds no server key \(started without "
                                              r"--server-key\)"):
            client_of(srv.url, TOK_B, server_public_key=keys["pub"])
        b = client_of(srv.url, TOK_B)  # a client that pins no key: as before
        try:
            _roundtrip(b, "nokey")
        finally:
            b.close()


def test_a_client_without_a_token_checks_the_key(tmp_path: Path, keys: dict[str, Any]) -> None:
    """On a server that checks no token, the key alone is checked."""
    with hicache_server(tmp_path, args=["--server-key", str(keys["path"])]) as srv:
        b = client_of(srv.url, server_public_key=keys["pub"])
        try:
            _roundtrip(b, "notoken")
        finally:
            b.close()
        with pytest.raises(ConfigError, match="its hello signature does not verify"):
            client_of(srv.url, server_public_key=keys["wrong"])


def test_an_older_server_is_refused(tmp_path: Path, keys: dict[str, Any]) -> None:
    srv = OldProtocolServer(tmp_path, versions=(1, 2, 3, 4, 5, 6), auth_token=TOK_B).start()
    try:
        with pytest.raises(ConfigError, match=r"predates server keys \(protocol 7\)"):
            client_of(srv.url, TOK_B, server_public_key=keys["pub"])
    finally:
        srv.stop()


def test_bad_public_keys_are_named() -> None:
    for bad, why in (("zz" * 32, "neither 64 hex characters nor a readable key file"),
                     ("ab" * 16, "neither 64 hex characters nor a readable key file")):
        with pytest.raises(ConfigError, match=f"server_public_key: .*{why}"):
            client_of("tcp://127.0.0.1:1", TOK_A, server_public_key=bad)


def _from_sglang(url: str, token: str, pub: str) -> dict[str, Any]:
    from hicache_client.sglang.settings import parse_settings

    return {"url": url,
            **parse_settings({"auth_token": token, "server_public_key": pub}).client}


def _from_lmcache(url: str, token: str, pub: str) -> dict[str, Any]:
    from hicache_client.lmcache.settings import resolve

    p = "remote_storage_plugin.hicache."
    extra = {p + "auth_token": token, p + "server_public_key": pub}
    return dict(resolve(extra, "hicache://" + url.removeprefix("tcp://"), None).backend_extra)


@pytest.mark.parametrize("settings", [_from_sglang, _from_lmcache], ids=["sglang", "lmcache"])
def test_plugins_pass_the_server_key_through(
        keyed_server: HiCacheServerProc, keys: dict[str, Any],
        settings: Callable[[str, str, str], dict[str, Any]]) -> None:
    def backend(pub: str) -> HiCacheServerBackend:
        cfg = {**settings(keyed_server.url, TOK_A, pub), "timeout_ms": 5000}
        return HiCacheServerBackend(StorageConfig(extra=cfg, namespace=NAMESPACE.hex()))

    with pytest.raises(ConfigError, match="its hello signature does not verify"):
        backend(keys["wrong"])
    b = backend(keys["pub"])
    try:
        _roundtrip(b, "plugin")
    finally:
        b.close()


def test_admin_pins_the_server_key(keyed_server: HiCacheServerProc, keys: dict[str, Any],
                                   tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from storage_backends.server.admin_cli import main as admin_main

    base = ["--url", keyed_server.url, "--admin-token", ADMIN]
    assert admin_main([*base, "--server-public-key", keys["pub"], "--json", "stats"]) == 0
    assert '"totals"' in capsys.readouterr().out
    assert admin_main([*base, "--server-public-key", keys["wrong"], "stats"]) == 1
    assert capsys.readouterr().err == (
        f"hicache-admin: {keyed_server.url} does not hold the key of --server-public-key (its "
        "hello signature does not verify): not the server meant\n")
    assert admin_main([*base, "--server-public-key", "nope", "stats"]) == 1
    assert "hicache-admin: --server-public-key: 'nope' is neither 64 hex characters" in \
        capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    with hicache_server(tmp_path / "plain", args=["--admin-token", ADMIN]) as plain:
        assert admin_main(["--url", plain.url, "--admin-token", ADMIN, "--server-public-key",
                           keys["pub"], "stats"]) == 1
        assert "holds no server key (started without --server-key)" in capsys.readouterr().err
