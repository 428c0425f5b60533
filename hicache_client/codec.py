"""Page records: the self-describing, checksummed bytes every L3 backend stores.

A record is a fixed 128-byte header followed by the page payload. The header names the record's
namespace, key (SHA-256 digest), token count, dtype, layout and shape, the payload length, and a
checksum over the header fields and the payload, so every truncation, every flipped byte and every
record stored under the wrong key is detected.

A record may also be held in several buffers (a small header buffer, then a page's regions where
they lie): `verify_record_parts` and `encode_record_header` check and write it in place.

Versions (the reader accepts both; the writer writes the newest):

- 1: CRC32 (zlib) in the header's last 4 bytes, over header[:124] then the payload. ~2.5 GB/s on
  one core, holds the GIL per call.
- 2: XXH3-64 (`xxhash`, seed 0) in the header's last 8 bytes, over header[:120] then the
  payload. ~30-60 GB/s on one core and the GIL is released while hashing, so backends can check
  pages in their reading threads.
- 3: a compressed record (`hicache_client.compression`): the version-2 header and checksum, the
  header's pad byte (after ndim) holds the compression id, the shape and dtype are the decoded
  page's, payload_len and the checksum are of the stored (encoded) bytes. A compression's
  parameters are fixed by its id (a new parameter set is a new id), so the record says all a
  reader needs: `PageCodec.decode_into` decodes whatever compression a record names.
  Uncompressed records are still written as version 2.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import xxhash

from hicache_client.errors import ConfigError, StorageCorrupt

RECORD_MAGIC = b"HKVP"
RECORD_VERSION = 2  # what PageCodec writes
COMPRESSED_VERSION = 3  # what PageCodec writes for a compressed page
READ_VERSIONS = (1, 2, 3)  # what verify_record accepts
_MAX_DIMS = 8
# magic, version, header_len, namespace, key digest, token_count, dtype, layout, ndim, pad,
# shape[8], payload_len, then the checksum area: v1 = reserved 4 bytes + CRC32, v2 = XXH3-64.
_FIELDS = f"<4sHH32s32sIBBBB{_MAX_DIMS}IQ"
_HEADER_V1 = struct.Struct(_FIELDS + "4sI")
_HEADER_V2 = struct.Struct(_FIELDS + "Q")
HEADER_BYTES = _HEADER_V2.size
assert _HEADER_V1.size == HEADER_BYTES == 128
_SUM_OFFSET = HEADER_BYTES - 8  # v2: the XXH3 covers header[:120]
_CRC_OFFSET = HEADER_BYTES - 4  # v1: the CRC32 covers header[:124]

DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float8_e4m3fn": 4,
    "float8_e5m2": 5,
    "uint8": 6,
    "int8": 7,
}
LAYOUT_CODES: dict[str, int] = {"layer_first": 1, "page_first": 2, "page_first_direct": 3, "raw": 4}
_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_LAYOUTS = {v: k for k, v in LAYOUT_CODES.items()}


@functools.lru_cache(maxsize=1 << 14)
def key_digest(key: str) -> bytes:
    """The 32 bytes a record carries to name its key (a misplaced record is detected by it).
    Cached: the page written is soon read back, and a popular page is read again and again."""
    return hashlib.sha256(key.encode()).digest()


def checksum_v2(header: memoryview | bytes, payload: memoryview | bytes) -> int:
    """The version-2 checksum: XXH3-64 (seed 0) of `header[:120]` followed by `payload`, hashed
    in place (streaming; no concatenated copy)."""
    h = xxhash.xxh3_64()
    h.update(header[:_SUM_OFFSET])
    h.update(payload)
    return h.intdigest()


def checksum_v1(header: memoryview | bytes, payload: memoryview | bytes) -> int:
    """The version-1 checksum: CRC32 (zlib) of `header[:124]` then `payload`."""
    return zlib.crc32(payload, zlib.crc32(header[:_CRC_OFFSET]))


class RecordHeader(NamedTuple):
    """A record's header fields, as `verify_record` found them (a NamedTuple: one is built per
    record read, and a tuple builds several times faster than a frozen dataclass)."""

    version: int
    namespace: bytes
    key_digest: bytes
    token_count: int
    dtype: str
    layout: str
    shape: tuple[int, ...]
    payload_len: int
    compression: int = 0  # hicache_client.compression id (version 3; 0 = stored raw)


def verify_record(record: memoryview | bytes, key: str, *, checksum: bool = True) -> RecordHeader:
    """Check a whole record (magic, version, length, key, checksum); return its header.

    Raises `StorageCorrupt` naming the first check that failed. Needs no knowledge of the page
    format, so every backend can validate what it reads. `checksum=False` skips only the
    checksum, for a record that `StorageBackend.batch_get` has just verified. Thread-safe; the
    version-2 checksum releases the GIL.
    """
    mv = memoryview(record).cast("B")
    if len(mv) < HEADER_BYTES:
        raise StorageCorrupt(f"record of {len(mv)} bytes is shorter than its header")
    # magic, version, header_len, namespace, key digest, token_count, dtype, layout, ndim, pad,
    # shape[8], payload_len, checksum (indexed, not unpacked: this runs once per record read)
    f = _HEADER_V2.unpack_from(mv)
    magic, version, header_len, payload_len = f[0], f[1], f[2], f[-2]
    if magic != RECORD_MAGIC:
        raise StorageCorrupt(f"bad magic {magic!r}")
    if version not in READ_VERSIONS:
        raise StorageCorrupt(f"unsupported record version {version}")
    if header_len != HEADER_BYTES:
        raise StorageCorrupt(f"bad header length {header_len}")
    if len(mv) != HEADER_BYTES + payload_len:
        raise StorageCorrupt(
            f"record is {len(mv)} bytes, header says {HEADER_BYTES + payload_len}"
        )
    if checksum:
        if version >= 2:
            stored = f[-1]
            actual = checksum_v2(mv, mv[HEADER_BYTES:])
        else:
            stored = _HEADER_V1.unpack_from(mv)[-1]
            actual = checksum_v1(mv, mv[HEADER_BYTES:])
        if actual != stored:
            raise StorageCorrupt(
                f"checksum mismatch (record v{version}: stored {stored:#x}, computed {actual:#x})"
            )
    if f[4] != key_digest(key):
        raise StorageCorrupt(f"record belongs to another key than {key[:16]}...")
    dtype, layout, ndim = _DTYPES.get(f[6]), _LAYOUTS.get(f[7]), f[8]
    if dtype is None or layout is None or ndim > _MAX_DIMS:
        raise StorageCorrupt("unknown dtype, layout or rank")
    return RecordHeader(version, f[3], f[4], f[5], dtype, layout, f[10 : 10 + ndim], payload_len,
                        f[9] if version == COMPRESSED_VERSION else 0)


class PageCodec:
    """Encodes and decodes the records of one page format (namespace, dtype, shape, layout).

    Writes version-2 records (XXH3-64), or version 3 where `compression` is not "none" (then
    `encode_compressed`; see the module docstring); reads versions 1 to 3. `compression` is
    checked here, at start-up: an unknown name or a dtype it does not take is a `ConfigError`.
    """

    def __init__(
        self,
        *,
        namespace: bytes,
        dtype: str,
        shape: Sequence[int],
        layout: str,
        tokens_per_page: int,
        itemsize: int,
        compression: str = "none",
    ) -> None:
        if len(namespace) != 32:
            raise ConfigError("namespace must be a 32-byte seed")
        if dtype not in DTYPE_CODES:
            raise ConfigError(f"dtype {dtype!r} has no record code; known: {sorted(DTYPE_CODES)}")
        if layout not in LAYOUT_CODES:
            raise ConfigError(f"layout {layout!r} has no record code")
        if len(shape) > _MAX_DIMS:
            raise ConfigError(f"page shape has more than {_MAX_DIMS} dims")
        self.namespace = namespace
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self.layout = layout
        self.tokens_per_page = tokens_per_page
        n = 1
        for d in self.shape:
            n *= d
        self.payload_bytes = n * itemsize
        self.record_bytes = HEADER_BYTES + self.payload_bytes  # of an uncompressed record
        self.compression = compression
        self._compressions: dict[int, Any] = {}
        self._writer = None if compression == "none" else self._compression_by_name(compression)

    def _compression_by_name(self, name: str) -> Any:
        from hicache_client.compression import get_compression

        c = get_compression(name, self.dtype)
        self._compressions[c.id] = c
        return c

    def _compression_by_id(self, cid: int) -> Any:
        c = self._compressions.get(cid)
        if c is None:
            from hicache_client.compression import BY_ID

            cls = BY_ID.get(cid)
            if cls is None:
                raise StorageCorrupt(f"record names compression {cid}, which this reader lacks")
            try:
                c = self._compression_by_name(cls.name)
            except ConfigError as e:
                raise StorageCorrupt(f"record's compression cannot decode this page: {e}") from e
        return c

    @property
    def last_dim(self) -> int:
        return self.shape[-1] if self.shape else 1

    def _header(self, key: str, payload_len: int, version: int = RECORD_VERSION,
                compression: int = 0) -> bytes:
        dims = list(self.shape) + [0] * (_MAX_DIMS - len(self.shape))
        return _HEADER_V2.pack(
            RECORD_MAGIC,
            version,
            HEADER_BYTES,
            self.namespace,
            key_digest(key),
            self.tokens_per_page,
            DTYPE_CODES[self.dtype],
            LAYOUT_CODES[self.layout],
            len(self.shape),
            compression,
            *dims,
            payload_len,
            0,
        )

    def encode_into(self, key: str, payload: memoryview | bytes, out: memoryview) -> None:
        """Write the record for `payload` into `out` (exactly `record_bytes` long)."""
        p = memoryview(payload).cast("B")
        if len(p) != self.payload_bytes:
            raise ValueError(f"payload is {len(p)} bytes, page format needs {self.payload_bytes}")
        o = memoryview(out).cast("B")
        if len(o) != self.record_bytes:
            raise ValueError(f"out is {len(o)} bytes, a record is {self.record_bytes}")
        head = self._header(key, len(p))
        o[HEADER_BYTES:] = p
        o[:_SUM_OFFSET] = head[:_SUM_OFFSET]
        o[_SUM_OFFSET:HEADER_BYTES] = struct.pack("<Q", checksum_v2(head, p))

    def encode(self, key: str, payload: memoryview | bytes) -> bytearray:
        out = bytearray(self.record_bytes)
        self.encode_into(key, payload, memoryview(out))
        return out

    def encode_compressed(self, key: str, payload: memoryview | bytes) -> bytes:
        """The record of `payload` with this codec's compression: a version-3 record of the
        encoded bytes (a plain version-2 record when the compression is "none")."""
        p = memoryview(payload).cast("B")
        if self._writer is None:
            return bytes(self.encode(key, p))
        if len(p) != self.payload_bytes:
            raise ValueError(f"payload is {len(p)} bytes, page format needs {self.payload_bytes}")
        blob = self._writer.encode([p], last_dim=self.last_dim)[0]
        head = self._header(key, len(blob), COMPRESSED_VERSION, self._writer.id)
        return head[:_SUM_OFFSET] + struct.pack("<Q", checksum_v2(head, blob)) + blob

    def decode_into(
        self, record: memoryview | bytes, key: str, out: memoryview, *, checksum: bool = True
    ) -> RecordHeader:
        """Validate `record` as this format's page `key` and write its page into `out`
        (`payload_bytes`), decoding whatever compression the record names. Raises
        `StorageCorrupt` (a miss) for a record that fails any check, names a compression this
        reader lacks, is lossy under another compression than this reader's, or does not
        decode."""
        header = self._check(record, key, checksum)
        o = memoryview(out).cast("B")
        if len(o) != self.payload_bytes:
            raise ValueError(f"out is {len(o)} bytes, a page is {self.payload_bytes}")
        body = memoryview(record).cast("B")[HEADER_BYTES:]
        if header.compression == 0:
            if len(body) != self.payload_bytes:
                raise StorageCorrupt(f"payload is {len(body)} bytes, a page is "
                                     f"{self.payload_bytes}")
            o[:] = body
            return header
        c = self._compression_by_id(header.compression)
        if not c.exact and (self._writer is None or self._writer.id != c.id):
            raise StorageCorrupt(f"record is lossy ({c.name}); this reader asked for "
                                 f"{self.compression}")
        try:
            c.decode_into([body], [o], last_dim=self.last_dim)
        except StorageCorrupt:
            raise
        except Exception as e:  # a blob that passed its checksum but does not decode
            raise StorageCorrupt(f"compressed page does not decode: {e}") from e
        return header

    def decode(
        self, record: memoryview | bytes, key: str, *, checksum: bool = True
    ) -> memoryview:
        """Validate `record` as this format's page `key`; return a view of its payload.
        `checksum=False`: the record came from `StorageBackend.batch_get`, which checked it.
        A compressed (version-3) record is refused here: it has no payload view; read it with
        `decode_into`."""
        header = self._check(record, key, checksum)
        if header.compression:
            raise StorageCorrupt("record is compressed; decode_into reads it")
        return memoryview(record).cast("B")[HEADER_BYTES:]

    def _check(self, record: memoryview | bytes, key: str, checksum: bool) -> RecordHeader:
        header = verify_record(record, key, checksum=checksum)
        if header.namespace != self.namespace:
            raise StorageCorrupt("record is from another namespace")
        if (header.dtype, header.layout, header.shape, header.token_count) != (
            self.dtype,
            self.layout,
            self.shape,
            self.tokens_per_page,
        ):
            raise StorageCorrupt(
                f"record format {header.dtype}/{header.layout}/{header.shape}/"
                f"{header.token_count} does not match {self.dtype}/{self.layout}/{self.shape}/"
                f"{self.tokens_per_page}"
            )
        return header


# -- records held in several buffers (a header buffer, then a page's regions) ------------
# Both versions end the header with payload_len (u64) and the 8-byte checksum area.
_LEN_AT = HEADER_BYTES - 16


def record_head(parts: Sequence[memoryview]) -> bytes:
    """The first `HEADER_BYTES` bytes of the record held in `parts` (fewer when it is shorter)."""
    if parts and len(parts[0]) >= HEADER_BYTES:
        return bytes(parts[0][:HEADER_BYTES])
    out = bytearray()
    for p in parts:
        out += p[: HEADER_BYTES - len(out)]
        if len(out) >= HEADER_BYTES:
            break
    return bytes(out)


def _payload(parts: Sequence[memoryview]) -> Iterator[memoryview]:
    """The record's bytes after its header, part by part (views, no copy)."""
    skip = HEADER_BYTES
    for p in parts:
        if skip >= len(p):
            skip -= len(p)
            continue
        yield p[skip:] if skip else p
        skip = 0


