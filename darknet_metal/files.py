"""Files written whole or not at all, with the permissions any new file gets (the umask)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from typing import BinaryIO


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(file)`` into a temporary file beside it, then rename it
    over ``path``: readers see the old file or the new one, never a part, and a failure leaves
    neither a partial file nor the temporary one behind.

    The temporary file is created with mode 0666 minus the process umask, as ``open`` would
    create ``path`` (``tempfile.mkstemp`` would give 0600, and the rename keeps it), and with
    O_EXCL, so nothing is written through a file or link that appeared under its name.
    An OSError from creating it names ``path`` (and a missing folder as such), not the
    temporary file.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileNotFoundError:
        raise FileNotFoundError(f"cannot write {path}: the folder {directory} does not "
                                "exist") from None
    except OSError as exc:
        raise type(exc)(exc.errno, f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
