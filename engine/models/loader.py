"""Load a Hugging Face checkpoint directory: `config.json` + safetensors (single or sharded).

Under tensor parallelism each rank reads only its part of every tensor (`get_slice`), as the
model's `load_piece` says; nothing is loaded whole and sliced after.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.distributed import TPGroup
from engine.models.config import ModelConfig
from engine.models.dummy import init_dummy_weights
from engine.models.parallel import Piece, TPModel
from hicache_client.errors import ConfigError

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


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
        raise ConfigError(f"no safetensors weights in {root} (random weights from its "
                          "config.json alone: --load-format dummy)")
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

    A checkpoint converted from a GGUF file (`engine.models.gguf`) is named by that file's
    SHA-256 alone: every engine on the same file derives the same keys, whichever dequantized
    copy it reads, and another quantization of the same model derives others.
    """
    from engine.models.gguf import gguf_source

    root = Path(path)
    source = gguf_source(root)
    if source is not None:
        return hashlib.sha256(f"hicache/model/gguf/v1\0{source['sha256']}".encode()).hexdigest()
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


def model_class(cfg: ModelConfig) -> type[TPModel]:
    if cfg.is_mla:
        from engine.models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    from engine.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def _read(sl: Any, piece: Piece, name: str) -> torch.Tensor:
    """This rank's part of a checkpoint tensor (`sl`: a safetensors slice). The sliced
    dimension must have the size the config implies (a checkpoint with more or fewer heads than
    its config is an error, never a silently shifted slice); a vocabulary shard running past the
    end is zero-padded."""
    if piece.dim is None:
        return sl[:]
    shape = sl.get_shape()
    if piece.dim >= len(shape) or shape[piece.dim] != piece.full:
        raise ConfigError(f"tensor {name!r} has shape {tuple(shape)}; the config implies "
                          f"{piece.full} along dimension {piece.dim}")
    lo, hi = piece.part.start, piece.part.stop
    index = [slice(None)] * len(shape)
    index[piece.dim] = slice(min(lo, piece.full), min(hi, piece.full))
    t = sl[tuple(index)]
    short = (hi - lo) - t.shape[piece.dim]
    if short > 0 and piece.pad:
        pad = list(t.shape)
        pad[piece.dim] = short
        t = torch.cat([t, t.new_zeros(pad)], dim=piece.dim)
    return t


def build_model(
    cfg: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    context_length: int | None = None,
    tp: TPGroup | None = None,
) -> TPModel:
    """This rank's shard of the model of `cfg` with uninitialised parameters in `dtype`
    (routers in float32) on `device`, its computed buffers (RoPE) filled. On `meta` nothing is
    allocated: the shapes of a model of any size."""
    tp = tp or TPGroup.solo()
    with torch.device("meta"):
        model = model_class(cfg)(cfg, context_length, tp).to(dtype)
        for name, p in model.named_parameters():
            if name.endswith(model.keep_fp32):
                p.data = p.data.float()
    model = model.to_empty(device=device)
    # Buffers (RoPE frequencies, float32) are computed, not loaded: rebuild them on the device.
    ctx = context_length or cfg.max_position_embeddings
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if reset is not None:
            reset(ctx)
    return model


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    context_length: int | None = None,
    tp: TPGroup | None = None,
    load_format: str = "auto",
    seed: int = 0,
) -> TPModel:
    """This rank's shard of the checkpoint at `path` (the whole model with `tp` solo / None):
    `LlamaForCausalLM` or `DeepseekForCausalLM`, in `dtype` on `device`, in eval mode.
    `load_format="dummy"`: from `path/config.json` alone, random weights drawn on the device
    from `seed` (`engine.models.dummy`)."""
    tp = tp or TPGroup.solo()
    cfg = ModelConfig.from_dir(path)
    model = build_model(cfg, dtype=dtype, device=device, context_length=context_length, tp=tp)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        model.tie_weights()
    elif load_format == "auto":
        _load_weights(model, cfg, path, device, tp)
    else:
        raise ConfigError(f"unknown load_format {load_format!r}; known: auto, dummy")
    model.eval()
    model.requires_grad_(False)
    logger.info(
        "%s %s (%s, %d layers, hidden %d) as %s on %s, tp rank %d of %d",
        "built random-weight (dummy)" if load_format == "dummy" else "loaded", path,
        cfg.model_type, cfg.num_layers, cfg.hidden_size, dtype, device, tp.rank, tp.size,
    )
    return model


def _load_weights(
    model: TPModel, cfg: ModelConfig, path: str | Path, device: str | torch.device, tp: TPGroup
) -> None:
    params = dict(model.named_parameters())
    loaded: dict[str, set[str]] = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                piece = model.load_piece(name)
                if piece is None:
                    continue
                if piece.param not in params:
                    raise ConfigError(f"unexpected tensor {name!r} in {f.name}")
                dst = params[piece.param]
                if piece.dst:
                    dst = dst[piece.dst]
                t = _read(sf.get_slice(name), piece, name)
                if tuple(t.shape) != tuple(dst.shape):
                    raise ConfigError(
                        f"tensor {name!r} gives shape {tuple(t.shape)} on rank {tp.rank}, "
                        f"the model expects {tuple(dst.shape)}"
                    )
                with torch.no_grad():
                    dst.copy_(t.to(device=device))
                loaded.setdefault(piece.param, set()).add(repr(piece.dst))
    model.tie_weights()
    if cfg.tie_word_embeddings:
        loaded["lm_head.weight"] = {"()"}
    missing = sorted(
        n for n in params if len(loaded.get(n, ())) < model.param_pieces(n)
    )
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
