"""The connector through LMCache's connector interface: built by LMCache's `CreateConnector`
(its `ConnectorManager` loading our adapter from the remote-storage-plugin config, the path its
`RemoteBackend` takes), driven with the calls `RemoteBackend` makes (async ones on an event
loop thread, sync ones directly), against a real `hicache-server`; `MemoryObj`s come from a real
`LocalCPUBackend`."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache_client.errors import ConfigError
from tests.integrations.lmcache_fixtures import (
    ConnectorHarness,
    metadata,
    same_bits,
    skip_without_lmcache,
)
from tests.storage_backends.hicache_server_proc import HiCacheServerProc, hicache_server

DOC = Path(__file__).resolve().parents[2] / "docs" / "lmcache.md"

pytestmark = [pytest.mark.lmcache, skip_without_lmcache]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HiCacheServerProc]:
    with hicache_server(tmp_path_factory.mktemp("hicache-conn"), capacity="256MiB") as srv:
        yield srv


def hc_url(srv: HiCacheServerProc) -> str:
    return f"hicache://127.0.0.1:{srv.port}"


@pytest.fixture
def harness(server: HiCacheServerProc) -> Iterator[ConnectorHarness]:
    h = ConnectorHarness(hc_url(server))
    try:
        yield h
    finally:
        h.close()


def ours(conn: object) -> object:
    from hicache_client.lmcache.connector import HiCacheConnector

    inner = conn.getWrappedConnector()  # type: ignore[attr-defined]
    assert isinstance(inner, HiCacheConnector)
    return inner


def test_lmcache_finds_the_connector(harness: ConnectorHarness, server: HiCacheServerProc) -> None:
    """`plugin://hicache` (what a remote storage plugin's RemoteBackend asks for) and a plain
    `hicache://host:port` URL both reach our connector; both see the same chunks."""
    via_plugin = harness.create()
    via_url = harness.create(hc_url(server))
    assert type(via_plugin).__name__ == "InstrumentedRemoteConnector"
    a, b = ours(via_plugin), ours(via_url)
    assert a.backend.url == b.backend.url == server.url  # type: ignore[attr-defined]
    obj = harness.chunk(seed=1)
    want = obj.tensor.clone()
    harness.put(via_plugin, [harness.key(11)], [obj])
    harness.assert_holds(via_url, harness.key(11), want)

    # class_name naming the connector itself: LMCache wraps it in its DynamicConnectorAdapter.
    direct = ConnectorHarness(hc_url(server), module_path="hicache_client.lmcache.connector",
                              class_name="HiCacheConnector")
    try:
        direct.assert_holds(direct.create(), harness.key(11), want)
    finally:
        direct.close()


def test_round_trips_and_every_call(harness: ConnectorHarness) -> None:
    conn = harness.create()
    keys = [harness.key(h) for h in (101, 102, 103)]
    objs = [harness.chunk(seed=2), harness.chunk(seed=3), harness.chunk(tokens=5, seed=4)]
    want = [o.tensor.clone() for o in objs]
    assert conn.support_batched_put() and conn.support_batched_get()
    harness.put(conn, keys, objs)
    assert [o.get_ref_count() for o in objs] == [1, 1, 1]  # the wrapper dropped our reference

    got = harness.run(conn.batched_get(keys))
    assert all(same_bits(g.tensor, w) for g, w in zip(got, want))
    assert got[2].tensor.shape == torch.Size([2, 2, 5, 16])  # the partial chunk, shrunk back
    for g in got:
        g.ref_count_down()
    one = harness.run(conn.get(keys[0]))
    assert same_bits(one.tensor, want[0])
    one.ref_count_down()

    missing = harness.key(999)
    assert harness.run(conn.exists(keys[1])) and conn.exists_sync(keys[2])
    assert not conn.exists_sync(missing)
    assert conn.batched_contains([*keys, missing]) == 3
    assert conn.batched_contains([keys[0], missing, keys[1]]) == 1
    assert harness.run(conn.batched_async_contains("l1", [keys[0], missing], False)) == 1

    allocator = harness.cpu.memory_allocator
    live = allocator.num_active_allocations
    run = harness.run(conn.batched_get_non_blocking("l2", [keys[0], missing, keys[1]]))
    assert len(run) == 1 and same_bits(run[0].tensor, want[0])
    assert allocator.num_active_allocations == live + 1  # the hit after the miss was released
    run[0].ref_count_down()
    assert allocator.num_active_allocations == live

    assert sorted(harness.run(conn.list())) == sorted(k.to_string() for k in keys)
    assert conn.remove_sync(keys[1]) and not conn.exists_sync(keys[1])
    assert sorted(harness.run(conn.list())) == sorted(k.to_string() for k in (keys[0], keys[2]))
    assert conn.support_ping() and harness.run(conn.ping()) == 0

    arena = ours(conn).backend.arena  # type: ignore[attr-defined]
    # Same host: records went straight between the server's store and the MemoryObjs.
    assert arena.writes == 3 and arena.reads >= 6 and arena.fallbacks == 0
    st = ours(conn).stats()  # type: ignore[attr-defined]
    assert (st["chunks_put"], st["chunks_stored"], st["chunks_asked"], st["chunks_hit"]) == (
        3, 3, 7, 6)
    assert (st["errors"], st["corrupt_pages"], st["foreign_records"], st["failed_calls"]) == (
        0, 0, 0, 0)
    harness.run(conn.close())
    assert harness.run(conn.get(keys[0])) is None  # closed: a miss, not an exception
    for o in objs:
        o.ref_count_down()


def test_objects_that_are_not_chunks_are_refused(harness: ConnectorHarness) -> None:
    conn = harness.create()
    bf16 = harness.chunk(md=metadata(dtype=torch.bfloat16))  # another dtype than the engine's
    harness.put(conn, [harness.key(201)], [bf16])
    st = ours(conn).stats()  # type: ignore[attr-defined]
    assert (st["chunks_put"], st["chunks_refused"], st["set_pages"]) == (1, 1, 0)
    assert not conn.exists_sync(harness.key(201))
    bf16.ref_count_down()


def test_another_model_or_rank_never_reads_the_chunk(harness: ConnectorHarness) -> None:
    conn = harness.create()
    obj = harness.chunk(seed=5)
    harness.put(conn, [harness.key(301)], [obj])
    others = [harness.key(301, model="another-model"),
              harness.key(301, md=metadata(worker_id=1, world_size=2)),
              harness.key(301, md=metadata(worker_id=0, world_size=2))]
    assert harness.run(conn.batched_get(others)) == [None, None, None]
    assert conn.batched_contains(others[:1]) == 0
    st = ours(conn).stats()  # type: ignore[attr-defined]
    assert (st["chunks_hit"], st["foreign_records"], st["corrupt_pages"]) == (0, 0, 0)
    obj.ref_count_down()


def test_settings() -> None:
    from hicache_client.lmcache.settings import resolve

    s = resolve({"remote_storage_plugin.hicache.url": "hicache://10.0.0.1:7480",
                 "remote_storage_plugin.hicache.timeout_ms": 300,
                 "remote_storage_plugin.hicache.a.shm": "false",
                 "remote_storage_plugin.hicache.shm_bytes": "32MiB"},
                "plugin://hicache.a", "hicache.a")
    assert dict(s.backend_extra) == {"url": "tcp://10.0.0.1:7480", "timeout_ms": 300,
                                     "shm": False, "shm_bytes": 32 << 20}
    assert resolve({}, "hicache://[::1]:9", None).backend_extra["url"] == "tcp://[::1]:9"
    assert resolve({}, None, None, remote_url="hicache://h:1").backend_extra["url"] == "tcp://h:1"
    with pytest.raises(ConfigError, match="no server address"):  # remote_url has its own backend
        resolve({}, "plugin://hicache", "hicache", remote_url="hicache://h:1")
    with pytest.raises(ConfigError, match="unknown setting"):
        resolve({"remote_storage_plugin.hicache.timeout": 1}, "hicache://h:1", None)
    with pytest.raises(ConfigError, match="no server address"):
        resolve({}, "plugin://hicache", "hicache")
    with pytest.raises(ConfigError, match="not hicache://host:port"):
        resolve({}, "hicache://h", None)
    with pytest.raises(ConfigError, match="query"):
        resolve({}, "hicache://h:1?auth_token=x", None)


def _doc_block(lang: str, after: str) -> str:
    text = DOC.read_text()
    m = re.search(re.escape(after) + r".*?```" + lang + r"\n(.*?)```", text, re.S)
    assert m, f"no {lang} block after {after!r} in {DOC}"
    return m.group(1)


def test_the_documented_config_works(server: HiCacheServerProc, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The YAML file and the environment variables of docs/lmcache.md, as written (only the
    port changed, and a smaller CPU pool), build our connector and round-trip a chunk."""
    from lmcache.v1.config import LMCacheEngineConfig

    yaml_text = _doc_block("yaml", "LMCACHE_CONFIG_FILE")
    assert "hicache://127.0.0.1:7480" in yaml_text
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml_text.replace("hicache://127.0.0.1:7480", hc_url(server)))
    from_file = LMCacheEngineConfig.from_file(str(path))

    script = _doc_block("bash", "The same with environment variables")
    env = subprocess.run(["bash", "-c", script + "\nenv -0"], capture_output=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.decode().split("\0")
    for line in env:
        name, _, value = line.partition("=")
        if name.startswith("LMCACHE_"):
            monkeypatch.setenv(name, value.replace("hicache://127.0.0.1:7480", hc_url(server)))
    from_env = LMCacheEngineConfig.from_env()
    assert from_env.extra_config == from_file.extra_config
    assert from_env.remote_storage_plugins == from_file.remote_storage_plugins == ["hicache"]

    md = metadata()
    md.chunk_size = from_file.chunk_size
    md.kv_shape = (md.kv_shape[0], 2, from_file.chunk_size, *md.kv_shape[3:])
    for cfg in (from_file, from_env):
        cfg.max_local_cpu_size = 0.05
        h = ConnectorHarness(hc_url(server), md=md, config=cfg)
        try:
            conn = h.create()
            obj = h.chunk(tokens=from_file.chunk_size, seed=9)
            h.put(conn, [h.key(401)], [obj])
            h.assert_holds(conn, h.key(401), obj.tensor)
            obj.ref_count_down()
        finally:
            h.close()
