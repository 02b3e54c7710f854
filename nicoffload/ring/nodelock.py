"""One communicator per ring node: an exclusive, non-blocking ``flock`` on a file beside the
node's state file, held for the communicator's life (the kernel drops it when the process dies,
kill -9 included). Two processes staging into the same mmap-ed ``ring_local`` would mix their
tensors silently; the second one is refused instead, naming the first."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from nicoffload.errors import InputError


class NodeLock:
    def __init__(self, path: Path, what: str):
        self.path, self.fd = path, -1
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise InputError(f"{what} is in use by another communicator (pid {holder}); one process per ring "
                                 f"node at a time: wait for it or stop it") from None
            try:  # the holder before us may have removed the file between our open and our lock
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.unlink(self.path)  # while still holding it: nobody can lock this inode after us
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = -1


def remove_unheld(path: Path) -> None:
    """Remove the lock file ``path`` if no process holds it (one a killed communicator left)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
    except (BlockingIOError, FileNotFoundError):
        pass
    finally:
        os.close(fd)
