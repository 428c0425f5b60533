"""KV memory pools: the device pool the model reads and writes (L1) and the host pool (L2).

Both are page-granular: a page holds `page_size` consecutive token slots, and the cache hands out
and takes back whole pages. Slot `s` of the device pool is token `s % page_size` of page
`s // page_size`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.config import MEM_LAYOUTS
from hicache_client.errors import CapacityError, ConfigError
from hicache_client.units import kv_bytes_per_token

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class PageAllocator:
    """Free list of page ids `0..num_pages-1`. No tensors: the simulated cache uses it bare.

    Pages come out lowest id first on a fresh allocator; freed pages are reused first (LIFO).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ConfigError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._used = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """`n` pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:][::-1]
        del self._free[-n:]
        for p in out:
            self._used[p] = 1
        return out

    def free(self, pages: Sequence[int]) -> None:
        for p in pages:
            if not self._used[p]:
                raise RuntimeError(f"page {p} freed twice (or never allocated)")
            self._used[p] = 0
        self._free.extend(reversed(pages))

    def is_used(self, page: int) -> bool:
        return bool(self._used[page])

    def free_pages(self) -> set[int]:
        return set(self._free)

    def reset(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._used = bytearray(self.num_pages)


class DeviceKVPool:
    """Per-layer K and V of shape `[num_pages * page_size, kv_heads, head_dim]` on `device`, or
    with `mla=True` one latent per token and layer (DeepSeek's multi-head latent attention:
    `kv_heads` 1, `head_dim` the latent's width, e.g. kv_lora_rank + qk_rope_head_dim).

    All layers live in one tensor `kv` of shape `[planes, layers, slots, kv_heads, head_dim]`
    (`planes`: 2 = K and V, 1 = the latent); `k_buffer[l]` / `v_buffer[l]` are views into it.
    With `mla` both name the latent (V is a prefix of it, which the attention backend reads).
    """

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        mla: bool = False,
    ) -> None:
        if min(num_pages, page_size, num_layers, kv_heads, head_dim) < 1:
            raise ConfigError("device pool dimensions must all be >= 1")
        if mla and kv_heads != 1:
            raise ConfigError(f"an MLA pool holds one latent per token, not {kv_heads} heads")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.mla = mla
        self.planes = 1 if mla else 2
        self.num_slots = num_pages * page_size
        self.kv = torch.zeros(
            (self.planes, num_layers, self.num_slots, kv_heads, head_dim),
            dtype=dtype,
            device=self.device,
        )
        self.k_buffer = [self.kv[0, i] for i in range(num_layers)]
        self.v_buffer = [self.kv[self.planes - 1, i] for i in range(num_layers)]
        self.allocator = PageAllocator(num_pages)
        self._offsets = torch.arange(page_size, device=self.device)

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(
            self.num_layers, self.kv_heads, self.head_dim, self.kv.element_size(), mla=self.mla
        )

    def slots(self, pages: Sequence[int], n_tokens: int | None = None) -> torch.Tensor:
        """Token slot ids (int64, on the pool's device) of `pages`, truncated to `n_tokens`."""
        p = torch.as_tensor(list(pages), dtype=torch.int64, device=self.device)
        s = (p[:, None] * self.page_size + self._offsets[None, :]).reshape(-1)
        return s if n_tokens is None else s[:n_tokens]

    def set_kv(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None
    ) -> None:
        """Write K and V (`[n, kv_heads, head_dim]` each) into `slots`; with `mla`, the latent
        `k` only (`v` must be None)."""
        if (v is None) != self.mla:
            raise ValueError("an MLA pool takes the latent alone; a K/V pool takes K and V")
        self.k_buffer[layer][slots] = k.to(self.dtype)
        if v is not None:
            self.v_buffer[layer][slots] = v.to(self.dtype)

    def get_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` (with `mla`: the latent, twice)."""
        return self.k_buffer[layer][slots], self.v_buffer[layer][slots]

    def page_tensor(self, pages: Sequence[int]) -> torch.Tensor:
        """KV of `pages` as `[planes, layers, len(pages) * page_size, heads, dim]` (a copy)."""
        return self.kv[:, :, self.slots(pages)]


class HostKVPool:
    """Host-memory copy of KV pages in one of three layouts (`P`: 2 planes, K and V; 1 with
    `mla`, the latent, whose `heads` is 1):

    - `layer_first`:       `[P, layers, slots, heads, dim]` (mirrors the device pool)
    - `page_first`:        `[slots, P, layers, heads, dim]` (a page's tokens are contiguous)
    - `page_first_direct`: `[pages, P, layers, page_size, heads, dim]` (a page is one block)

    A page's *payload* (what goes to L3) is its bytes in the layout's natural page order; it is
    zero-copy for the `page_first*` layouts and a gathered copy for `layer_first`. Device <->
    host copies live in `hicache.transfer.PageMover`; on CUDA the buffer is pinned.
    """

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        layout: str = "layer_first",
        io_backend: str = "direct",
        pin_memory: bool = False,
        mla: bool = False,
    ) -> None:
        if layout not in MEM_LAYOUTS:
            raise ConfigError(f"unknown host layout {layout!r}; known: {', '.join(MEM_LAYOUTS)}")
        if num_pages < 1:
            raise CapacityError("host pool needs at least one page")
        if mla and kv_heads != 1:
            raise ConfigError(f"an MLA pool holds one latent per token, not {kv_heads} heads")
        self.mla = mla
        self.planes = 1 if mla else 2
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.layout = layout
        self.io_backend = io_backend
        slots = num_pages * page_size
        P, L, H, D, ps = self.planes, num_layers, kv_heads, head_dim, page_size
        if layout == "layer_first":
            shape: tuple[int, ...] = (P, L, slots, H, D)
            self.page_shape: tuple[int, ...] = (P, L, ps, H, D)
        elif layout == "page_first":
            shape = (slots, P, L, H, D)
            self.page_shape = (ps, P, L, H, D)
        else:
            shape = (num_pages, P, L, ps, H, D)
            self.page_shape = (P, L, ps, H, D)
        pin = pin_memory and torch.cuda.is_available()
        self.buffer = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.allocator = PageAllocator(num_pages)
        self.page_nbytes = int(np.prod(self.page_shape)) * self.buffer.element_size()
        self._offsets = torch.arange(page_size)
        # The buffer with the page axis first: `[pages, *page_shape]` (a view).
        if layout == "layer_first":
            self.page_major = self.buffer.view(P, L, num_pages, ps, H, D).permute(2, 0, 1, 3, 4, 5)
        else:
            self.page_major = self.buffer.view(num_pages, *self.page_shape)

    @classmethod
    def like(
        cls,
        device_pool: DeviceKVPool,
        num_pages: int,
        layout: str = "layer_first",
        io_backend: str = "direct",
    ) -> HostKVPool:
        return cls(
            num_pages=num_pages,
            page_size=device_pool.page_size,
            num_layers=device_pool.num_layers,
            kv_heads=device_pool.kv_heads,
            head_dim=device_pool.head_dim,
            dtype=device_pool.dtype,
            layout=layout,
            io_backend=io_backend,
            pin_memory=device_pool.device.type == "cuda",
            mla=device_pool.mla,
        )

    @property
    def itemsize(self) -> int:
        return self.buffer.element_size()

    def _slots(self, pages: Sequence[int]) -> torch.Tensor:
        p = torch.as_tensor(list(pages), dtype=torch.int64)
        return (p[:, None] * self.page_size + self._offsets[None, :]).reshape(-1)

    # -- page payloads (L3) ----------------------------------------------------------------

    def _page_view(self, page: int) -> torch.Tensor:
        ps = self.page_size
        if self.layout == "layer_first":
            return self.buffer[:, :, page * ps : (page + 1) * ps]
        if self.layout == "page_first":
            return self.buffer[page * ps : (page + 1) * ps]
        return self.buffer[page]

    def page_payload(self, page: int) -> memoryview:
        """The bytes of `page` in `page_shape` order (zero-copy for `page_first*`)."""
        t = self._page_view(page)
        if not t.is_contiguous():
            t = t.contiguous()
        return t.reshape(-1).view(torch.uint8).numpy().data

    def set_page_payload(self, page: int, data: memoryview | bytes) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size != self.page_nbytes:
            raise ValueError(f"payload is {src.size} bytes, a page is {self.page_nbytes}")
        t = self._page_view(page)
        if t.is_contiguous():
            t.reshape(-1).view(torch.uint8).numpy()[:] = src
        else:
            tmp = torch.empty(self.page_shape, dtype=self.dtype)
            tmp.reshape(-1).view(torch.uint8).numpy()[:] = src
            t.copy_(tmp)

    def gather_payloads(self, pages: Sequence[int], out: torch.Tensor) -> None:
        """Payloads of `pages` into `out` (`[len(pages), page_nbytes]` uint8), one copy."""
        idx = torch.as_tensor(pages, dtype=torch.int64)
        bits = _INT_OF_SIZE[self.itemsize]  # (index kernels exist for every integer width)
        dst = out.view(bits).view(len(pages), *self.page_shape)
        torch.index_select(self.page_major.view(bits), 0, idx, out=dst)

    def scatter_payloads(self, pages: Sequence[int], src: torch.Tensor) -> None:
        """Set `pages` from `src` (`[len(pages), page_nbytes]` uint8, may be strided), one copy."""
        idx = torch.as_tensor(pages, dtype=torch.int64)
        bits = _INT_OF_SIZE[self.itemsize]
        try:  # rows of records: each payload is contiguous, so this is a view
            typed = src.view(bits).view(len(pages), *self.page_shape)
        except RuntimeError:
            typed = src.contiguous().view(bits).view(len(pages), *self.page_shape)
        self.page_major.view(bits).index_copy_(0, idx, typed)
