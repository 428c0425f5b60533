"""Sealed page records: AES-256-GCM under a key the engines of one tenant hold and the server
never sees (the `hicache` backend's ``encryption_key``).

A sealed record is what the server stores, serves, keeps in its arena and writes to disk::

    header'   128 bytes: the record's header (hicache.codec) with magic ``HKVS`` and the
              checksum field zeroed; readable (namespace, key digest, shape, lengths) so the
              server can still clear by namespace and count pages
    nonce     12 random bytes
    sealed    the payload, encrypted, then the 16-byte GCM tag

The associated data is header' and the page key, so a sealed record moved under another key,
or with any header byte changed, does not open. The tag replaces the checksum (a checksum of
the plaintext in the clear would confirm a guessed page); `open_into` writes the record back
with magic ``HKVP`` and its checksum recomputed, so the caller checks it as any record.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hicache.codec import HEADER_BYTES, RECORD_MAGIC, checksum_v2
from hicache.errors import ConfigError

SEALED_MAGIC = b"HKVS"
NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = NONCE_BYTES + TAG_BYTES  # sealed record bytes beyond the plain record's
_SUM_AT = HEADER_BYTES - 8
_VERSION_AT = 4


def parse_key(text: str) -> bytes:
    """A 32-byte key from 64 hex characters (``openssl rand -hex 32``)."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ConfigError("hicache backend: encryption_key must be 64 hex characters (a 32-byte "
                          "AES-256 key, e.g. `openssl rand -hex 32`)")
    return key


class Sealer:
    """Seals and opens records under one key. Thread-safe (no state but the key)."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    @staticmethod
    def refuses(header: memoryview) -> str | None:
        """Why a record with this header is not sealed (not a version-2 page record), or None."""
        if len(header) != HEADER_BYTES or bytes(header[:4]) != RECORD_MAGIC \
                or struct.unpack_from("<H", header, _VERSION_AT)[0] != 2:
            return "only version-2 page records are sealed"
        return None

    def seal_into(self, key: str, header: memoryview, payload: memoryview,
                  out: memoryview) -> None:
        """Write the sealed record of (`header`, `payload`) into `out` (its length is
        `HEADER_BYTES + len(payload) + OVERHEAD`)."""
        problem = self.refuses(header)
        if problem is not None:
            raise ValueError(problem)
        out[:HEADER_BYTES] = header
        out[:4] = SEALED_MAGIC
        out[_SUM_AT:HEADER_BYTES] = bytes(8)
        nonce = os.urandom(NONCE_BYTES)
        out[HEADER_BYTES:HEADER_BYTES + NONCE_BYTES] = nonce
        aad = bytes(out[:HEADER_BYTES]) + key.encode()
        self._aead.encrypt_into(nonce, payload, aad, out[HEADER_BYTES + NONCE_BYTES:])

    def open_into(self, key: str, sealed: memoryview, out: memoryview) -> str | None:
        """Write the plain record of `sealed` into `out` (`OVERHEAD` bytes shorter); why it
        does not open (not sealed, another key or namespace key, altered), or None."""
        if len(sealed) != len(out) + OVERHEAD or len(out) < HEADER_BYTES:
            return f"sealed record is {len(sealed)} bytes, expected {len(out) + OVERHEAD}"
        head = bytes(sealed[:HEADER_BYTES])
        if head[:4] != SEALED_MAGIC:
            return ("record is not sealed (written by a client without encryption_key)"
                    if head[:4] == RECORD_MAGIC else "not a sealed page record")
        nonce = sealed[HEADER_BYTES:HEADER_BYTES + NONCE_BYTES]
        try:
            self._aead.decrypt_into(nonce, sealed[HEADER_BYTES + NONCE_BYTES:],
                                    head + key.encode(), out[HEADER_BYTES:])
        except InvalidTag:
            return "sealed record does not open under this encryption_key (or was altered)"
        out[:HEADER_BYTES] = head
        out[:4] = RECORD_MAGIC
        out[_SUM_AT:HEADER_BYTES] = checksum_v2(out[:HEADER_BYTES],
                                                out[HEADER_BYTES:]).to_bytes(8, "little")
        return None
