"""Load a Hugging Face checkpoint directory: `config.json` + safetensors (single or sharded)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM, rope_inv_freq
from hicache.errors import ConfigError

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# Checkpoint tensors that carry no weights of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the shard index, else every
    `*.safetensors` in the directory (sorted)."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        wmap = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({root / f for f in wmap.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no safetensors weights in {root}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"checkpoint shards missing: {', '.join(missing)}")
    return files


def model_fingerprint(path: str | Path) -> str:
    """A hex digest naming the checkpoint's KV: config.json, and per weight file its name, size
    and 16 evenly spaced 64 KiB samples of its bytes.

    Equal for two copies of the same checkpoint (what lets engines on different machines share
    L3 pages), and different for two fine-tunes of one base model, which have the same config
    and the same file sizes but other weights: names and sizes alone would let one serve the
    other's KV. About 1 MiB is read per file. `--model-id` overrides it.
    """
    root = Path(path)
    h = hashlib.sha256(b"hicache/model/v2\0")
    h.update((root / "config.json").read_bytes())
    for f in weight_files(root):
        size = f.stat().st_size
        h.update(f"\0{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            for i in range(_FINGERPRINT_SAMPLES):
                fh.seek(size * i // _FINGERPRINT_SAMPLES)
                h.update(fh.read(_FINGERPRINT_CHUNK))
    return h.hexdigest()


_FINGERPRINT_SAMPLES = 16
_FINGERPRINT_CHUNK = 64 * 1024


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    context_length: int | None = None,
) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, context_length)
    model = model.to_empty(device=device)
    # Buffers (RoPE frequencies) are computed, not loaded: rebuild them on the real device.
    model.model.rotary_emb.inv_freq = rope_inv_freq(
        cfg, context_length or cfg.max_position_embeddings
    ).to(device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in params:
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue
                    raise ConfigError(f"unexpected tensor {name!r} in {f.name}")
                t = sf.get_tensor(name)
                p = params[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ConfigError(
                        f"tensor {name!r} has shape {tuple(t.shape)}, model expects "
                        f"{tuple(p.shape)}"
                    )
                with torch.no_grad():
                    p.copy_(t.to(device=device))
                loaded.add(name)
    if cfg.tie_word_embeddings:
        model.tie_weights()
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model = model.to(dtype)
    model.eval()
    model.requires_grad_(False)
    logger.info(
        "loaded %s (%s, %d layers, hidden %d) as %s on %s",
        path, cfg.model_type, cfg.num_layers, cfg.hidden_size, dtype, device,
    )
    return model
