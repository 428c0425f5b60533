"""KV compression (hicache_client/compression.py) on a real model's KV, one run side by side.

For `--model` (default smollm2-135m-instruct; `hicache-demo` works too) and a real English text
(the repository's docs, the first 2 * `--tokens` tokens):

- ratio: the first `--tokens` tokens' KV (every layer, K and V, pages of `--page` tokens) in
  bf16, fp16 and fp32, raw bytes / encoded bytes per compression;
- throughput: encode / decode GB/s (raw bytes) on 1 and 2 threads, medians of `--repeats`;
- quality (lossy ones): the first half's KV round-tripped, the next-token distribution over the
  second half against the uncompressed KV: top-1 agreement and mean KL(ref || codec) per token;
  greedy text equality: `--prompts` prefixes whose KV is round-tripped, `--gen` greedy tokens
  each, the fraction equal to the uncompressed continuation.

Not measured here (see docs/storage.md): TTFT of an L3 hit after a restart and hit rate at equal
L3 bytes. JSON on stdout (and `--out`), with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hicache_client.compression import COMPRESSIONS, get_compression

REPO = Path(__file__).resolve().parents[1]


def load(model: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.demo_model import resolve_model_path

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path)
    m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
    return m, tok


def text_ids(tok: Any, n: int) -> torch.Tensor:
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    ids = tok(text, return_tensors="pt").input_ids[:, :n]
    assert ids.shape[1] == n, f"the docs give only {ids.shape[1]} tokens"
    return ids


def kv_of(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def pages_of(t: torch.Tensor, page: int) -> list[torch.Tensor]:
    """[1, heads, seq, hd] -> pages [page tokens, heads, hd] (token x head rows of hd)."""
    x = t[0].transpose(0, 1)  # seq, heads, hd
    return [x[i : i + page].contiguous() for i in range(0, x.shape[0] - page + 1, page)]


def u8(t: torch.Tensor) -> Any:
    return t.view(-1).view(torch.uint8).numpy()


def roundtrip(cache: Any, name: str, dtype: str, page: int) -> None:
    """Replace every K/V tensor of `cache` by its encoded-then-decoded self, in place."""
    c = get_compression(name, dtype, threads=1)
    for k, v in kv_of(cache):
        for t in (k, v):
            x = t[0].transpose(0, 1).contiguous()  # seq, heads, hd
            hd = x.shape[-1]
            blob = c.encode([u8(x)], last_dim=hd)
            out = torch.empty_like(x)
            c.decode_into(blob, [u8(out)], last_dim=hd)
            t.copy_(out.transpose(0, 1).unsqueeze(0))


def measure_ratio_speed(model: str, ids: torch.Tensor, page: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dname, dt in (("bfloat16", torch.bfloat16), ("float16", torch.float16),
                      ("float32", torch.float32)):
        m, _ = load(model, dt)
        with torch.no_grad():
            cache = m(ids, use_cache=True).past_key_values
        pages = [p for k, v in kv_of(cache) for t in (k, v) for p in pages_of(t, page)]
        hd = pages[0].shape[-1]
        raw = [u8(p) for p in pages]
        nbytes = sum(r.nbytes for r in raw)
        row: dict[str, Any] = {"kv_bytes": nbytes, "pages": len(pages)}
        for name in COMPRESSIONS:
            entry: dict[str, Any] = {}
            for threads in (1, 2):
                c = get_compression(name, dname, threads=threads)
                enc, dec = [], []
                blobs: list[bytes] = []
                outs = [torch.empty_like(p) for p in pages]
                ov = [u8(o) for o in outs]
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    blobs = c.encode(raw, last_dim=hd)
                    t1 = time.perf_counter()
                    c.decode_into(blobs, ov, last_dim=hd)
                    t2 = time.perf_counter()
                    enc.append(t1 - t0)
                    dec.append(t2 - t1)
                c.close()
                entry["ratio"] = round(nbytes / sum(len(b) for b in blobs), 4)
                if c.exact:
                    entry["bit_exact"] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                             for a, b in zip(pages, outs))
                entry[f"encode_GBps_{threads}t"] = round(nbytes / statistics.median(enc) / 1e9, 3)
                entry[f"decode_GBps_{threads}t"] = round(nbytes / statistics.median(dec) / 1e9, 3)
            row[name] = entry
        out[dname] = row
        del m
    return out


def measure_quality(model: str, ids: torch.Tensor, page: int, prompts: int,
                    gen: int) -> dict[str, Any]:
    m, tok = load(model, torch.bfloat16)
    half = ids.shape[1] // 2
    res: dict[str, Any] = {}

    def next_logits(name: str) -> torch.Tensor:
        with torch.no_grad():
            cache = m(ids[:, :half], use_cache=True).past_key_values
            if name != "reference":
                roundtrip(cache, name, "bfloat16", page)
            return m(ids[:, half:], past_key_values=cache).logits[0].float()

    def greedy(prefix: torch.Tensor, name: str) -> list[int]:
        with torch.no_grad():
            cache = m(prefix[:, :-1], use_cache=True).past_key_values
            if name != "reference":
                roundtrip(cache, name, "bfloat16", page)
            nxt, out = prefix[:, -1:], []
            for _ in range(gen):
                o = m(nxt, past_key_values=cache, use_cache=True)
                cache = o.past_key_values
                nxt = o.logits[:, -1:].argmax(-1)
                out.append(int(nxt))
            return out

    ref = next_logits("reference")
    ref_lp = torch.log_softmax(ref, -1)
    step = max(1, (ids.shape[1] - 256) // prompts)
    starts = [256 + i * step for i in range(prompts)]
    ref_text = [greedy(ids[:, :s], "reference") for s in starts]
    for name in ("none", "lossless", "fp8", "int4"):
        lg = next_logits(name)
        lp = torch.log_softmax(lg, -1)
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
        top1 = (lg.argmax(-1) == ref.argmax(-1)).float().mean().item()
        same = sum(greedy(ids[:, :s], name) == r for s, r in zip(starts, ref_text))
        res[name] = {"top1_agreement": round(top1, 4), "kl_per_token": round(kl, 6),
                     "greedy_equal_rate": round(same / len(starts), 4)}
    res["tokens_scored"] = int(ids.shape[1] - half)
    res["greedy"] = {"prompts": len(starts), "tokens": gen}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=1024, help="half the text's tokens")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(2)
    _, tok = load(a.model, torch.float32)
    ids = text_ids(tok, 2 * a.tokens)
    t0 = time.time()
    doc: dict[str, Any] = {
        "config": {"model": a.model, "tokens": 2 * a.tokens, "page": a.page,
                   "repeats": a.repeats, "text": "docs/*.md (sorted, joined)"},
        "load_average_before": os.getloadavg(),
        "ratio_speed": measure_ratio_speed(a.model, ids[:, : a.tokens], a.page, a.repeats),
    }
    if not a.skip_quality:
        doc["quality_bf16"] = measure_quality(a.model, ids, a.page, a.prompts, a.gen)
    doc["load_average_after"] = os.getloadavg()
    doc["wall_s"] = round(time.time() - t0, 1)
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