def verify_record_head(head: bytes, key: str, length: int) -> RecordHeader:
    """Every check of `verify_record` that needs only a record's first
    `HEADER_BYTES` bytes (`head`) and its length: magic, version, header length, length, key
    digest, dtype / layout / rank. Not the checksum. Returns the header or raises
    `StorageCorrupt`."""
    if length < HEADER_BYTES or len(head) < HEADER_BYTES:
        raise StorageCorrupt(f"record of {length} bytes is shorter than its header")
    payload_len = int.from_bytes(head[_LEN_AT:_SUM_OFFSET], "little")
    stub = bytearray(head[:HEADER_BYTES])  # the header of a record with no payload
    stub[_LEN_AT:_SUM_OFFSET] = bytes(8)
    header = verify_record(memoryview(stub), key, checksum=False)
    if length != HEADER_BYTES + payload_len:
        raise StorageCorrupt(f"record is {length} bytes, header says {HEADER_BYTES + payload_len}")
    return header._replace(payload_len=payload_len)


def verify_record_parts(parts: Sequence[memoryview], key: str) -> RecordHeader:
    """`verify_record` of a record held in `parts` (flat byte views, in order):
    the same checks, the checksum streamed over the parts where they are (no copy; XXH3
    releases the GIL). Returns the header or raises `StorageCorrupt`."""
    head = record_head(parts)
    header = verify_record_head(head, key, sum(len(p) for p in parts))
    _verify_sum(head, header.version, parts)
    return header


