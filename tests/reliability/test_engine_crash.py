"""An engine process SIGKILLed while it writes pages back to L3 (file backend), then a new engine
on the same directory: every page record on disk passes its checksum, every page served is
valid, and outputs equal caching off."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hicache_client.codec import verify_record
from hicache_client.errors import StorageCorrupt
from tests.reliability import conftest as rel

REPO = Path(__file__).resolve().parents[2]

# Serves batch after batch of new prompts forever, printing one JSON line per batch.
_WRITER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {repo!r})
    from engine.engine import Engine
    from tests.reliability.conftest import make_prompts, outputs
    engine = Engine(**json.loads({kwargs!r}))
    i = 0
    while True:
        outputs(engine, make_prompts(8, 1000 + i))
        st = engine.cache.storage_stats()
        print(json.dumps({{"batch": i, "set_pages": st.set_pages}}), flush=True)
        i += 1
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_engine_killed_during_write_back(tmp_path: Path, tiny_model: Path,
                                         reference: rel.Reference, policy: str) -> None:
    root = tmp_path / "pages"
    extra = {"path": str(root), "prefetch_threshold": 0, "load_back_threshold": 0}
    # A small device and host pool, so write_back evicts (and writes to L3) all the time.
    kw = rel.engine_kwargs(tiny_model, enable_hierarchical_cache=True,
                           hicache_storage_backend="file",
                           hicache_storage_backend_extra_config=extra, hicache_write_policy=policy,
                           max_total_tokens=256, hicache_ratio=1.0)
    code = _WRITER.format(repo=str(REPO), kwargs=json.dumps(kw))
    log = open(tmp_path / "writer.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log,
                            cwd=REPO, text=True, start_new_session=True)
    batches = 0
    try:
        assert proc.stdout is not None
        rnd = random.Random(policy)
        while True:
            line = proc.stdout.readline()
            assert line, f"writer died: {(tmp_path / 'writer.log').read_text()[-3000:]}"
            rec = json.loads(line)
            batches = rec["batch"] + 1
            if rec["set_pages"] > 0 and batches >= 3:
                break
        time.sleep(rnd.uniform(0.0, 0.05))  # somewhere inside the next batch's writes
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
    assert proc.returncode == -signal.SIGKILL

    # Every record that reached its final name is whole and is the page its name says.
    pages = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert pages, "the writer wrote nothing before it was killed"
    bad = []
    for p in pages:
        try:
            verify_record(p.read_bytes(), p.name)
        except StorageCorrupt as e:
            bad.append(f"{p.name}: {e}")
    assert not bad, bad[:5]

    # A new engine on the same store serves the killed engine's pages, each valid.
    prompts = [p for i in range(batches + 1) for p in rel.make_prompts(8, 1000 + i)]
    with rel.storage_engine(tiny_model, "file", {"path": str(root)},
                            hicache_write_policy=policy) as engine:
        reference.assert_matches(engine, prompts)
        assert rel.stat(engine, "storage_hit_tokens") > 0
        assert rel.storage_stat(engine, "corrupt_pages") == 0
        assert rel.stat(engine, "corrupt_pages") == 0
        rel.settle(engine)
        reference.assert_matches(engine, prompts[:16])
        assert rel.storage_stat(engine, "corrupt_pages") == 0
        assert all(rel.threads_alive(engine))
