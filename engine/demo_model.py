"""The embedded default model: a small Llama-shaped checkpoint written once to a cache directory.

Weights are random but seeded and the byte-level BPE tokenizer is trained in-process on
`engine/demo_data/corpus.txt`, so every build writes the same files. The directory is a normal
Hugging Face checkpoint (config.json, model.safetensors, tokenizer.json, tokenizer_config.json
with a chat template): `transformers` loads it as it loads any Llama.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEMO_VERSION = "1"
CORPUS = Path(__file__).parent / "demo_data" / "corpus.txt"
SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TOKENIZER_VOCAB = 1024
SEED = 20240601
# Llama-shaped, tiny: 4 layers, hidden 256, 4 heads of 64, 2 KV heads.
DEMO_ARCH: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
_MARKER = ".complete"


def default_dir() -> Path:
    env = os.environ.get("HICACHE_DEMO_MODEL_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "hicache" / f"demo-model-v{DEMO_VERSION}"


def train_tokenizer(corpus: Path = CORPUS, vocab_size: int = TOKENIZER_VOCAB) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights named like a Hugging Face Llama checkpoint."""
    g = torch.Generator().manual_seed(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    v, d = config["vocab_size"], config["head_dim"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h, std=1.0)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "self_attn.q_proj.weight"] = normal(nh * d, h, std=h**-0.5)
        w[p + "self_attn.k_proj.weight"] = normal(nkv * d, h, std=h**-0.5)
        w[p + "self_attn.v_proj.weight"] = normal(nkv * d, h, std=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = normal(h, nh * d, std=(nh * d) ** -0.5)
        w[p + "mlp.gate_proj.weight"] = normal(i, h, std=h**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(i, h, std=h**-0.5)
        w[p + "mlp.down_proj.weight"] = normal(h, i, std=i**-0.5)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    # A large output scale makes the next-token distribution peaked, so greedy decoding is far
    # from ties (caching on or off must give the same tokens).
    w["lm_head.weight"] = normal(v, h, std=4.0 * h**-0.5)
    return {k: t.contiguous() for k, t in w.items()}


def write_demo_model(out_dir: str | Path) -> Path:
    """Write the demo checkpoint into `out_dir` (created; existing files are overwritten)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    vocab = tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": [ids["<|end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        **DEMO_ARCH,
    }
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[1:4],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": DEMO_ARCH["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    gen = {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True))
    save_file(random_weights(config, SEED), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def ensure_demo_model(path: str | Path | None = None) -> Path:
    """The demo checkpoint directory, written on first use (atomically) and reused after."""
    target = Path(path) if path is not None else default_dir()
    if (target / _MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=target.parent))
    try:
        write_demo_model(tmp)
        (tmp / _MARKER).write_text(DEMO_VERSION)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first (or a stale partial dir exists).
            if not (target / _MARKER).is_file():
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
        logger.info("wrote the demo model to %s", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def checkpoint_digest(path: str | Path) -> str:
    """SHA-256 over every file of a checkpoint directory (names and bytes), for tests."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file() and not f.name.startswith("."):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()
