"""SGLang's own storage-backend unit tests that run on a CPU machine, run here as shipped.

Of the tests in SGLang's wheel (`sglang/srt/mem_cache/storage/*/test_*.py`), the Mooncake one
(`mooncake_store/test_mooncake_store.py`) runs on CPU: it drives SGLang's `MooncakeStore`
(v0 and v1 calls, MHA and MLA configs, TP ranks) against a live `mooncake_master`, started here
in the loopback-only namespace. Its functions are called as its `__main__` does (one takes a
config argument, so pytest cannot collect the module itself). The others need what this
machine lacks: hf3fs (a C++ extension and a 3FS mount), tensorcast, EIC, SiMM and AIBrix
(their own services and client packages).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.integrations.sglang_fixtures import skip_without_sglang
from tests.storage_backends import mooncake_procs

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.mooncake,
    pytest.mark.slow,
    skip_without_sglang,
    pytest.mark.skipif(mooncake_procs.skip_reason() is not None,
                       reason=str(mooncake_procs.skip_reason())),
]


def test_sglang_mooncake_store_unit_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang.srt.mem_cache.storage.mooncake_store as pkg

    path = Path(next(iter(pkg.__path__))) / "test_mooncake_store.py"
    spec = importlib.util.spec_from_file_location("sglang_test_mooncake_store", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with mooncake_procs.mooncake_master(tmp_path) as master:
        for k, v in {"MOONCAKE_MASTER": master, "MOONCAKE_PROTOCOL": "tcp",
                     "MOONCAKE_DEVICE": "", "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
                     "MC_TCP_BIND_ADDRESS": "127.0.0.1"}.items():
            monkeypatch.setenv(k, v)
        mod.test_single_operation()
        for mla, rank, size in ((False, 0, 1), (True, 0, 1), (False, 1, 4), (True, 3, 8)):
            mod.test_batch_operation(
                mod.make_hicache_storage_config(is_mla_model=mla, tp_rank=rank, tp_size=size))
