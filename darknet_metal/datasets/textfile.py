"""Reading the text files of a dataset line by line, as Darknet's ``fgetl`` splits them.

Lines end at ``\\n``; one ``\\r`` before it (Windows line endings) is dropped, as Darknet
does. Bytes are decoded as file names are (UTF-8, undecodable bytes kept as surrogate
escapes), so any path the file system accepts survives the round trip.
"""

from __future__ import annotations

import os
from pathlib import Path

from darknet_metal.errors import DatasetError

__all__ = ["read_lines", "read_bytes"]


def read_bytes(path: str | os.PathLike[str], what: str) -> bytes:
    """The whole content of ``path``; ``DatasetError`` naming ``what`` (e.g. "image list")
    and the path when it is missing, a folder or unreadable."""
    p = Path(path)
    if p.is_dir():
        raise DatasetError(f"is a folder, not {_a(what)}", path=p)
    try:
        return p.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{what} not found", path=p) from None
    except OSError as exc:
        raise DatasetError(f"cannot read {what}: {exc.strerror or exc}", path=p) from None


def read_lines(path: str | os.PathLike[str], what: str) -> list[tuple[int, str]]:
    """``(line number, text)`` for each line of ``path`` (1-based), line endings removed."""
    return split_lines(read_bytes(path, what))


def split_lines(data: bytes) -> list[tuple[int, str]]:
    """``(line number, text)`` per line of ``data``: split at ``\\n``, one trailing ``\\r``
    dropped; a final line without ``\\n`` counts, an empty one after the last ``\\n`` not."""
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    lines = []
    for number, raw in enumerate(parts, start=1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        lines.append((number, os.fsdecode(raw)))
    return lines


def _a(what: str) -> str:
    return f"{'an' if what[0] in 'aeiou' else 'a'} {what}"
