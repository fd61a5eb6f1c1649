"""Batch arrays that loader processes write into and the trainer's device reads in place.

Each array is a file in a folder of the loader's own, on a RAM file system where there is
one (``/dev/shm`` on Linux; the temporary folder elsewhere), mapped shared by the trainer's
process and by each worker process. The folder is removed when the loader closes; a mapping
stays valid after that until its last array is dropped. A folder left by a process that was
killed is removed by the next loader that starts on the machine (its name holds the pid).
Space is reserved when an array is made, so a full file system raises ``OSError`` there
rather than a bus error on first write.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict

import numpy as np

__all__ = ["SharedBatches", "map_batch"]

FOLDER_PREFIX = "darknet-metal-loader-"
#: Mappings a worker process keeps (LRU): the arrays of the sizes in use.
WORKER_MAPPINGS = 16


def _ram_folder() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def sweep_stale(root: str) -> list[str]:
    """Removes the loader folders under ``root`` whose process is gone; returns them."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(FOLDER_PREFIX):
            continue
        pid_text = entry.name[len(FOLDER_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


class SharedBatches:
    """The shared batch arrays of one loader: :meth:`create` makes one (a file and its
    mapping), :meth:`close` removes the folder. Not thread-safe: the loader's caller alone
    makes arrays."""

    def __init__(self, root: str | None = None) -> None:
        root = _ram_folder() if root is None else root
        sweep_stale(root)
        self.folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=root)
        self._count = 0
        # Also at exit, or when the loader is dropped without closing.
        self._remove = weakref.finalize(self, shutil.rmtree, self.folder, True)

    def create(self, shape: tuple[int, ...]) -> tuple[str, np.ndarray]:
        """A zeroed float32 array of ``shape`` in a new shared file: (the file's path, the
        array). The array starts on a page boundary."""
        nbytes = int(np.prod(shape)) * 4
        size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        path = os.path.join(self.folder, f"batch-{self._count}")
        self._count += 1
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return path, np.frombuffer(mapping, np.float32, int(np.prod(shape))).reshape(shape)

    def close(self) -> None:
        """Removes the folder (the arrays made stay valid while they are referenced)."""
        self._remove()


_mapped: OrderedDict[str, np.ndarray] = OrderedDict()


def map_batch(path: str, shape: tuple[int, ...]) -> np.ndarray:
    """The array of shared file ``path`` (made by :meth:`SharedBatches.create` with
    ``shape``), mapped into this process once and kept among the last WORKER_MAPPINGS."""
    array = _mapped.pop(path, None)
    if array is None or array.shape != tuple(shape):
        with open(path, "r+b") as f:
            mapping = mmap.mmap(f.fileno(), 0)
        array = np.frombuffer(mapping, np.float32, int(np.prod(shape))).reshape(shape)
    _mapped[path] = array
    while len(_mapped) > WORKER_MAPPINGS:
        _mapped.popitem(last=False)
    return array

