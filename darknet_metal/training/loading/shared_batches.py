"""Batch arrays that loader processes write into and the trainer's device reads in place.

Each array is a file in a folder of the loader's own, on a RAM file system where there is
one (``/dev/shm`` on Linux), mapped shared by the trainer's process and by each worker
process. Space is reserved when an array is made, so a full file system is an error there
rather than a bus error on first write; when the RAM file system is full (a container's
``/dev/shm`` is often 64 MB), the arrays go to the temporary folder instead (on disk, through
the page cache). The folders are removed when the loader closes; a mapping stays valid after
that until its last array is dropped. A folder left by a process that was killed is removed
by the next loader that starts on the machine (its name holds the pid).
"""

from __future__ import annotations

import errno
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


def _roots() -> list[str]:
    """Where shared arrays go, in order: the RAM file system, then the temporary folder."""
    shm = "/dev/shm"
    roots = [shm] if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else []
    return list(dict.fromkeys([*roots, tempfile.gettempdir()]))


#: What a full file system raises (then the next root is tried).
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _remove_folders(folders: list[str]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


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
    mapping), :meth:`close` removes the folders. ``roots``: where folders may go, tried in
    order when one is full (default: ``/dev/shm``, then the temporary folder). Not
    thread-safe: the loader's caller alone makes arrays."""

    def __init__(self, roots: list[str] | None = None) -> None:
        self.roots = list(roots) if roots is not None else _roots()
        self._folders: list[str] = []
        self._count = 0
        # Also at exit, or when the loader is dropped without closing.
        self._remove = weakref.finalize(self, _remove_folders, self._folders)
        self._open(0)

    @property
    def folder(self) -> str:
        """The folder new arrays go to."""
        return self._folders[-1]

    def _open(self, at: int) -> None:
        root = self.roots[at]
        sweep_stale(root)
        self._folders.append(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-",
                                              dir=root))
        self._at = at

    def create(self, shape: tuple[int, ...]) -> tuple[str, np.ndarray]:
        """A zeroed float32 array of ``shape`` in a new shared file: (the file's path, the
        array). The array starts on a page boundary. OSError naming the folders when none
        has room."""
        nbytes = int(np.prod(shape)) * 4
        size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        while True:
            path = os.path.join(self.folder, f"batch-{self._count}")
            try:
                mapping = _mapped_file(path, size)
                break
            except OSError as exc:
                if exc.errno not in _FULL:
                    raise
                if self._at + 1 < len(self.roots):
                    self._open(self._at + 1)
                    continue
                raise OSError(exc.errno, f"no room for a shared batch of "
                              f"{nbytes / 2**20:.0f} MiB in {', '.join(self.roots)} (loader "
                              "processes need it: free space there, or train with a smaller "
                              "batch)") from None
        self._count += 1
        return path, np.frombuffer(mapping, np.float32, int(np.prod(shape))).reshape(shape)

    def close(self) -> None:
        """Removes the folders (the arrays made stay valid while they are referenced)."""
        self._remove()


def _mapped_file(path: str, size: int) -> mmap.mmap:
    """A new file of ``size`` bytes at ``path``, its space reserved, mapped shared; nothing
    is left at ``path`` when that fails."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


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

