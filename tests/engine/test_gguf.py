"""GGUF checkpoints: our dequantizing loader against transformers' own GGUF load, on small files
written here in every block type we take; and every bad file refused whole, in one line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.attention import ForwardBatch, make_attention_backend
from engine.demo_model import resolve_model_path
from engine.models import gguf as G
from engine.models import load_model, model_fingerprint
from hicache.pools import DeviceKVPool
from hicache_client.errors import ConfigError
from tests.engine.gguf_files import write_gguf
from tests.procs import free_port

ALL_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F32")


@pytest.fixture(autouse=True)
def _model_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Converted checkpoints go to a temp dir, never the user's ~/.cache."""
    monkeypatch.setenv("HICACHE_MODEL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "models"))


def _logits(path: Path, ids: list[int]) -> torch.Tensor:
    """Our model's logits of `ids`: a prefill of 7, a cached-prefix chunk, then decode steps."""
    model = load_model(path)
    c = model.config
    pool = DeviceKVPool(num_pages=64, page_size=4, num_layers=c.num_layers,
                        kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    attn = make_attention_backend("torch", pool, c.num_heads, c.head_dim, c.head_dim**-0.5)
    pages = pool.allocator.alloc(-(-len(ids) // 4))
    assert pages is not None
    rows = [model(ForwardBatch.build(pool, [(ids[:7], 0, pages)], last_only=False), attn),
            model(ForwardBatch.build(pool, [(ids[7:15], 7, pages)], last_only=False), attn)]
    for i in range(15, len(ids)):
        rows.append(model(ForwardBatch.build(pool, [(ids[i:i + 1], i, pages)]), attn))
    return torch.cat(rows)


def _reference(gguf_path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_block_type_matches_transformers(tmp_path: Path, arch: str) -> None:
    """One file whose linear weights cycle through all 13 block types: logits over a prefill,
    a cached-prefix chunk and decode steps equal transformers' load of the same file (fp32)."""
    f = write_gguf(tmp_path / "m.gguf", types=ALL_TYPES, arch=arch, tied=False)
    model = G.GGUFModel(f)
    assert set(model.block_types) == set(ALL_TYPES)
    ids = torch.randint(5, 1000, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = _logits(resolve_model_path(f), ids)
    ref = _reference(f, ids)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_dequantization_equals_gguf_and_rows_slice(tmp_path: Path) -> None:
    """`read` is gguf's dequantization with the Q/K permutation undone; a row slice (a
    tensor-parallel rank's heads) dequantizes only those rows and equals the whole tensor's."""
    import gguf

    f = write_gguf(tmp_path / "m.gguf", types=("Q4_K", "Q5_0", "Q6_K"))
    m = G.GGUFModel(f)
    raw = {t.name: t for t in m.reader.tensors}
    v = raw["blk.0.attn_v.weight"]
    np.testing.assert_array_equal(m.read("model.layers.0.self_attn.v_proj.weight"),
                                  gguf.quants.dequantize(v.data, v.tensor_type))
    q = m.read("model.layers.1.self_attn.q_proj.weight")  # 4 heads of 64 rows
    np.testing.assert_array_equal(m.read("model.layers.1.self_attn.q_proj.weight",
                                         rows=slice(128, 192)), q[128:192])
    with pytest.raises(ConfigError, match="split a head"):
        m.read("model.layers.1.self_attn.q_proj.weight", rows=slice(0, 32))


def test_converted_once_and_fingerprint_is_the_file(tmp_path: Path) -> None:
    f = write_gguf(tmp_path / "a.gguf", types=("Q8_0",))
    d = resolve_model_path(f)
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    assert G.gguf_source(d)["sha256"] == G.file_digest(f)
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    # The same bytes elsewhere (another machine's copy, a folder holding it): the same
    # directory, not converted again, the same fingerprint.
    (tmp_path / "copy").mkdir()
    g = shutil.copy(f, tmp_path / "copy" / "b.gguf")
    assert resolve_model_path(tmp_path / "copy") == d
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime
    assert model_fingerprint(resolve_model_path(g)) == model_fingerprint(d)
    # Another quantization of the same weights: another fingerprint.
    other = resolve_model_path(write_gguf(tmp_path / "c.gguf", types=("Q4_0",)))
    assert model_fingerprint(other) != model_fingerprint(d)


def test_tokenizer_and_chat_template_from_metadata(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from engine.tokenizer import Tokenizer

    f = write_gguf(tmp_path / "m.gguf")
    ours = Tokenizer(resolve_model_path(f))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f.name)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(msgs, tokenize=False) == want
    assert ours.encode("the quick brown fox") == ref.encode("the quick brown fox")


def _refused(path: Path, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_model_path(path)
    assert not any(G.cache_root().glob("*/.complete")) or all(
        G.gguf_source(p.parent)["file"] != path.name for p in G.cache_root().glob("*/.complete"))


def test_bad_files_are_refused_whole(tmp_path: Path) -> None:
    good = write_gguf(tmp_path / "good.gguf")
    data = good.read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(data[: len(data) // 2])
    _refused(tmp_path / "trunc.gguf", "truncated or corrupt")
    (tmp_path / "magic.gguf").write_bytes(b"XXXX" + data[4:])
    _refused(tmp_path / "magic.gguf", "not a readable GGUF")
    _refused(write_gguf(tmp_path / "mamba.gguf", arch="mamba"),
             "architecture 'mamba' is not supported; supported: llama, qwen2")
    _refused(write_gguf(tmp_path / "iq.gguf", types=("IQ4_NL",)),
             "block type IQ4_NL, not supported; supported: F32, F16")
    _refused(write_gguf(tmp_path / "tok.gguf", tokenizer_model="bert"),
             "tokenizer metadata names model 'bert'; supported: gpt2, llama")
    _refused(write_gguf(tmp_path / "notok.gguf", tokenizer_model=None),
             "tokenizer metadata names model None")
    _refused(write_gguf(tmp_path / "short.gguf", drop=("blk.1.ffn_up.weight",)),
             "1 tensors missing for a 2-layer llama model")
    _refused(write_gguf(tmp_path / "vocab.gguf", vocab_size=2000),
             r"token_embd.weight is \(1024, 256\), the metadata says vocabulary 2000")
    _refused(write_gguf(tmp_path / "rope.gguf", rope_freqs=True),
             r"per-dimension RoPE factors \(rope_freqs.weight")
    # Nothing of a refused file was converted.
    assert not list(G.cache_root().glob(".gguf-build-*"))


def test_engine_cli_names_a_bad_file_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    p = subprocess.run([sys.executable, "-m", "engine.cli", "--model-path", str(bad),
                        "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("hicache-engine: error: ")]
    assert len(err) == 1 and "bad.gguf: not a readable GGUF file" in err[0], p.stderr
    assert "Traceback" not in p.stderr
