"""The model catalog (`--model NAME`) against a second source: the engine's own config reader on
the configs the repository ships, and kvcache-simulator's catalog where it is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.models.config import ModelConfig
from engine.models.config import kv_bytes_per_token as engine_kv_bytes
from hicache_client.errors import ConfigError
from tests.tools.conftest import REPO, mooncake_rows, write_jsonl
from tools.hitrate import catalog
from tools.hitrate.cli import main
from tools.hitrate.sizes import kv_bytes_from_model

SHIPPED = REPO / "engine" / "model_configs"


def test_catalog_has_the_families() -> None:
    names = set(catalog.MODELS)
    assert len(names) >= 30
    for prefix in ("llama-3", "qwen2.5", "qwen3", "deepseek-v2", "deepseek-v3", "deepseek-r1",
                   "kimi-k2", "mistral", "mixtral", "gemma-2", "gemma-3", "gpt-oss", "glm-4"):
        assert any(n.startswith(prefix) for n in names), prefix


@pytest.mark.parametrize("name", sorted(p.name for p in SHIPPED.iterdir() if p.is_dir()))
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_shipped_configs_agree_with_the_engine(name: str, tp: int) -> None:
    """Every shipped config has a catalog entry, equal to the engine's pool size per rank (and
    to --model-path's reading of the same directory) at bf16 and fp8."""
    cfg = ModelConfig.from_dir(SHIPPED / name)
    spec = catalog.lookup(name)
    assert spec.mla == cfg.is_mla
    assert spec.layers == cfg.num_layers
    for dtype, itemsize in (("bf16", 2), ("fp8", 1)):
        want = engine_kv_bytes(cfg, itemsize, tp)
        assert spec.bytes_per_token(dtype, tp) == want
        dt = "bfloat16" if itemsize == 2 else "float8_e4m3fn"
        assert kv_bytes_from_model(str(SHIPPED / name), dt, tp) == want
    assert spec.bytes_per_token("fp4", tp) == engine_kv_bytes(cfg, 1, tp) / 2


def test_known_values() -> None:
    # Worked by hand from the published configs.
    assert catalog.kv_bytes_per_token("llama-3.1-8b") == 2 * 32 * 8 * 128 * 2 == 131072
    assert catalog.kv_bytes_per_token("llama-3.1-70b", "fp8", tp=8) == 2 * 80 * 1 * 128
    assert catalog.kv_bytes_per_token("qwen2.5-7b", tp=8) == 2 * 28 * 1 * 128 * 2  # replicated
    assert catalog.kv_bytes_per_token("deepseek-v3") == 61 * 576 * 2 == 70272
    assert catalog.kv_bytes_per_token("deepseek-v3", "fp8", tp=8) == 61 * 576
    assert catalog.kv_bytes_per_token("kimi-k2", "fp4") == 61 * 576 * 0.5
    sm = catalog.lookup("smollm2-135m-instruct")  # the engine serves it under this name
    assert sm.source == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert catalog.kv_bytes_per_token("smollm2-135m-instruct") == 2 * 30 * 3 * 64 * 2 == 23040
    g = catalog.lookup("gemma-3-27b")
    assert (g.sliding_window, g.sliding_layers, g.full_layers) == (1024, 52, 10)
    assert g.bytes_per_token() == 2 * 62 * 16 * 128 * 2
    assert g.full_attention_bytes() == 2 * 10 * 16 * 128 * 2
    assert catalog.lookup("GPT-OSS-120B").full_layers == 18


def test_bad_names_and_shapes() -> None:
    with pytest.raises(ConfigError, match="known: llama-3.1-8b"):
        catalog.lookup("llama-9")
    with pytest.raises(ConfigError, match="known: bf16, fp16, fp8, fp4"):
        catalog.kv_bytes_per_token("qwen3-8b", "int3")
    with pytest.raises(ConfigError, match="do not split over --tp 3"):
        catalog.kv_bytes_per_token("qwen3-8b", tp=3)
    with pytest.raises(ConfigError, match="--tp must be >= 1"):
        catalog.kv_bytes_per_token("qwen3-8b", tp=0)


def _peer_models() -> dict:
    calc = pytest.importorskip("kvcache_sim.calculator")
    return {"calc": calc, "data": calc.load_models_data()}


PEER_PRECISION = {"bf16": "bf16_fp16", "fp8": "fp8_int8", "fp4": "fp4_int4"}
PEER_FORMULAS = {"standard_gqa", "mla", "mixed_full_sliding_gqa"}


def test_entries_agree_with_kvcache_simulator() -> None:
    """Entries the peer also lists give the same bytes per token (sliding-window models at a
    length within the window, where every layer keeps every token)."""
    peer = _peer_models()
    calc, data = peer["calc"], peer["data"]
    by_id = calc.models_by_id(data)
    compared = 0
    for name, spec in catalog.MODELS.items():
        model = by_id.get(name)
        if model is None or model.get("formula") not in PEER_FORMULAS:
            continue
        tokens = spec.sliding_window or 1024
        for dtype, prec in PEER_PRECISION.items():
            got = calc.calculate_cache_size(
                model, tokens=tokens, precision=prec, models_data=data
            ).bytes_per_token
            assert got == spec.bytes_per_token(dtype), (name, dtype)
        compared += 1
    assert compared >= 15


def test_cli_model_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", mooncake_rows([([0, 1], 0), ([0, 1], 0)], 16))
    argv = [str(trace), "--block-size", "16", "--json", "--no-progress"]
    # 4 pages of 16 tokens of llama-3.1-8b at fp8 on 2 ranks: 4 * 16 * 32768 bytes
    assert main([*argv, "--device", "2MiB", "--model", "llama-3.1-8b", "--kv-dtype", "fp8",
                 "--tp", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["kv_bytes_per_token"] == 2 * 32 * 4 * 128
    assert doc["config"]["device_pages"] == 2 * 2**20 // (16 * 32768) == 4
    assert (doc["config"]["model"], doc["config"]["kv_dtype"], doc["config"]["tp"]) == (
        "llama-3.1-8b", "fp8", 2)
    assert main([*argv, "--model", "nope"]) == 2
    assert "unknown --model 'nope'" in capsys.readouterr().err
    assert main([*argv, "--model", "qwen3-8b", "--kv-bytes-per-token", "5"]) == 2
    assert "pass one" in capsys.readouterr().err
