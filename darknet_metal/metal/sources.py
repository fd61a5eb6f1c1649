"""Where the kernel sources and their translators are: the installed package data, or the
source tree.

An installed package carries ``darknet_metal/metal/toolchain``, a copy of the source tree's
``shaders/`` and ``shim/`` files that run-time builds read (the ``.metal`` kernels and their
headers, the translators to C++ and CUDA, the emulator's and CUDA's preludes), laid out as in
the source tree. An editable install reads the source tree itself.
"""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_INSTALLED = os.path.join(_HERE, "toolchain")
_SOURCE_TREE = os.path.normpath(os.path.join(_HERE, os.pardir, os.pardir))
#: A file every toolchain root has.
_MARKER = os.path.join("shim", "emu", "metal2cpp.py")


def toolchain_root() -> str:
    """The folder holding ``shaders/`` and ``shim/``: the installed copy if present, else the
    source tree. FileNotFoundError when neither is there."""
    for root in (_INSTALLED, _SOURCE_TREE):
        if os.path.isfile(os.path.join(root, _MARKER)):
            return root
    raise FileNotFoundError(
        f"the kernel sources are missing: neither {_INSTALLED} nor {_SOURCE_TREE} holds "
        f"{_MARKER}; reinstall darknet-metal"
    )


def shader_dirs() -> list[str]:
    """Directories whose ``*.metal`` sources make the Metal library."""
    root = toolchain_root()
    return [os.path.join(root, "shaders"), os.path.join(root, "shim", "kernels")]


def kernel_sources() -> list[str]:
    """Every ``.metal`` file, in build order (``shaders/`` then ``shim/kernels/``, sorted)."""
    found = []
    for directory in shader_dirs():
        if os.path.isdir(directory):
            found += sorted(
                os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".metal")
            )
    return found


def shader_header(name: str) -> str:
    """Path of a header next to the kernels (e.g. ``dm_args.h``); FileNotFoundError if none."""
    for directory in shader_dirs():
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{name} not found in {', '.join(shader_dirs())}")
