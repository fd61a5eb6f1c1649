"""Where the Metal sources are: the installed package data, or the source tree."""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def shader_dirs() -> list[str]:
    """Directories whose ``*.metal`` sources make the Metal library: the installed package
    data (``darknet_metal/metal/shaders``) if present, else the source tree's ``shaders/``
    and ``shim/kernels/`` (editable installs)."""
    installed = os.path.join(_HERE, "shaders")
    if os.path.isdir(installed) and any(n.endswith(".metal") for n in os.listdir(installed)):
        return [installed]
    root = os.path.join(_HERE, os.pardir, os.pardir)
    return [os.path.join(root, "shaders"), os.path.join(root, "shim", "kernels")]


def shader_header(name: str) -> str:
    """Path of a header next to the kernels (e.g. ``dm_args.h``); FileNotFoundError if none."""
    for directory in shader_dirs():
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{name} not found in {', '.join(shader_dirs())}")
