"""Pages of an SGLang host KV pool as bytes, and the page records made of them.

SGLang's host pool says where a page lives with `get_page_buffer_meta(indices)`: per page, one
or more (address, size) regions of its host tensors (MHA `page_first`: the K part and the V
part; `layer_first`: a K and a V region per layer; MLA `page_first`: one region). `HostPages`
turns those addresses into writable memoryviews of the pool's own tensors, so a page is read
and written in place, never through a temporary tensor.

One record per page (`hicache_client.codec.PageCodec`: a 128-byte header, then the payload). The
payload is the page's regions in address order, which is the byte order of SGLang's flat page
(`get_data_page(index, flat=True)`) for every layout whose page the pool can flatten: the v0
tensor API and the v1 zero-copy API write and read the same records. A record is never
assembled here: its header lives in a small per-thread buffer (`heads`) and the client moves
[header, region 1, ..., region k] as the parts of one record (`batch_get_parts` /
`batch_set_parts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache_client.backend import ThreadBuffers
from hicache_client.codec import (
    DTYPE_CODES,
    HEADER_BYTES,
    LAYOUT_CODES,
    PageCodec,
    RecordHeader,
    encode_record_header,
)
from hicache_client.errors import ConfigError

# Host tensors a KV pool keeps its pages in, looked at first; any other CPU tensor (or list of
# them) among the pool's attributes is a buffer too (a draft, SWA, indexer or Mamba pool's).
_BUFFER_ATTRS = ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("need a contiguous CPU tensor")
    arr: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr).cast("B")


class _Buffer:
    __slots__ = ("base", "nbytes", "view", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t  # keeps the memory alive as long as the view
        self.view = tensor_bytes(t)
        self.base = t.data_ptr()
        self.nbytes = len(self.view)


class HostPages:
    """Byte views of one host pool's pages and the codec of their records (after `bind`).

    Thread-safe: SGLang's prefetch and backup threads use it at once (each thread keeps its
    records' headers in its own buffer).
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.page_size = int(pool.page_size)
        self.buffers = _host_buffers(pool)
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        if not ptrs or any(not isinstance(p, int) for p in ptrs):
            raise ConfigError(f"{type(pool).__name__}: page regions are not plain addresses")
        # Regions of a page in address order (the flat page's byte order); the same for every
        # page, so the permutation is found once.
        self.order = sorted(range(len(ptrs)), key=lambda i: ptrs[i])
        self.region_sizes = [int(sizes[i]) for i in self.order]
        self.payload_bytes = sum(self.region_sizes)
        for p, n in zip(ptrs, sizes):
            self._locate(p, n)  # every region must lie in a registered buffer
        self.dtype = str(getattr(pool, "dtype", "uint8")).removeprefix("torch.")
        self.layout = str(getattr(pool, "layout", "raw"))
        try:  # a pool whose page is not one tensor (e.g. Mamba's states) is stored as bytes
            page_shape = tuple(int(d) for d in pool.get_data_page(0, flat=False).shape)
            itemsize = torch.empty((), dtype=pool.dtype).element_size()
        except Exception:  # noqa: BLE001 - any pool's own refusal
            page_shape, itemsize = (self.payload_bytes,), 0
        elems = 1
        for d in page_shape:
            elems *= d
        if self.dtype in DTYPE_CODES and elems * itemsize == self.payload_bytes \
                and len(page_shape) <= 8:
            self._format = (page_shape, self.dtype, itemsize)
        else:  # a dtype records cannot name, or a page that is not one tensor: plain bytes
            self._format = ((self.payload_bytes,), "uint8", 1)
        self.geometry = {"pool": type(pool).__name__, "shape": list(page_shape),
                         "regions": self.region_sizes}
        self.codec: PageCodec | None = None
        self.namespace = b""
        self.record_bytes = HEADER_BYTES + self.payload_bytes
        self._heads = ThreadBuffers()

    def bind(self, namespace: bytes) -> None:
        """Make the record codec for pages of `namespace` (the seed depends on `geometry`)."""
        self.namespace = namespace
        shape, dtype, itemsize = self._format
        self.codec = PageCodec(
            namespace=namespace, dtype=dtype, shape=shape,
            layout=self.layout if self.layout in LAYOUT_CODES else "raw",
            tokens_per_page=self.page_size, itemsize=itemsize,
        )
        assert self.codec.record_bytes == self.record_bytes

    def _codec(self) -> PageCodec:
        if self.codec is None:
            raise RuntimeError("HostPages.bind() was not called")
        return self.codec

    # -- addresses -> views ------------------------------------------------------------------

    def _locate(self, ptr: int, size: int) -> memoryview:
        for b in self.buffers:
            off = ptr - b.base
            if off >= 0 and off + size <= b.nbytes:
                return b.view[off : off + size]
        raise ValueError(f"page region at {ptr:#x} (+{size}) is outside the host pool")

    def page_views(self, host_indices: torch.Tensor, n_pages: int) -> list[list[memoryview]]:
        """Per page, its regions as views of the pool, in payload order. `host_indices` are
        SGLang's token slots (`n_pages * page_size` of them, each page's run contiguous)."""
        if host_indices.numel() != n_pages * self.page_size:
            raise ValueError(f"{host_indices.numel()} host indices for {n_pages} pages of "
                             f"{self.page_size} tokens")
        idx = host_indices if host_indices.device.type == "cpu" else host_indices.cpu()
        ptrs, sizes = self.pool.get_page_buffer_meta(idx)
        per = len(self.order)
        if len(ptrs) != n_pages * per:
            raise ValueError(f"{len(ptrs)} regions for {n_pages} pages of {per}")
        out = []
        for i in range(n_pages):
            base = i * per
            views = [self._locate(ptrs[base + j], sizes[base + j]) for j in self.order]
            if [len(v) for v in views] != self.region_sizes:
                raise ValueError(f"page {i} has regions {[len(v) for v in views]}, "
                                 f"not {self.region_sizes}")
            out.append(views)
        return out

    # -- records -----------------------------------------------------------------------------

    def heads(self, n: int) -> list[memoryview]:
        """`n` header-sized buffers of this thread's header area (reused by its next call)."""
        return self._heads.take([HEADER_BYTES] * n)

    def seal(self, key: str, payload: Sequence[memoryview], head: memoryview) -> None:
        """Write into `head` the header of page `key`'s record whose payload is `payload` (the
        page's regions, in order; the checksum is computed over them where they are)."""
        encode_record_header(self._codec(), key, payload, head)

    def accept(self, key: str, header: RecordHeader) -> str | None:
        """Why a record that passed the client's checks (length, magic, key, checksum) is
        still not a page of this pool (another namespace or format), or None
        (`batch_get_parts`'s `accept`: such a record is a counted corrupt miss, never copied
        into the pool). The plugin's one client serves every pool, so the namespace is judged
        here, per pool."""
        c = self._codec()
        if header.namespace != c.namespace:
            return "record is from another namespace"
        got = (header.dtype, header.layout, header.shape, header.token_count)
        want = (c.dtype, c.layout, c.shape, c.tokens_per_page)
        if got != want:
            return (f"record format {'/'.join(map(str, got))} does not match "
                    f"{'/'.join(map(str, want))}")
        return None


def _pool_tensors(pool: Any) -> list[Any]:
    named = [getattr(pool, n, None) for n in _BUFFER_ATTRS]
    others = [v for n, v in sorted(vars(pool).items()) if n not in _BUFFER_ATTRS]
    out: list[Any] = []
    for v in named + others:
        out += list(v) if isinstance(v, list | tuple) else [v]
    return out


def _host_buffers(pool: Any) -> list[_Buffer]:
    out: list[_Buffer] = []
    seen: set[tuple[int, int]] = set()
    for t in _pool_tensors(pool):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            continue
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key in seen or key[1] == 0:
            continue
        seen.add(key)
        out.append(_Buffer(t))
    if not out:
        raise ConfigError(f"{type(pool).__name__} has no contiguous CPU KV buffer")
    return out

