"""Tensor-parallel building blocks of our decoders, and how a checkpoint tensor reaches its shard.

Sharding happens at load time: every rank builds modules of its own (smaller) shapes and reads
only its part of each checkpoint tensor (`safetensors`' `get_slice`), never the whole model.

- Column-parallel layers (q/k/v, gate/up, kv_b_proj, q_b_proj) are plain `nn.Linear`s over this
  rank's rows of the checkpoint weight: no communication.
- `RowParallelLinear` (o_proj, down_proj) holds this rank's input columns; its partial products
  meet in `TPGroup.all_reduce`, and its bias (a full vector) is added once, after the reduce.
- `VocabParallelEmbedding` / `ParallelLMHead`: vocabulary-parallel. Each rank holds
  `ceil(vocab / tp)` rows (the last rank's tail zero-padded); the embedding masks ids of other
  ranks to zero rows and all-reduces (adding zeros is exact: the embedding equals TP=1 bit for
  bit); the head computes its slice of the logits and all-gathers them, so every rank returns
  the full vocabulary, bit-identical across ranks.

Every sum that crosses ranks goes through one all-reduce whose result is the same on every
rank; everything after it is computed identically everywhere, so all ranks hold identical
hidden states (and, for MLA, identical KV latents).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TPGroup
from engine.models.config import KVSpec, ModelConfig
from hicache_client.errors import ConfigError


class Piece(NamedTuple):
    """Where one checkpoint tensor, or this rank's part of it, is loaded."""

    param: str  # our parameter's name
    dim: int | None = None  # checkpoint dimension this rank reads a part of (None: all of it)
    part: slice = slice(None)  # that part along `dim`
    full: int = 0  # the checkpoint's size along `dim` the config implies (checked)
    dst: tuple[int | slice, ...] = ()  # where in the parameter it goes (() = all of it)
    pad: bool = False  # `part` may run past `full`: zero rows there (vocabulary shards only)


def split(n: int, tp: TPGroup, what: str) -> slice:
    """This rank's contiguous share of `n` (ConfigError naming `what` unless it divides)."""
    if n % tp.size:
        raise ConfigError(f"{what} ({n}) is not divisible by tp_size {tp.size}")
    k = n // tp.size
    return slice(tp.rank * k, (tp.rank + 1) * k)


def rows(block: slice, width: int) -> slice:
    """The rows of items `block` when each item is `width` rows (heads of `width` dims)."""
    return slice(block.start * width, block.stop * width)


def kv_head_share(num_heads: int, num_kv_heads: int, tp: TPGroup) -> slice:
    """The KV heads this rank keeps: its share when there are at least as many KV heads as
    ranks, else the one KV head its query heads use (replicated over `tp / num_kv_heads` ranks,
    as SGLang does)."""
    split(num_heads, tp, "num_attention_heads")
    if num_kv_heads >= tp.size:
        return split(num_kv_heads, tp, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise ConfigError(
            f"tp_size {tp.size} is not a multiple of num_key_value_heads ({num_kv_heads})"
        )
    h = tp.rank // (tp.size // num_kv_heads)
    return slice(h, h + 1)


def vocab_share(vocab: int, tp: TPGroup) -> slice:
    """This rank's vocabulary rows, `ceil(vocab / tp)` of them (may run past `vocab`)."""
    k = -(-vocab // tp.size)
    return slice(tp.rank * k, (tp.rank + 1) * k)


class RowParallelLinear(nn.Module):
    """`y = x @ W.T` over this rank's input columns, summed over the ranks, then `+ bias`."""

    def __init__(self, in_local: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the product: no reduce, no bias."""
        return F.linear(x, self.weight)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """All-reduce partial sums and add the bias once."""
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.is_solo:
            return F.linear(x, self.weight, self.bias)
        return self.finish(self.partial(x))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.share = vocab_share(vocab, tp)
        self.weight = nn.Parameter(torch.empty(self.share.stop - self.share.start, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.is_solo:
            return F.embedding(ids, self.weight)
        local = ids - self.share.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(mine, local, 0), self.weight)
        x = x * mine[:, None].to(x.dtype)
        return self.tp.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Logits over the whole vocabulary: this rank's slice, all-gathered, padding cut off."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        share = vocab_share(vocab, tp)
        self.weight = nn.Parameter(torch.empty(share.stop - share.start, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        if self.tp.is_solo:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.vocab]


class TPModel(nn.Module):
    """What the loader and the runner need of a decoder (`LlamaForCausalLM`,
    `DeepseekForCausalLM`): its `config`, `tp`, `kv_spec`, the load plan and the forward."""

    config: ModelConfig
    tp: TPGroup
    kv_spec: KVSpec  # this rank's KV pool and attention shape
    # Parameters kept in float32 whatever the model's dtype (name suffixes): routers.
    keep_fp32: tuple[str, ...] = ()
    # Whether a decode step reads no host value (a CUDA graph can capture it).
    supports_cuda_graph: bool = True

    def load_piece(self, name: str) -> Piece | None:
        """Where checkpoint tensor `name` goes on this rank; None: not a weight of ours to load
        (ConfigError for a tensor we do not know)."""
        raise NotImplementedError

    def param_pieces(self, param: str) -> int:
        """How many checkpoint tensors make up parameter `param` (1 unless stacked)."""
        return 1

    def tie_weights(self) -> None:
        return None


def vocab_piece(name: str, vocab: int, tp: TPGroup) -> Piece:
    return Piece(name, 0, vocab_share(vocab, tp), vocab, pad=True)
