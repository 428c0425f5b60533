"""The `triton` attention backend over MLA pools (one latent per token; Dk != Dv, V read from the
latent) against the `torch` backend, under Triton's interpreter on CPU (small shapes), and a
DeepSeek-shaped model end to end through `ModelRunner` on both backends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from engine.attention import ForwardBatch, make_attention_backend  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.models import load_model  # noqa: E402
from hicache.pools import DeviceKVPool  # noqa: E402
from tests.engine.test_attention_triton import CUDA, DEV, SHAPES, _tables  # noqa: E402
from tests.engine.test_mla_models import mla_checkpoint, runner_logits  # noqa: E402

LATENT, ROPE = 32, 8  # kv_lora_rank, qk_rope_head_dim


def _mla_pools(page_size: int, latent: int = LATENT, rope: int = ROPE,
               dtype: torch.dtype = torch.float32, num_pages: int | None = None
               ) -> tuple[DeviceKVPool, DeviceKVPool]:
    num_pages = num_pages or (128 if page_size == 1 else 24)
    pools = tuple(
        DeviceKVPool(num_pages=num_pages, page_size=page_size, num_layers=2, kv_heads=1,
                     head_dim=latent + rope, device=DEV, mla=True, dtype=dtype)
        for _ in range(2)
    )
    init = torch.randn(pools[0].kv.shape, generator=torch.Generator().manual_seed(5)).to(DEV)
    for p in pools:
        p.kv.copy_(init)
    return pools  # type: ignore[return-value]


def check_mla(page_size: int, heads: int, reqs: list[tuple[int, int]], seed: int,
              latent: int = LATENT, rope: int = ROPE, dtype: torch.dtype = torch.float32,
              atol: float = 2e-5, num_pages: int | None = None) -> None:
    pt, pr = _mla_pools(page_size, latent, rope, dtype, num_pages)
    d = latent + rope
    scale = 0.3 if latent == LATENT else d**-0.5
    ref = make_attention_backend("torch", pt, heads, d, scale, latent)
    tri = make_attention_backend("triton", pr, heads, d, scale, latent)
    tables = _tables(pt, [q + p for q, p in reqs], seed=seed)
    seqs = [([0] * q, p, t) for (q, p), t in zip(reqs, tables)]
    g = torch.Generator().manual_seed(seed)
    t = sum(q for q, _ in reqs)
    q = torch.randn(t, heads, d, generator=g).to(DEV, dtype)
    lat = torch.randn(t, 1, d, generator=g).to(DEV, dtype)
    for layer in range(2):
        outs = []
        for pool, backend in ((pt, ref), (pr, tri)):
            batch = ForwardBatch.build(pool, seqs)
            backend.prepare(batch)
            outs.append(backend.forward(layer, q, lat, None, batch))
        assert outs[1].shape == (t, heads * latent)
        torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=atol, rtol=atol)
    # Both wrote the new tokens' latents to the same slots and nothing else.
    assert torch.equal(pr.kv, pt.kv)


@pytest.mark.parametrize("shape", ["decode_mixed", "extend_prefix"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_matches_torch_backend(page_size: int, shape: str) -> None:
    check_mla(page_size, 4, SHAPES[shape], seed=page_size + len(shape))


def test_mla_decode_more_heads_than_a_block() -> None:
    """20 query heads on one latent: two head blocks of 16 per program row."""
    check_mla(16, 20, SHAPES["decode_mixed"], seed=3)


def test_gqa_decode_more_heads_than_a_block() -> None:
    """MHA/GQA decode with a group of 32 query heads per KV head (two head blocks)."""
    from tests.engine.test_attention_triton import _pools, check_against_torch

    check_against_torch(_pools(16, 1, head_dim=16), 32, SHAPES["decode_mixed"], seed=4,
                        atol=2e-5)


def test_mla_model_triton_equals_torch(checkpoint_factory: Callable[..., Path]) -> None:
    """A DeepSeek-V3-shaped model (q LoRA, YaRN, MoE) through ModelRunner: prefill, a chunk over
    the cached prefix and decode give the same logits on both backends."""
    path = mla_checkpoint(checkpoint_factory, "v3_yarn", layers=2)
    ids = torch.randint(0, 1024, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    out = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(load_model(path, device=DEV), num_pages=16, page_size=4,
                             dtype=torch.float32, device=DEV, attention_backend=backend)
        assert runner.attn.name == backend and runner.pool.mla
        out[backend] = runner_logits(runner, ids, list(range(2, 10)))
    torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)
    assert torch.equal(out["triton"].argmax(-1), out["torch"].argmax(-1))


def test_mla_self_check_passes() -> None:
    from engine.attention.triton_backend import triton_self_check

    pool = DeviceKVPool(num_pages=4, page_size=16, num_layers=1, kv_heads=1,
                        head_dim=LATENT + ROPE, device=DEV, mla=True)
    assert triton_self_check(pool, 4, LATENT + ROPE, 0.3, LATENT) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["decode_mixed", "extend_prefix"])
def test_gpu_mla_at_deepseek_width(dtype: torch.dtype, shape: str) -> None:
    """Compiled MLA kernels at DeepSeek-V2/V3's latent (512 + 64) and 16 heads a rank, page 64,
    float32 and bfloat16, longer requests (several tiles and decode splits)."""
    reqs = [(q * 3, p * 9) for q, p in SHAPES[shape]]
    reqs = [(1, p) if q == 3 else (q, p) for q, p in reqs]  # decode rows stay decode rows
    check_mla(64, 16, reqs, seed=7, latent=512, rope=64, dtype=dtype, num_pages=64,
              atol=2e-4 if dtype == torch.float32 else 6e-2)
