"""3FS user-space ring I/O for the `hf3fs` backend (`hf3fs_fuse.io`), used when importable."""

from __future__ import annotations

import contextlib
import threading


class Usrbio:
    """3FS user-space ring I/O (`hf3fs_fuse.io`), used instead of pread/pwrite when present.

    Records are staged through one shared-memory iovec registered with the 3FS FUSE process
    (zero-copy between this process and FUSE; one memcpy from/to the caller's buffer). Cannot be
    exercised without a 3FS cluster: `HF3FSBackend` falls back to POSIX I/O on any error here.
    """

    def __init__(self, mount: str, slot_bytes: int, entries: int) -> None:
        from multiprocessing.shared_memory import SharedMemory

        from hf3fs_fuse import io as h3io

        self._io = h3io
        self._entries = entries
        self._slot = slot_bytes
        self._shm = SharedMemory(size=slot_bytes * entries, create=True)
        self._iov = h3io.make_iovec(self._shm, mount, 0, -1)
        self._shm.unlink()
        self._rd = h3io.make_ioring(mount, entries, True, 0)
        self._wr = h3io.make_ioring(mount, entries, False, 0)
        self._lock = threading.Lock()
        self._fds: set[int] = set()

    def register(self, fd: int) -> None:
        if fd not in self._fds:
            self._io.register_fd(fd)
            self._fds.add(fd)

    def run(self, ios: list[tuple[int, int, memoryview]], read: bool) -> list[int]:
        """(fd, offset, buffer) per I/O, at most `entries` of them; returns bytes moved each."""
        ring = self._rd if read else self._wr
        with self._lock:
            for i, (fd, off, buf) in enumerate(ios):
                self.register(fd)
                part = self._iov[i * self._slot : i * self._slot + len(buf)]
                if not read:
                    part[:] = buf
                ring.prepare(part, read, fd, off)
            results = ring.submit().wait(min_results=len(ios))
            done = [int(r.result) for r in results]
            if read:
                for i, (_fd, _off, buf) in enumerate(ios):
                    if done[i] == len(buf):
                        buf[:] = self._iov[i * self._slot : i * self._slot + len(buf)]
        return done

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(Exception):  # best effort at shutdown
                self._io.deregister_fd(fd)
        self._fds.clear()
