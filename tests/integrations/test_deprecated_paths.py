"""`integrations.sglang` and `integrations.lmcache.adapter`, the plugins' paths before 0.1.0, stay
for one release: the same objects as `hicache_client.*`, and one `DeprecationWarning` each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.integrations.sglang_env import sglang_skip_reason


def _run(code: str) -> dict[str, object]:
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_alias_module_warns_once() -> None:
    out = _run("""
        import json, warnings
        from integrations import warn_moved
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_moved("integrations.x", "hicache_client.x")
            warn_moved("integrations.x", "hicache_client.x")
        print(json.dumps([[w.category.__name__, str(w.message)] for w in caught]))
    """)
    assert out == [["DeprecationWarning",
                    "integrations.x is deprecated and will be removed in hicache 0.2: name "
                    "hicache_client.x instead (the same objects; see docs/sglang.md and "
                    "docs/lmcache.md)"]]


@pytest.mark.sglang
def test_integrations_sglang_is_the_client_plugin() -> None:
    reason = sglang_skip_reason()
    if reason:
        pytest.skip(reason)
    out = _run("""
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import integrations.sglang as old
            import integrations.sglang
            from hicache_client.sglang import HiCacheServerStorage
        print(json.dumps(dict(
            same=old.HiCacheServerStorage is HiCacheServerStorage,
            ours=[str(w.message).split(" ")[0] for w in caught
                  if w.category is DeprecationWarning and "hicache_client" in str(w.message)])))
    """)
    assert out == {"same": True, "ours": ["integrations.sglang"]}


@pytest.mark.lmcache
def test_integrations_lmcache_adapter_is_the_client_connector() -> None:
    pytest.importorskip("lmcache")
    out = _run("""
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from integrations.lmcache.adapter import HiCacheConnectorAdapter as Old
            from hicache_client.lmcache.adapter import HiCacheConnectorAdapter
        print(json.dumps(dict(
            same=Old is HiCacheConnectorAdapter,
            ours=[str(w.message).split(" ")[0] for w in caught
                  if w.category is DeprecationWarning and "hicache_client" in str(w.message)])))
    """)
    assert out == {"same": True, "ours": ["integrations.lmcache.adapter"]}
