"""Low-level reads for the `file` backend: readinto a caller's buffer, buffered or O_DIRECT.

O_DIRECT needs the buffer address, the file offset and the length 4 KiB-aligned; a record is
rarely a whole number of blocks, so `read_direct` / `write_direct` move the aligned bulk straight
between the file and the caller's (aligned) buffer and only the last partial block through a
small aligned bounce buffer (a write then cuts the file back to the record's length).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading

import numpy as np

DIRECT_ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


def address(mv: memoryview) -> int:
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def read_buffered(fd: int, dst: memoryview) -> int:
    """readinto `dst` from offset 0 until full or EOF; the bytes read."""
    off, size = 0, len(dst)
    while off < size:
        n = os.preadv(fd, [dst[off:]], off)
        if n == 0:
            break  # truncated meanwhile: reported as a short (corrupt) record
        off += n
    return off


def read_direct(fd: int, dst: memoryview) -> int:
    """`read_buffered` for an O_DIRECT `fd` and a 4 KiB-aligned `dst`: the aligned bulk goes
    straight into `dst`, a last partial block through a 4 KiB aligned bounce buffer."""
    size = len(dst)
    bulk = size - size % DIRECT_ALIGN
    off = 0
    while off < bulk:
        n = os.preadv(fd, [dst[off:bulk]], off)
        if n == 0:
            return off
        off += n
    if off < size:
        bounce = _bounce()
        n = os.preadv(fd, [bounce], off)
        take = min(n, size - off)
        dst[off : off + take] = bounce[:take]
        off += take
    return off


_tls = threading.local()


def _bounce() -> memoryview:
    """A 4 KiB-aligned 4 KiB buffer of this thread (an anonymous mapping is page-aligned)."""
    buf: memoryview | None = getattr(_tls, "bounce", None)
    if buf is None:
        buf = memoryview(mmap.mmap(-1, DIRECT_ALIGN))
        _tls.bounce = buf
    return buf


def read_file(path: str, dst: memoryview, direct: bool) -> tuple[int, OSError | None]:
    """Read file `path` into `dst` if its size is `len(dst)`. Returns the file's size (or the
    bytes read, if it shrank meanwhile) and, when O_DIRECT was asked for and refused by the file
    system (EINVAL), that error (the read was then done buffered)."""
    refused: OSError | None = None
    try:
        fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    except OSError as e:
        if not direct or e.errno != errno.EINVAL:
            raise
        refused, direct = e, False
        fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != len(dst):
            return size, refused
        if direct:
            try:
                return read_direct(fd, dst), None
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                refused = e
        return read_buffered(fd, dst), refused
    finally:
        os.close(fd)


def write_direct(fd: int, src: memoryview) -> None:
    """Write `src` (at a 4 KiB-aligned address) to the new, empty O_DIRECT file `fd`: whole
    blocks straight from `src`, a last partial block through a zero-padded aligned bounce
    buffer, then the file cut back to `len(src)`."""
    size = len(src)
    bulk = size - size % DIRECT_ALIGN
    off = 0
    while off < bulk:
        off += os.pwritev(fd, [src[off:bulk]], off)
    if off < size:
        tail = size - off
        bounce = _bounce()
        bounce[:tail] = src[off:]
        bounce[tail:] = bytes(DIRECT_ALIGN - tail)
        if os.pwritev(fd, [bounce], off) != DIRECT_ALIGN:
            raise OSError(errno.EIO, "short O_DIRECT write")
        os.ftruncate(fd, size)


def _write_buffered(fd: int, src: memoryview) -> None:
    off = 0
    while off < len(src):
        off += os.pwrite(fd, src[off:], off)


def publish(
    fd: int, tmp: str, final: str, src: memoryview, fsync: str, direct: bool = False
) -> OSError | None:
    """Write `src` to the new temp file `tmp` (open as `fd`, with O_DIRECT when `direct`;
    closed here), sync it per `fsync` ("none" | "data" | "always": file and directory) and
    rename it to `final`. Returns the error with which the file system refused O_DIRECT (the
    write was then redone buffered), else None. Raises OSError after removing `tmp`."""
    refused: OSError | None = None
    try:
        try:
            if direct:
                try:
                    write_direct(fd, src)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    refused = e
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
                    os.ftruncate(fd, 0)
                    _write_buffered(fd, src)
            else:
                _write_buffered(fd, src)
            if fsync == "data":
                os.fdatasync(fd)
            elif fsync == "always":
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync == "always":
        dfd = os.open(os.path.dirname(final), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return refused
