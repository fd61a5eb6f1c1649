"""Why Pillow could not decode an image, in words that name no file: the caller names the file
(or the request body) once, where its message starts."""

from __future__ import annotations

import re

__all__ = ["decode_failure"]

# Pillow's own messages end with the file they were given: its path, or a file object's repr.
_FILE_NAMED = re.compile(r"\s*(?:'[^']*'|<[^<>]* object at 0x[0-9a-fA-F]+>)\s*$")


def decode_failure(exc: BaseException) -> str:
    """What ``exc`` (raised by Pillow opening or loading an image) says went wrong: "not in a
    format Pillow reads" for an unidentified image, else the exception's kind and text with
    the file Pillow named left out."""
    if type(exc).__name__ == "UnidentifiedImageError":
        return "not in any image format Pillow reads"
    text = _FILE_NAMED.sub("", str(exc)).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
