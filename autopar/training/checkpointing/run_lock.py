"""One training run per dump folder. Two runs writing one folder interleave their metrics and
delete each other's partial checkpoints, so the second is refused at start. The lock is an
``flock`` on ``<dump_folder>/.autopar.lock``: the kernel drops it when its process dies, so a
killed run never leaves the folder locked."""

from __future__ import annotations

import fcntl
import os
import shutil
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
    has it, or saying why the lock cannot be written (a full disk, a read-only folder). A
    folder made only for the lock is removed again if the run left it empty."""
    made = not folder.exists()
    path = folder / LOCK_NAME
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = _acquire(path, folder, made)
    except OSError as err:
        _remove_if_made(folder, made)
        raise _cannot_write(folder, err) from None
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(
                fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}".encode()
            )
        except OSError as err:
            raise _cannot_write(folder, err) from None
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)
        _remove_if_made(folder, made)


def _remove_if_made(folder: Path, made: bool) -> None:
    if made and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def _cannot_write(folder: Path, err: OSError) -> ConfigError:
    existing = folder
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free / 2**30
    return ConfigError(
        f"job.dump_folder={str(folder)!r}: cannot write its run lock ({err.strerror or err}; "
        f"{free:.1f} GiB free there); free space, or pick another --job.dump_folder"
    )


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
