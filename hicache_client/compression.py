"""KV compression: what a page's payload becomes before it is put in a record (`codec.py`).

`hicache_client.codec.PageCodec` is the *record format* (header, checksum, versions);
a `KVCompression` here is the *payload transform* a record may carry: it turns a batch of pages
into smaller bytes and back. Four are built in, chosen by name (`get_compression`):

- `none` (id 0, exact): the raw page bytes.
- `lossless` (id 1, exact): each element split into its byte planes (element width 2 or 4:
  bf16 / fp16 / fp32), zstd (level 1) on every plane that compresses, the others stored raw. The
  exponent plane of bf16 KV carries ~3 bits of entropy, the mantissa plane ~8: ~1.5x on bf16.
- `fp8` (id 2, lossy): float8 e4m3 with one fp16 scale (amax / 448) per row of the page's last
  dimension (a token x head row of head_dim elements); ~1.94x on bf16.
- `int4` (id 3, lossy): asymmetric 4-bit, groups of 32 along the last dimension, one fp16 scale
  and a 4-bit integer zero point per group, packed two to a byte, then zstd-1; ~3.5-3.8x on bf16.

Every encoded blob starts with a 4-byte preamble (magic byte, compression id, element width,
flags) so a blob is self-describing: `decode_into` of any registered compression reads it, and a
blob whose preamble, lengths or planes do not check raises `StorageCorrupt` (a miss to the
caller, never a page). zstd releases the GIL; a batch of more than `PARALLEL_MIN_BYTES` is
spread over `threads` worker threads. The lossy codecs use torch (imported when one is built:
they run inside an engine, which has it); `none` and `lossless` need only numpy and zstandard.
"""

from __future__ import annotations

import os
import struct
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zstandard

from hicache_client.errors import ConfigError, StorageCorrupt

BLOB_MAGIC = 0xC7
_PRE = struct.Struct("<BBBB")  # magic, compression id, element width, flags
_PLANE = struct.Struct("<BI")  # stored raw (0) / zstd (1), stored length
PARALLEL_MIN_BYTES = 4 << 20
WIDTHS = {"bfloat16": 2, "float16": 2, "float32": 4}
_FP8_MAX = 448.0
INT4_GROUP = 32
_tls = threading.local()


def _zc() -> zstandard.ZstdCompressor:
    c = getattr(_tls, "zc", None)
    if c is None:
        c = _tls.zc = zstandard.ZstdCompressor(level=1)
    return c


def _zd() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "zd", None)
    if d is None:
        d = _tls.zd = zstandard.ZstdDecompressor()
    return d


def _pack_planes(planes: Sequence[bytes | memoryview], head: bytes) -> bytes:
    """`head` then, per plane, a (flag, length) entry and its bytes: zstd where that is smaller."""
    out = [head]
    for p in planes:
        z = _zc().compress(p)
        if len(z) < len(p) * 0.97:
            out += [_PLANE.pack(1, len(z)), z]
        else:
            out += [_PLANE.pack(0, len(p)), bytes(p)]
    return b"".join(out)


def _unpack_planes(blob: memoryview, at: int, sizes: Sequence[int]) -> list[memoryview]:
    """The planes `_pack_planes` wrote from offset `at`, each exactly `sizes[i]` bytes."""
    out: list[memoryview] = []
    for size in sizes:
        if at + _PLANE.size > len(blob):
            raise StorageCorrupt("compressed page is truncated (plane table)")
        flag, n = _PLANE.unpack_from(blob, at)
        at += _PLANE.size
        if at + n > len(blob):
            raise StorageCorrupt("compressed page is truncated (plane bytes)")
        raw = blob[at : at + n]
        at += n
        if flag == 0:
            data = raw
        elif flag == 1:
            try:
                data = memoryview(_zd().decompress(raw, max_output_size=size))
            except zstandard.ZstdError as e:
                raise StorageCorrupt(f"compressed plane does not decode: {e}") from e
        else:
            raise StorageCorrupt(f"unknown plane flag {flag}")
        if len(data) != size:
            raise StorageCorrupt(f"plane is {len(data)} bytes, expected {size}")
        out.append(data)
    if at != len(blob):
        raise StorageCorrupt(f"compressed page has {len(blob) - at} trailing bytes")
    return out


