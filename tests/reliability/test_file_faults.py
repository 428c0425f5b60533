"""The `file` backend's directory damaged under a running engine: pages truncated, bit-flipped,
replaced by another page's record, emptied, left as a half-written temp file; the directory
replaced by a file (unwritable, root included) or full (RLIMIT_FSIZE, root included). Each is a
counted miss or a counted failed write; the engine never crashes and its outputs equal caching
off."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.engine import Engine
from hicache_client.codec import HEADER_BYTES
from hicache_client.keys import key_str, page_keys, request_seed
from storage_backends.file_backend import page_name
from tests.reliability.conftest import (
    PAGE_SIZE,
    Reference,
    engine_kwargs,
    make_prompts,
    settle,
    stat,
    storage_engine,
    storage_stat,
    threads_alive,
)

REPO = Path(__file__).resolve().parents[2]
DAMAGED_PAGE = 2  # pages 0 and 1 of every prompt stay intact


def page_path(root: Path, key: str) -> Path:
    name = page_name(key)
    return root / name[0:2] / name[2:4] / name


def chain_keys(engine: Engine, prompt: list[int]) -> list[str]:
    """The L3 keys of the full pages the engine caches for `prompt` (no extra_key)."""
    seed = request_seed(engine.cache.namespace, None)
    return [key_str(d) for d in page_keys(prompt, PAGE_SIZE, seed)]


def damage(root: Path, key: str, other_key: str, how: str) -> None:
    victim = page_path(root, key)
    data = bytearray(victim.read_bytes())
    if how == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif how == "bit-flip":
        data[HEADER_BYTES + 101] ^= 0x10
        victim.write_bytes(data)
    elif how == "other-page":
        victim.write_bytes(page_path(root, other_key).read_bytes())
    elif how == "empty":
        victim.write_bytes(b"")
    elif how == "half-written":
        # The writer died between writing the temp file and renaming it into place.
        victim.unlink()
        tmp = victim.parent / f".{victim.name}.{socket.gethostname()}.{os.getpid()}.999.tmp"
        tmp.write_bytes(data[: len(data) // 2])
    else:
        raise AssertionError(how)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncate", "bit-flip", "other-page", "empty", "half-written"])
def test_damaged_pages_are_counted_misses(tmp_path: Path, tiny_model: Path,
                                          reference: Reference, how: str) -> None:
    root = tmp_path / "pages"
    prompts = make_prompts(4, 50, shared=0)
    with storage_engine(tiny_model, "file", {"path": str(root)}) as engine:
        reference.assert_matches(engine, prompts)
        settle(engine)
        for i, p in enumerate(prompts):
            keys = chain_keys(engine, p[:-1])
            other = chain_keys(engine, prompts[(i + 1) % len(prompts)][:-1])[DAMAGED_PAGE]
            damage(root, keys[DAMAGED_PAGE], other, how)
        hits0 = stat(engine, "storage_hit_tokens")
        reference.assert_matches(engine, prompts)
        # Each prompt got exactly its intact leading pages from L3, then recomputed the rest.
        assert stat(engine, "storage_hit_tokens") - hits0 == len(prompts) * DAMAGED_PAGE * PAGE_SIZE
        corrupt = 0 if how == "half-written" else len(prompts)
        assert storage_stat(engine, "corrupt_pages") == corrupt
        # One count: the cache (and /metrics) report what the backend dropped.
        assert stat(engine, "corrupt_pages") == corrupt
        assert storage_stat(engine, "errors") == 0
        # The bad records were deleted and the recomputed pages written again: all hits now.
        settle(engine)
        for p in prompts:
            assert page_path(root, chain_keys(engine, p[:-1])[DAMAGED_PAGE]).exists()
        hits1 = stat(engine, "storage_hit_tokens")
        reference.assert_matches(engine, prompts)
        full = sum((len(p) - 1) // PAGE_SIZE * PAGE_SIZE for p in prompts)
        assert stat(engine, "storage_hit_tokens") - hits1 == full
        assert storage_stat(engine, "corrupt_pages") == corrupt
        assert all(threads_alive(engine))
        engine.wait_transfers(60)
        engine.cache.check_integrity(outside_device_pages=0)


@pytest.mark.slow
def test_directory_replaced_by_a_file_fails_writes_cleanly(
    tmp_path: Path, tiny_model: Path, reference: Reference
) -> None:
    """Every write fails (ENOTDIR, root included) and every read misses: counted, served from
    L1/L2; when the directory comes back, L3 works again."""
    root = tmp_path / "pages"
    first, second = make_prompts(4, 60), make_prompts(4, 61)
    with storage_engine(tiny_model, "file", {"path": str(root)}) as engine:
        reference.assert_matches(engine, first)
        settle(engine)
        moved = tmp_path / "pages.away"
        root.rename(moved)
        root.write_bytes(b"not a directory")
        hits0 = stat(engine, "storage_hit_tokens")
        reference.assert_matches(engine, first)
        reference.assert_matches(engine, second)
        settle(engine)
        reference.assert_matches(engine, second)
        assert stat(engine, "storage_hit_tokens") == hits0
        failed = stat(engine, "storage_failed_pages") + storage_stat(engine, "set_failures")
        assert failed > 0
        assert all(threads_alive(engine))
        root.unlink()
        moved.rename(root)
        settle(engine)
        reference.assert_matches(engine, first)
        assert stat(engine, "storage_hit_tokens") > hits0
        assert storage_stat(engine, "corrupt_pages") == 0
        assert all(threads_alive(engine))


_FULL_DISK = textwrap.dedent(
    """
    import json, resource, signal, sys
    sys.path.insert(0, {repo!r})
    from engine.engine import Engine
    from tests.reliability.conftest import engine_kwargs, make_prompts, outputs, settle
    kw = json.loads({kwargs!r})
    prompts = make_prompts(4, 70)
    with Engine(**kw) as engine:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))  # a full disk, for root too
        first = outputs(engine, prompts)
        settle(engine)
        second = outputs(engine, prompts)
        engine.wait_transfers(60)
        engine.cache.check_integrity(outside_device_pages=0)
        alive = [t.is_alive() for t in engine.cache.controller._threads]
        print(json.dumps({{"prompts": prompts, "first": first, "second": second,
                          "stats": engine.cache_stats(), "alive": alive}}))
    """
)


@pytest.mark.slow
def test_full_disk_fails_writes_cleanly(tmp_path: Path, tiny_model: Path,
                                        reference: Reference) -> None:
    root = tmp_path / "pages"
    kw = engine_kwargs(
        tiny_model,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_backend_extra_config={"path": str(root), "prefetch_threshold": 0,
                                             "load_back_threshold": 0},
    )
    code = _FULL_DISK.format(repo=str(REPO), kwargs=json.dumps(kw), limit=1000)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["first"] == reference(res["prompts"])
    assert res["second"] == reference(res["prompts"])
    st = res["stats"]
    assert st["storage"]["set_failures"] > 0
    assert st["storage"]["set_failures"] == st["storage"]["set_pages"]
    assert st["storage"]["stored_pages"] == 0
    assert st["storage_hit_tokens"] == 0
    assert res["alive"] == [True, True, True]
    assert not [p for p in root.rglob("*") if p.is_file()], "debris left in a full directory"
