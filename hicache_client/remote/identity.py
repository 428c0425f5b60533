"""The server's identity key: an Ed25519 key pair that `hicache-server --server-key FILE` holds
and whose public half clients pin (``server_public_key``; `hicache-admin --server-public-key`).

The server signs every hello reply: the signature covers a context tag naming the protocol version,
the hello's token id, the client's nonce, the server's nonce and the server's token proof
(`transcript`). The client's nonce is fresh per connection, so a signature cannot be replayed,
and only a server holding the private key makes one: a client that pins the public key refuses
any other server at start-up, whatever tokens it knows.

Key files: the private key is PKCS#8 PEM, written mode 0600 (``hicache-server
--generate-server-key FILE``, which also writes ``FILE.pub`` and prints the public key) and
refused when group or world can read it. A public key is given as 64 hex characters (the raw
32 bytes) or as the path of a file holding them (``FILE.pub``) or a PEM public key.

Needs the ``cryptography`` package (a dependency of ``hicache``; the client's ``[encryption]``
extra): imported only where a key is used.
"""

from __future__ import annotations

import os
import stat

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from hicache_client.errors import ConfigError

CONTEXT = b"hicache-server-key/v1 hello protocol 7\0"  # the protocol's version is bound in


def transcript(token_id: str, client_nonce: bytes, nonce: bytes, proof: str) -> bytes:
    """What the server signs in its hello reply (each part length-prefixed)."""
    out = bytearray(CONTEXT)
    for part in (token_id.encode(), client_nonce, nonce, proof.encode()):
        out += len(part).to_bytes(2, "little") + part
    return bytes(out)


def public_hex(key: Ed25519PrivateKey) -> str:
    """The raw public key of `key`, in hex (what clients are given)."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)
    return raw.hex()


def generate_key_file(path: str) -> str:
    """Write a new private key to `path` (mode 0600; an existing file is refused) and its
    public key to `path.pub`; returns the public key in hex."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"server key {path}: the file exists (not overwritten)") from None
    except OSError as e:
        raise ConfigError(f"server key {path}: {e.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub = public_hex(key)
    with open(path + ".pub", "w") as f:
        f.write(pub + "\n")
    return pub


def load_private_key(path: str) -> Ed25519PrivateKey:
    """The server's private key from `path`; `ConfigError` for a file that group or world can
    read, that is missing, or that holds no Ed25519 private key."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"--server-key {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"--server-key {path}: readable by group or others (mode "
                          f"{stat.S_IMODE(st.st_mode):o}); chmod 600 it")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--server-key {path}: not an unencrypted PEM private key ({e})") \
            from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"--server-key {path}: not an Ed25519 key "
                          "(make one with hicache-server --generate-server-key FILE)")
    return key


def parse_public_key(text: str, what: str = "server_public_key") -> Ed25519PublicKey:
    """A pinned public key: 64 hex characters, or the path of a file holding them or a PEM
    public key. `ConfigError` names what is wrong."""
    text = text.strip()
    if len(text) != 64 or not all(c in "0123456789abcdefABCDEF" for c in text):
        try:
            with open(text, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ConfigError(f"{what}: {text!r} is neither 64 hex characters nor a readable "
                              f"key file ({e.strerror})") from None
        if data.lstrip().startswith(b"-----BEGIN"):
            try:
                pem = serialization.load_pem_public_key(data)
            except ValueError as e:
                raise ConfigError(f"{what}: {text}: not a PEM public key ({e})") from None
            if not isinstance(pem, Ed25519PublicKey):
                raise ConfigError(f"{what}: {text}: not an Ed25519 public key")
            return pem
        text = data.decode(errors="replace").strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ConfigError(f"{what}: not an Ed25519 public key (64 hex characters, the "
                          "server's FILE.pub)")
    return Ed25519PublicKey.from_public_bytes(raw)


def sign(key: Ed25519PrivateKey, data: bytes) -> str:
    return key.sign(data).hex()


def verify(key: Ed25519PublicKey, signature: str, data: bytes) -> bool:
    """Whether `signature` (hex) is `key`'s over `data`."""
    try:
        key.verify(bytes.fromhex(signature), data)
    except (InvalidSignature, ValueError):
        return False
    return True
