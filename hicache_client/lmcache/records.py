"""How one LMCache chunk becomes one hicache page record, and back (no LMCache import here).

- **Namespace.** Each chunk's record carries a 32-byte namespace seed: SHA-256 over a versioned
  tag and the chunk's identity in LMCache (the key's model name, world size, worker id, dtype
  and tags) and the engine's chunk layout (memory format, full-chunk shapes and dtypes, chunk
  size). A different model, rank, dtype, shape or format never derives the same seed. With MLA
  the KV is the same on every rank, so the worker id is left out: every rank reads rank 0's
  chunks.
- **Storage key.** `sha256(seed ‖ chunk hash)` in hex: the server key is namespaced too, so two
  models never even address each other's records.
- **Record.** A `hicache_client.codec.PageCodec` record (magic, version, namespace, key digest, token
  count, dtype, shape, XXH3 checksum) whose payload is the chunk's bytes exactly as LMCache
  holds them (layout `raw`; LMCache's format is part of the namespace). Every record has the
  size of a *full* chunk: a partial chunk (the shorter last chunk of a prompt) is stored zero-
  padded with its real token count in the header, so a reader can always read into a
  full-chunk buffer and shrink the result afterwards (LMCache's own `reshape_partial_chunk`).
- **No assembling.** A record is handled as parts (`StorageBackend.batch_set_parts` /
  `batch_get_parts`): a 128-byte header buffer of ours, then the chunk's bytes in LMCache's
  `MemoryObj` itself (then zeros, for a partial chunk). On the server's host the client copies
  between the server's store and those parts directly: one copy each way.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from hicache_client.codec import (
    DTYPE_CODES,
    HEADER_BYTES,
    PageCodec,
    RecordHeader,
    encode_record_header,
)

TAG = "hicache/lmcache-chunk/v1"
LAYOUT = "raw"


@dataclass(frozen=True)
class ChunkLayout:
    """What every full chunk of one LMCache engine looks like."""

    fmt: str  # LMCache MemoryFormat name: KV_2LTD, or KV_MLA_FMT with MLA
    shapes: tuple[tuple[int, ...], ...]  # full-chunk shape of each KV group
    dtypes: tuple[str, ...]  # torch dtype name of each group ("float16", ...)
    itemsizes: tuple[int, ...]  # bytes per element of each group
    chunk_tokens: int  # tokens in a full chunk
    token_dim: int  # index of the token dimension in each shape
    use_mla: bool  # one copy of the KV for every rank

    @property
    def payload_bytes(self) -> int:
        """Bytes of one full chunk (a record's payload)."""
        total = 0
        for shape, size in zip(self.shapes, self.itemsizes):
            n = size
            for d in shape:
                n *= d
            total += n
        return total

    @property
    def record_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes one token takes in a chunk (every layer, K and V)."""
        return self.payload_bytes // self.chunk_tokens

    @property
    def record_format(self) -> tuple[str, tuple[int, ...], int]:
        """(dtype, shape, itemsize) named in each record's header. One group of a dtype the
        codec knows: its dtype and shape; anything else: flat bytes."""
        if len(self.shapes) == 1 and self.dtypes[0] in DTYPE_CODES:
            return self.dtypes[0], self.shapes[0], self.itemsizes[0]
        return "uint8", (self.payload_bytes,), 1

    def shapes_for(self, tokens: int) -> tuple[tuple[int, ...], ...]:
        """The shapes of a chunk of `tokens` tokens."""
        out = []
        for shape in self.shapes:
            s = list(shape)
            s[self.token_dim] = tokens
            out.append(tuple(s))
        return tuple(out)

    def tokens_of(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> int:
        """How many tokens an object of `shapes`/`dtypes` holds; -1 when it is not a chunk of
        this layout (another shape, dtype, or a partial chunk of several groups)."""
        if len(shapes) != len(self.shapes) or tuple(dtypes) != self.dtypes:
            return -1
        if not shapes or len(shapes[0]) <= self.token_dim:
            return -1
        tokens = int(shapes[0][self.token_dim])
        if not 0 < tokens <= self.chunk_tokens:
            return -1
        if tokens < self.chunk_tokens and len(self.shapes) > 1:
            return -1  # LMCache cannot shrink a multi-group chunk either
        if tuple(tuple(int(d) for d in s) for s in shapes) != self.shapes_for(tokens):
            return -1
        return tokens

    def identity(self) -> list[object]:
        return [self.fmt, [list(s) for s in self.shapes], list(self.dtypes), self.chunk_tokens]


def namespace_seed(layout: ChunkLayout, model_name: str, world_size: int, worker_id: int,
                   key_dtype: str, tags: Sequence[Sequence[object]] | None) -> bytes:
    """The 32-byte seed of one (model, rank, dtype, tags) of this layout. MLA: no worker id."""
    ident = [TAG, str(model_name), int(world_size),
             "mla" if layout.use_mla else int(worker_id), str(key_dtype),
             [list(map(str, t)) for t in tags] if tags else [], layout.identity()]
    return hashlib.sha256(json.dumps(ident, separators=(",", ":")).encode()).digest()


def storage_key(seed: bytes, chunk_hash: int) -> str:
    """The server key of chunk `chunk_hash` in namespace `seed` (64 hex characters)."""
    return hashlib.sha256(seed + str(int(chunk_hash)).encode()).hexdigest()


@functools.lru_cache(maxsize=1024)
def _codec(seed: bytes, dtype: str, shape: tuple[int, ...], itemsize: int,
           tokens: int) -> PageCodec:
    return PageCodec(namespace=seed, dtype=dtype, shape=shape, layout=LAYOUT,
                     tokens_per_page=tokens, itemsize=itemsize)


@functools.lru_cache(maxsize=8)
def _zeros(n: int) -> memoryview:
    return memoryview(bytes(n))


def payload_parts(layout: ChunkLayout, tokens: int, data: memoryview) -> list[memoryview]:
    """A record's payload as parts: the chunk's bytes where they are, then (for a partial
    chunk) zeros up to a full chunk. No copy."""
    if len(data) != tokens * layout.token_bytes:
        raise ValueError(f"chunk of {tokens} tokens has {len(data)} bytes, expected "
                         f"{tokens * layout.token_bytes}")
    pad = layout.payload_bytes - len(data)
    return [data, _zeros(pad)] if pad else [data]


def seal(layout: ChunkLayout, seed: bytes, key: str, tokens: int,
         payload: Sequence[memoryview], head: memoryview) -> None:
    """Write into `head` (`HEADER_BYTES`) the header of the record of a chunk of `tokens`
    tokens whose payload is `payload` (`payload_parts`): `head` then the payload is the record,
    its checksum computed over the payload where it lies."""
    dtype, shape, itemsize = layout.record_format
    encode_record_header(_codec(seed, dtype, shape, itemsize, tokens), key, payload, head)


def judge(layout: ChunkLayout, seed: bytes, header: RecordHeader) -> str | None:
    """Why a record that passed the client's checks (length, key digest, checksum) is not a
    chunk of this namespace and layout (written by another model or version under our key), or
    None."""
    if header.namespace != seed:
        return "record is from another namespace"
    dtype, shape, _ = layout.record_format
    if (header.dtype, header.layout, tuple(header.shape)) != (dtype, LAYOUT, shape):
        return (f"record format {header.dtype}/{header.layout}/{header.shape} is not "
                f"{dtype}/{LAYOUT}/{shape}")
    if not 0 < header.token_count <= layout.chunk_tokens:
        return f"record holds {header.token_count} tokens"
    return None