def verify_copied_parts(parts: Sequence[memoryview], head: bytes, version: int) -> None:
    """The rest of `verify_record_parts` for a record whose header `head` passed
    `verify_record_head` (version `version`) where it lay before it was copied into `parts`:
    the copy starts with exactly that header, and its checksum holds over the parts. Raises
    `StorageCorrupt`."""
    if record_head(parts) != head:
        raise StorageCorrupt("record header changed while it was copied")
    _verify_sum(head, version, parts)


def _verify_sum(head: bytes, version: int, parts: Sequence[memoryview]) -> None:
    """The checksum of the record held in `parts` (header `head`), streamed over them."""
    if version >= 2:
        h = xxhash.xxh3_64()
        h.update(head[:_SUM_OFFSET])
        for v in _payload(parts):
            h.update(v)
        stored, actual = int.from_bytes(head[_SUM_OFFSET:], "little"), h.intdigest()
    else:
        crc = zlib.crc32(head[:_CRC_OFFSET])
        for v in _payload(parts):
            crc = zlib.crc32(v, crc)
        stored, actual = int.from_bytes(head[_CRC_OFFSET:], "little"), crc
    if actual != stored:
        raise StorageCorrupt(f"checksum mismatch (record v{version}: stored {stored:#x}, "
                             f"computed {actual:#x})")


def encode_record_header(
    codec: PageCodec, key: str, payload: Sequence[memoryview], out: memoryview
) -> None:
    """Write into `out` (`HEADER_BYTES`) the header `codec.encode(key, ...)` puts before the
    payload held in `payload` (flat byte views, in order), its checksum streamed over them
    where they are: `out` followed by the parts is then that record, byte for byte."""
    n = sum(len(p) for p in payload)
    if n != codec.payload_bytes:
        raise ValueError(f"payload is {n} bytes, page format needs {codec.payload_bytes}")
    if len(out) != HEADER_BYTES:
        raise ValueError(f"a header is {HEADER_BYTES} bytes, not {len(out)}")
    head = codec._header(key, n)  # the fields; the checksum area is written here
    h = xxhash.xxh3_64()
    h.update(head[:_SUM_OFFSET])
    for p in payload:
        h.update(p)
    out[:_SUM_OFFSET] = head[:_SUM_OFFSET]
    out[_SUM_OFFSET:] = h.intdigest().to_bytes(8, "little")
