"""Storage keys for KV pages.

A page's key is a chained SHA-256: ``key_i = sha256(key_{i-1} || tokens_i as uint32 LE)`` with
``key_{-1}`` the namespace seed. A key therefore names the page *and its whole prefix*, so equal
keys mean equal KV (for the same model and layout), and the keys are the same in every process and
on every machine. Python's ``hash()`` is never used: it is salted per process.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

NAMESPACE_TAG = b"hicache/namespace/v1"
_U32 = "I" if array("I").itemsize == 4 else "L"  # a 32-bit unsigned C type
_SWAP = sys.byteorder != "little"  # keys hash tokens as uint32 little-endian everywhere
DIGEST_BYTES = 32


def namespace_seed(
    *,
    model_fingerprint: str,
    dtype: str,
    page_size: int,
    layout: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    extra: str = "",
    compression: str = "",
) -> bytes:
    """The 32-byte seed that starts every key chain of one KV "universe".

    Two engines derive the same seed (and so share L3 pages) exactly when they run the same model
    with the same dtype, page size, KV layout and tensor-parallel rank/size. `extra` carries any
    other discriminator the caller wants (e.g. a deployment-wide salt). `compression` is a lossy
    KV compression's `namespace_tag()` (hicache_client/compression.py): its pages are not the
    exact KV, so they live in a namespace of their own and never answer a reader that did not ask
    for that compression; "" (no compression, or an exact one) leaves the seed as it was.
    """
    fields = {
        "model": model_fingerprint,
        "dtype": dtype,
        "page_size": str(page_size),
        "layout": layout,
        "tp": f"{tp_rank}/{tp_size}",
        "extra": extra,
    }
    if compression:
        fields["compression"] = compression
    h = hashlib.sha256(NAMESPACE_TAG)
    for name in sorted(fields):
        value = fields[name].encode()
        h.update(struct.pack("<I", len(name)) + name.encode())
        h.update(struct.pack("<I", len(value)) + value)
    return h.digest()


def request_seed(namespace: bytes, extra_key: str | None) -> bytes:
    """Seed for one request's chain: the namespace, salted by the request's `extra_key`
    (tenant / `cache_salt` / LoRA id). `None` and "" both mean no salt."""
    if not extra_key:
        return namespace
    return hashlib.sha256(namespace + b"/extra_key/" + extra_key.encode()).digest()


def page_keys(tokens: Sequence[int], page_size: int, prior: bytes) -> list[bytes]:
    """Digest of every *full* page of `tokens`, chained from `prior` (a seed or the previous
    page's digest). A trailing partial page gets no key."""
    n_pages = len(tokens) // page_size
    if n_pages == 0:
        return []
    try:
        arr = array(_U32, tokens[: n_pages * page_size])
    except OverflowError as e:
        raise ValueError("token ids must fit in uint32") from e
    if _SWAP:
        arr.byteswap()
    raw = arr.tobytes()
    step = page_size * 4
    out: list[bytes] = []
    digest = prior
    for i in range(n_pages):
        digest = hashlib.sha256(digest + raw[i * step : (i + 1) * step]).digest()
        out.append(digest)
    return out


def key_str(digest: bytes) -> str:
    """The storage key of a page: lowercase hex of its digest (64 characters)."""
    return digest.hex()
