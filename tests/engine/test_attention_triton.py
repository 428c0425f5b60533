"""The `triton` attention backend against the `torch` backend: same outputs, same pool contents.

On a machine without CUDA the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set
for the session by tests/conftest.py before triton is imported), so sizes stay small; with CUDA
they run compiled on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from engine.attention import ForwardBatch, make_attention_backend  # noqa: E402
from engine.engine import Engine  # noqa: E402
from hicache.pools import DeviceKVPool  # noqa: E402
from hicache_client.errors import ConfigError  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
HEAD_DIM = 32


def _pools(page_size: int, kv_heads: int, head_dim: int = HEAD_DIM,
           dtype: torch.dtype = torch.float32, num_pages: int | None = None,
           num_layers: int = 2) -> tuple[DeviceKVPool, ...]:
    """Two pools with identical random contents (one per backend)."""
    num_pages = num_pages or (128 if page_size == 1 else 24)
    pools = tuple(
        DeviceKVPool(num_pages=num_pages, page_size=page_size, num_layers=num_layers,
                     kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=DEV)
        for _ in range(2)
    )
    g = torch.Generator(device=DEV).manual_seed(5)
    init = torch.randn(pools[0].kv.shape, generator=g, device=DEV, dtype=dtype)
    for p in pools:
        p.kv.copy_(init)
    return pools


def _tables(pool: DeviceKVPool, kv_lens: list[int], seed: int,
            first_page: int = 0) -> list[list[int]]:
    """Page tables of shuffled (non-contiguous) pages, ids from `first_page` on."""
    ps = pool.page_size
    need = [-(-n // ps) for n in kv_lens]
    g = torch.Generator().manual_seed(seed)
    pages = (torch.randperm(pool.num_pages - first_page, generator=g) + first_page).tolist()
    assert sum(need) <= len(pages)
    out, i = [], 0
    for n in need:
        out.append(pages[i : i + n])
        i += n
    return out


# (new tokens, cached prefix) per request.
SHAPES = {
    "decode_mixed": [(1, 0), (1, 4), (1, 36), (1, 17)],
    "prefill_ragged": [(7, 0), (19, 0), (3, 0)],
    "extend_prefix": [(20, 13), (5, 33), (9, 0)],
    "extend_with_decode_rows": [(1, 9), (12, 30), (1, 0), (40, 2)],
}


def check_against_torch(pools: tuple[DeviceKVPool, ...], heads: int, reqs: list[tuple[int, int]],
                        seed: int, atol: float, first_page: int = 0,
                        extend_splits: int | None = None) -> None:
    """The triton backend's output and pool writes equal the torch backend's, every layer."""
    pt, pr = pools
    hd, kv_heads, dtype = pt.head_dim, pt.kv_heads, pt.dtype
    scale = hd**-0.5
    ref = make_attention_backend("torch", pt, heads, hd, scale)
    tri = make_attention_backend("triton", pr, heads, hd, scale)
    assert tri.name == "triton"
    tri.extend_splits = extend_splits  # type: ignore[attr-defined]
    kv_lens = [q + p for q, p in reqs]
    tables = _tables(pt, kv_lens, seed=seed, first_page=first_page)
    seqs = [([0] * q, p, t) for (q, p), t in zip(reqs, tables)]
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    t = sum(q for q, _ in reqs)
    q = torch.randn(t, heads, hd, generator=g).to(DEV, dtype)
    k = torch.randn(t, kv_heads, hd, generator=g).to(DEV, dtype)
    v = torch.randn(t, kv_heads, hd, generator=g).to(DEV, dtype)
    for layer in range(pt.num_layers):
        outs = []
        for pool, backend in ((pt, ref), (pr, tri)):
            batch = ForwardBatch.build(pool, seqs)
            backend.prepare(batch)
            outs.append(backend.forward(layer, q, k, v, batch))
        assert outs[1].shape == (t, heads * hd) and outs[1].dtype == dtype
        torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=atol, rtol=atol)
    # Both wrote the new tokens' K/V to the same slots and nothing else.
    assert torch.equal(pr.kv, pt.kv)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 2), (8, 1)])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_torch_backend(page_size: int, heads: int, kv_heads: int, shape: str) -> None:
    reqs = SHAPES[shape]
    check_against_torch(_pools(page_size, kv_heads), heads, reqs, seed=len(reqs) + page_size,
                        atol=2e-5)


@pytest.mark.parametrize(("shape", "splits"), [
    ("extend_prefix", 3), ("extend_with_decode_rows", 2), ("extend_with_decode_rows", 5),
    ("prefill_ragged", 4)])
def test_split_kv_extend_matches_torch_backend(shape: str, splits: int) -> None:
    """Split-KV extends (each query block's keys split into runs on several programs, merged
    after): runs past a row's causal limit, runs shorter than a key block, empty runs."""
    reqs = SHAPES[shape]
    check_against_torch(_pools(4, 2, num_pages=64), 4, reqs, seed=splits, atol=2e-5,
                        extend_splits=splits)


