"""Sealed page records: AES-256-GCM under a key the engines of one tenant hold and the server
never sees (the `hicache` backend's ``encryption_key``).

A sealed record is what the server stores, serves, keeps in its arena and writes to disk::

    header'   128 bytes: the record's header (hicache_client.codec) with magic ``HKVS`` and the
              checksum field encrypted (below); readable (namespace, key digest, shape,
              lengths) so the server can still clear by namespace and count pages
    nonce     12 random bytes
    sealed    the payload, encrypted, then the 16-byte GCM tag

The associated data is header' and the page key, so a sealed record moved under another key,
or with any header byte changed, does not open. The tag replaces the checksum as the reader's
check (a checksum of the plaintext in the clear would confirm a guessed page): the plain
record's checksum travels encrypted in header's checksum field, XORed with the first 8 bytes
of AES-256(key, nonce || 0x00000000), a counter block GCM never uses for that nonce (its tag
block is nonce || 1, its data blocks count from 2), so `open_into` writes the record back with
magic ``HKVP`` and its checksum without another pass over the payload. A record sealed before
this (checksum field zero) has its checksum recomputed.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hicache_client.codec import HEADER_BYTES, RECORD_MAGIC, checksum_v2
from hicache_client.errors import ConfigError

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
        self._aes = algorithms.AES(key)
        self._block = Cipher(self._aes, modes.ECB())
        self._local = threading.local()  # per thread: an ECB encryptor (not thread-safe)

    def _pad(self, nonce: bytes | memoryview) -> bytes:
        """The 8 bytes the checksum is XORed with: AES(key, nonce || counter 0)."""
        enc = getattr(self._local, "enc", None)
        if enc is None:
            enc = self._local.enc = self._block.encryptor()
        return bytes(enc.update(bytes(nonce) + b"\0\0\0\0")[:8])

    @staticmethod
    def refuses(header: memoryview) -> str | None:
        """Why a record with this header is not sealed (not a version-2 page record), or None."""
        if len(header) != HEADER_BYTES or bytes(header[:4]) != RECORD_MAGIC \
                or struct.unpack_from("<H", header, _VERSION_AT)[0] != 2:
            return "only version-2 page records are sealed"
        return None

    def seal_into(self, key: str, header: memoryview, payload: memoryview | Sequence[memoryview],
                  out: memoryview) -> None:
        """Write the sealed record of (`header`, `payload`) into `out` (its length is
        `HEADER_BYTES + len(payload) + OVERHEAD`). `payload` may be several flat byte views
        one after the other (a page's regions in a host pool): they are sealed where they lie,
        in one pass, with no staging copy (GCM fed part by part: the same bytes as sealing
        them joined)."""
        problem = self.refuses(header)
        if problem is not None:
            raise ValueError(problem)
        parts = (payload,) if isinstance(payload, memoryview) else payload
        body = out[HEADER_BYTES + NONCE_BYTES:]
        if sum(len(p) for p in parts) + TAG_BYTES != len(body):
            raise ValueError(f"a sealed record of {sum(len(p) for p in parts)} payload bytes "
                             f"takes {HEADER_BYTES + OVERHEAD} bytes more, not "
                             f"{len(out) - sum(len(p) for p in parts)}")
        out[:HEADER_BYTES] = header
        out[:4] = SEALED_MAGIC
        nonce = os.urandom(NONCE_BYTES)
        total = int.from_bytes(header[_SUM_AT:HEADER_BYTES], "little")
        enc_sum = total ^ int.from_bytes(self._pad(nonce), "little")
        # (0 is left for records sealed without it: a 2**-64 chance, then it is recomputed)
        out[_SUM_AT:HEADER_BYTES] = enc_sum.to_bytes(8, "little")
        out[HEADER_BYTES:HEADER_BYTES + NONCE_BYTES] = nonce
        aad = bytes(out[:HEADER_BYTES]) + key.encode()
        if len(parts) == 1:
            self._aead.encrypt_into(nonce, parts[0], aad, body)
            return
        enc = Cipher(self._aes, modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(aad)
        at = 0
        for part in parts:  # body[at:] has room for the part and the tag (update_into's slack)
            at += enc.update_into(part, body[at:])
        enc.finalize()
        body[at:] = enc.tag

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
        enc_sum = int.from_bytes(head[_SUM_AT:], "little")
        if enc_sum:
            total = enc_sum ^ int.from_bytes(self._pad(nonce), "little")
        else:  # sealed before the checksum travelled encrypted: one pass more
            total = checksum_v2(out[:HEADER_BYTES], out[HEADER_BYTES:])
        out[_SUM_AT:HEADER_BYTES] = total.to_bytes(8, "little")
        return None
