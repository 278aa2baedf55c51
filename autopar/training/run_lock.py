"""One training run per dump folder. Two runs writing one folder interleave their metrics and
delete each other's partial checkpoints, so the second is refused at start. The lock is an
``flock`` on ``<dump_folder>/.autopar.lock``: the kernel drops it when its process dies, so a
killed run never leaves the folder locked."""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from autopar.config import ConfigError

LOCK_NAME = ".autopar.lock"


@contextmanager
def dump_folder_lock(folder: Path) -> Iterator[None]:
    """Hold the folder's lock while entered; ConfigError naming the holder when another run
    has it. A folder made only for the lock is removed again if the run left it empty."""
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = _acquire(path, folder, made)
    try:
        os.ftruncate(fd, 0)
        os.write(
            fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}".encode()
        )
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)
        if made and not any(folder.iterdir()):
            folder.rmdir()


def _acquire(path: Path, folder: Path, made: bool) -> int:
    """An open descriptor of ``path`` holding its lock. A holder unlinks the file before
    releasing it, so a lock won on an unlinked file is retried on the new one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace") or "another process"
            os.close(fd)
            raise ConfigError(
                f"job.dump_folder={str(folder)!r} is in use by another run ({holder}); wait for it to "
                "finish, stop it, or pick another --job.dump_folder"
            ) from None
        if path.exists() and os.stat(path).st_ino == os.fstat(fd).st_ino:
            return fd
        os.close(fd)