class KVCompression:
    """One payload transform. Subclasses set `name`, `id`, `exact` and implement `_encode` /
    `_decode_into` of one page; batches, threads and the preamble are here."""

    name = "none"
    id = 0
    exact = True
    dtypes: tuple[str, ...] = tuple(WIDTHS) + ("float8_e4m3fn", "float8_e5m2", "uint8", "int8")

    def __init__(self, dtype: str, *, threads: int = 1) -> None:
        if dtype not in self.dtypes:
            raise ConfigError(
                f"KV compression {self.name!r} does not take pages of dtype {dtype!r}; "
                f"it takes {', '.join(self.dtypes)}"
            )
        self.dtype = dtype
        self.width = WIDTHS.get(dtype, 1)
        self.threads = max(1, int(threads))
        self._pool: ThreadPoolExecutor | None = None

    @property
    def params(self) -> dict[str, Any]:
        """What a record's header and a namespace carry besides the id (empty for exact ones)."""
        return {}

    def namespace_tag(self) -> str:
        """The namespace discriminator (`keys.namespace_seed(codec=...)`): "" for an exact
        compression (its pages equal the raw ones), the name and parameters of a lossy one."""
        if self.exact:
            return ""
        return self.name + "".join(f";{k}={v}" for k, v in sorted(self.params.items()))

    # -- one page ------------------------------------------------------------------------
    def _encode(self, page: memoryview, last_dim: int) -> bytes:
        return bytes(page)

    def _decode_into(self, blob: memoryview, out: memoryview, last_dim: int) -> None:
        if len(blob) != len(out):
            raise StorageCorrupt(f"page is {len(blob)} bytes, expected {len(out)}")
        out[:] = blob

    # -- batches -------------------------------------------------------------------------
    def _map(self, fn: Callable[[int], Any], n: int, nbytes: int) -> list[Any]:
        if self.threads == 1 or n < 2 or nbytes < PARALLEL_MIN_BYTES:
            return [fn(i) for i in range(n)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kv-compress")
        return list(self._pool.map(fn, range(n)))

    def encode(self, pages: Sequence[Any], *, last_dim: int) -> list[bytes]:
        """The encoded blob of every page (each a buffer of this dtype's bytes, a whole number
        of rows of `last_dim` elements)."""
        views = [memoryview(p).cast("B") for p in pages]
        pre = _PRE.pack(BLOB_MAGIC, self.id, self.width, 0)

        def one(i: int) -> bytes:
            v = views[i]
            if len(v) % (self.width * last_dim):
                raise ValueError(f"page of {len(v)} bytes is not whole rows of {last_dim}")
            return pre + self._encode(v, last_dim)

        return self._map(one, len(views), sum(len(v) for v in views))

    def decode_into(self, blobs: Sequence[Any], outs: Sequence[Any], *, last_dim: int) -> None:
        """Decode every blob into its page buffer `outs[i]` (written in place). Raises
        `StorageCorrupt` for a blob of another compression, a truncated or damaged one."""
        bv = [memoryview(b).cast("B") for b in blobs]
        ov = [memoryview(o).cast("B") for o in outs]

        def one(i: int) -> None:
            b = bv[i]
            if len(b) < _PRE.size:
                raise StorageCorrupt("compressed page is shorter than its preamble")
            magic, cid, width, _ = _PRE.unpack_from(b)
            if magic != BLOB_MAGIC or cid != self.id or width != self.width:
                raise StorageCorrupt(
                    f"blob is compression {cid} width {width}, reader is {self.name} "
                    f"({self.id}) width {self.width}"
                )
            self._decode_into(b[_PRE.size :], ov[i], last_dim)

        self._map(one, len(bv), sum(len(o) for o in ov))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


class Lossless(KVCompression):
    """Byte planes + zstd-1 (planes that do not compress stored raw). Bit-exact."""

    name = "lossless"
    id = 1
    dtypes = tuple(WIDTHS)

    def _encode(self, page: memoryview, last_dim: int) -> bytes:
        a = np.frombuffer(page, dtype=np.uint8).reshape(-1, self.width)
        planes = [np.ascontiguousarray(a[:, j]).data for j in range(self.width)]
        return _pack_planes(planes, b"")

    def _decode_into(self, blob: memoryview, out: memoryview, last_dim: int) -> None:
        n = len(out) // self.width
        planes = _unpack_planes(blob, 0, [n] * self.width)
        o = np.frombuffer(out, dtype=np.uint8).reshape(-1, self.width)
        for j, p in enumerate(planes):
            o[:, j] = np.frombuffer(p, dtype=np.uint8)


def _view(t: Any, buf: Any, dtype: Any) -> Any:
    """A tensor over `buf` without a copy (torch warns that a read-only buffer is not
    writable: the decoder only reads those)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return t.frombuffer(buf, dtype=dtype)


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the lossy codecs run inside an engine
        raise ConfigError("the fp8 and int4 KV compressions need torch") from e
    return torch


_TORCH_DTYPE = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


class _Lossy(KVCompression):
    """A lossy compression: torch (the engine's) does the arithmetic."""

    exact = False
    dtypes = tuple(WIDTHS)

    def __init__(self, dtype: str, *, threads: int = 1) -> None:
        super().__init__(dtype, threads=threads)
        self._t = _torch()
        self._tdt = getattr(self._t, _TORCH_DTYPE[dtype])


class Fp8(_Lossy):
    """float8 e4m3, one fp16 scale (amax / 448) per row of the last dimension."""

    name = "fp8"
    id = 2

    @property
    def params(self) -> dict[str, Any]:
        return {"fmt": "e4m3", "scale": "row"}

    def _rows(self, page: memoryview, last_dim: int) -> Any:
        t = self._t
        return _view(t, page, self._tdt).view(-1, last_dim).float()

    def _encode(self, page: memoryview, last_dim: int) -> bytes:
        t = self._t
        x = self._rows(page, last_dim)
        scale = (x.abs().amax(dim=1, keepdim=True) / _FP8_MAX).to(t.float16).float()
        scale = t.where(scale > 0, scale, t.ones_like(scale))
        q = (x / scale).clamp(-_FP8_MAX, _FP8_MAX).to(t.float8_e4m3fn)
        return scale.to(t.float16).numpy().tobytes() + q.view(t.uint8).numpy().tobytes()

    def _decode_into(self, blob: memoryview, out: memoryview, last_dim: int) -> None:
        t = self._t
        rows = len(out) // (self.width * last_dim)
        if len(blob) != rows * 2 + rows * last_dim:
            raise StorageCorrupt(f"fp8 page is {len(blob)} bytes, expected "
                                 f"{rows * 2 + rows * last_dim}")
        scale = _view(t, blob[: rows * 2], t.float16).float().view(rows, 1)
        if not bool(t.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise StorageCorrupt("fp8 page has a scale that is NaN, infinite, zero or negative")
        q = _view(t, blob[rows * 2 :], t.uint8).view(t.float8_e4m3fn).view(rows, -1)
        dst = _view(t, out, self._tdt).view(rows, last_dim)
        dst.copy_(q.float() * scale)


class Int4(_Lossy):
    """Asymmetric int4 in groups of 32 along the last dimension: x ~ (q - zero) * scale with an
    fp16 scale and a 4-bit zero point per group; the packed bytes then zstd-1."""

    name = "int4"
    id = 3

    @property
    def params(self) -> dict[str, Any]:
        return {"group": INT4_GROUP, "zero": "u4"}

    def _encode(self, page: memoryview, last_dim: int) -> bytes:
        t = self._t
        if last_dim % INT4_GROUP:
            raise ValueError(f"int4 needs a last dimension divisible by {INT4_GROUP}")
        x = _view(t, page, self._tdt).float().view(-1, INT4_GROUP)
        lo = x.amin(dim=1, keepdim=True).clamp(max=0)  # an integer zero point: 0 in range
        hi = x.amax(dim=1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / 15).to(t.float16).float()
        scale = t.where(scale > 0, scale, t.ones_like(scale))
        zero = (-lo / scale).round().clamp(0, 15)
        q = ((x / scale).round() + zero).clamp(0, 15).to(t.uint8)
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        z = zero.to(t.uint8).view(-1)
        if z.numel() % 2:
            z = t.cat([z, z.new_zeros(1)])
        zp = (z[0::2] | (z[1::2] << 4)).contiguous()
        planes = [scale.to(t.float16).numpy().tobytes(), zp.numpy().tobytes(),
                  packed.numpy().tobytes()]
        return _pack_planes(planes, b"")

    def _decode_into(self, blob: memoryview, out: memoryview, last_dim: int) -> None:
        t = self._t
        groups = len(out) // (self.width * INT4_GROUP)
        sc, zp, packed = _unpack_planes(
            blob, 0, [groups * 2, (groups + 1) // 2, groups * INT4_GROUP // 2])
        scale = _view(t, sc, t.float16).float().view(groups, 1)
        if not bool(t.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise StorageCorrupt("int4 page has a scale that is NaN, infinite, zero or negative")
        zb = _view(t, zp, t.uint8)
        zero = t.stack([zb & 15, zb >> 4], dim=1).view(-1)[:groups].float().view(groups, 1)
        pb = _view(t, packed, t.uint8).view(groups, INT4_GROUP // 2)
        q = t.stack([pb & 15, pb >> 4], dim=2).view(groups, INT4_GROUP).float()
        dst = _view(t, out, self._tdt).view(groups, INT4_GROUP)
        dst.copy_((q - zero) * scale)


COMPRESSIONS: dict[str, type[KVCompression]] = {
    "none": KVCompression, "lossless": Lossless, "fp8": Fp8, "int4": Int4}
BY_ID: dict[int, type[KVCompression]] = {c.id: c for c in COMPRESSIONS.values()}


def get_compression(name: str, dtype: str, *, threads: int | None = None) -> KVCompression:
    """The compression `name` for pages of `dtype`: a `ConfigError` at start-up for an unknown
    name or a dtype it does not take (never at the first write)."""
    cls = COMPRESSIONS.get(name)
    if cls is None:
        raise ConfigError(f"unknown KV compression {name!r}; known: {', '.join(COMPRESSIONS)}")
    n = threads if threads is not None else min(4, os.cpu_count() or 1)
    return cls(dtype, threads=n)


def compression_of(blob: Any) -> int:
    """The compression id a blob's preamble names (`StorageCorrupt` if it has none)."""
    b = memoryview(blob).cast("B")
    if len(b) < _PRE.size or b[0] != BLOB_MAGIC:
        raise StorageCorrupt("not a compressed page")
    return int(b[1])


# Ratios measured on SmolLM2-135M-Instruct's bf16 KV (benchmarks/bench_codecs.py,
# benchmarks/results/codecs-2026-12-07): what `hicache-hitrate --codec NAME` divides L3 bytes by.
MEASURED_RATIO: dict[str, float] = {"none": 1.0, "lossless": 1.43, "fp8": 1.94, "int4": 3.66}
