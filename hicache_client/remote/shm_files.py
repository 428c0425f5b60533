"""The files in /dev/shm that a client and a same-host `hicache-server` both map: the layout of
the server's store (the arena, `storage_backends.server.arena`) that a client reads in place,
and the check every mapped file passes before a peer maps it.

The arena, from offset 0 (the server writes it, clients read it; see the server's arena module
for the allocator):

    [0, 64)                header: magic, arena id, block size, table bytes, data bytes,
                           then (at `ALLOCATED_AT`) the data bytes tmpfs space is reserved for
    [64, 64 + table)       generation table: one little-endian u64 per data block
    [data_start, size)     data blocks (`BLOCK` bytes); a record takes a run of whole blocks
"""

from __future__ import annotations

import os
import stat
import struct

SHM_DIR = "/dev/shm"
BLOCK = 4096
HEADER = struct.Struct("<8sQQQQ")  # magic, arena id, block bytes, table bytes, data bytes
ALLOCATED_AT = HEADER.size  # u64: data bytes (from the data start) tmpfs space is reserved for
HEADER_BYTES = 64
MAGIC = b"HCARENA1"
NAME_PREFIX = "hicache-store-"


def private_file_problem(st: os.stat_result, size: int) -> str | None:
    """Why an opened file in /dev/shm may not be mapped by a peer of this user (it must be a
    regular file of this user, mode 0600, of exactly `size` bytes), or None. Used by the server
    for a client's region and by the client for the server's store."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return "belongs to another user"
    if st.st_mode & 0o077:
        return "is readable by others (mode must be 0600)"
    if st.st_size != size:
        return f"is {st.st_size} bytes, not {size}"
    return None