def test_extend_splits_only_where_the_gpu_would_idle() -> None:
    from engine.attention.triton_kernels import extend_splits

    assert extend_splits(1, 100_000, torch.device("cpu")) == 1
    if CUDA:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        dev = torch.device("cuda")
        assert extend_splits(32, 8192, dev) == min(16, -(-2 * sms // 32))  # 64 rows over 8k
        assert extend_splits(32, 300, dev) == 1  # too few keys to split
        assert extend_splits(4 * sms, 8192, dev) == 1  # the GPU is full already


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(("dtype", "head_dim"),
                         [(torch.float32, 64), (torch.float32, 128), (torch.bfloat16, 128)])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_matches_torch_backend(dtype: torch.dtype, head_dim: int, shape: str) -> None:
    """Compiled kernels on the GPU, at real head sizes, in float32 and bfloat16 (GQA 4:1,
    page 16: decode split over several splits, extend tiles crossed; float32 128-wide heads
    take 32-row tiles)."""
    reqs = [(q * 3, p * 5) for q, p in SHAPES[shape]]  # longer: several tiles and splits
    reqs = [(1, p) if q == 3 else (q, p) for q, p in reqs]  # decode rows stay decode rows
    pools = _pools(16, 2, head_dim=head_dim, dtype=dtype, num_pages=64)
    check_against_torch(pools, 8, reqs, seed=3, atol=1e-4 if dtype == torch.float32 else 6e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_offsets_past_two_to_the_31() -> None:
    """Slots whose element offset in a layer's K buffer is past 2**31 (int32 would wrap): a
    2.36 M-slot bf16 pool (4.5 GiB per K or V), the requests on its last pages."""
    ps, hkv, hd = 64, 8, 128  # 1024 elements per slot: offset 2**31 is slot 2**21
    num_pages = (2**21 + 2**18) // ps
    pools = _pools(ps, hkv, head_dim=hd, dtype=torch.bfloat16, num_pages=num_pages,
                   num_layers=1)
    first = 2**21 // ps + 8
    for reqs in ([(1, 300), (1, 5), (1, 64)], [(70, 100), (1, 5)]):  # decode, then extend
        check_against_torch(pools, 16, reqs, seed=1, atol=6e-2, first_page=first)


def test_store_skips_negative_slots() -> None:
    from engine.attention.triton_kernels import store_kv

    pool = _pools(4, 2)[0]
    before = pool.kv.clone()
    k = torch.ones(3, 2, HEAD_DIM, device=DEV)
    v = 2 * torch.ones(3, 2, HEAD_DIM, device=DEV)
    store_kv(k, v, pool.k_buffer[1], pool.v_buffer[1], torch.tensor([5, -1, 9], device=DEV))
    expect = before.clone()
    expect[0, 1, [5, 9]] = 1.0
    expect[1, 1, [5, 9]] = 2.0
    assert torch.equal(pool.kv, expect)


def test_cpu_without_interpreter_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pool = DeviceKVPool(num_pages=2, page_size=4, num_layers=1, kv_heads=1, head_dim=8)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        make_attention_backend("triton", pool, 1, 8, 1.0)


def test_auto_is_torch_on_cpu() -> None:
    pool = DeviceKVPool(num_pages=2, page_size=4, num_layers=1, kv_heads=1, head_dim=8)
    assert make_attention_backend("auto", pool, 1, 8, 1.0).name == "torch"


def test_auto_takes_triton_only_after_its_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` on a device where it would take triton (forced here: CPU says torch) runs the
    kernels once against torch: a kernel that fails or computes wrong falls back to torch."""
    import engine.attention as attention
    from engine.attention import triton_kernels
    from engine.attention.triton_backend import triton_self_check

    # The pool on the device the kernels run on (CPU only under the interpreter, set without CUDA).
    pool = DeviceKVPool(num_pages=4, page_size=16, num_layers=1, kv_heads=2, head_dim=HEAD_DIM,
                        device=DEV)
    scale = HEAD_DIM**-0.5
    assert triton_self_check(pool, 4, HEAD_DIM, scale) is None
    monkeypatch.setattr(attention, "resolve_attention_backend", lambda name, dev: "triton")
    assert make_attention_backend("auto", pool, 4, HEAD_DIM, scale).name == "triton"
    assert make_attention_backend("triton", pool, 4, HEAD_DIM, scale).name == "triton"
    real = triton_kernels.decode_attention

    def wrong(*args: object, **kw: object) -> None:
        real(*args, **kw)
        args[9].mul_(2.0)  # type: ignore[attr-defined]  # the output

    monkeypatch.setattr(triton_kernels, "decode_attention", wrong)
    err = triton_self_check(pool, 4, HEAD_DIM, scale)
    assert err is not None and err.startswith("decode output differs from the torch backend")
    assert make_attention_backend("auto", pool, 4, HEAD_DIM, scale).name == "torch"

    def fails(*args: object, **kw: object) -> None:
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(triton_kernels, "extend_attention", fails)
    assert triton_self_check(pool, 4, HEAD_DIM, scale) == "RuntimeError: no kernel image"
    assert make_attention_backend("auto", pool, 4, HEAD_DIM, scale).name == "torch"
    # Asked for by name, triton is taken as is (its errors surface).
    assert make_attention_backend("triton", pool, 4, HEAD_DIM, scale).name == "triton"


def test_engine_greedy_equal_to_torch_backend(tmp_path: Path) -> None:
    """The demo model end to end (radix cache on: later prompts extend cached prefixes; several
    prompts prefilled in one batch, then batched decode): token for token equal."""
    g = torch.Generator().manual_seed(11)
    base = torch.randint(5, 1000, (16,), generator=g).tolist()
    prompts = [base + torch.randint(5, 1000, (n,), generator=g).tolist() for n in (3, 9)]
    prompts.append(torch.randint(5, 1000, (6,), generator=g).tolist())
    params = {"max_new_tokens": 4, "ignore_eos": True}
    outs = {}
    for backend in ("torch", "triton"):
        with Engine(attention_backend=backend, device=DEV.type, page_size=4,
                    max_total_tokens=512, chunked_prefill_size=64) as e:
            assert e.runner.attn.name == backend
            first = e.generate(input_ids=prompts[:1], sampling_params=params)
            rest = e.generate(input_ids=prompts[1:], sampling_params=params)
            outs[backend] = [r["output_ids"] for r in first + rest]
            assert rest[0]["meta_info"]["cached_tokens"] >= 16
    assert outs["triton"] == outs["torch"]
    assert all(len(o) == 4 for o in outs["torch"])
