"""What a dispatch does, for profiles: its kernel, the layer it belongs to, and its
floating-point operations and bytes moved (``Kernel.work``: from the registry's extents and
the dispatch's arguments).

Each distinct ``Work`` gets a small integer tag, the ``tag`` a dispatch carries through the
shim into the device's profile records (``Device.profile_end``), so a record names the layer
and the work of its dispatch without any bookkeeping in the order of encoding. Tags are
process-wide and stable for the life of the process; equal work shares one tag (a staging
copy made each pass does not grow the table). Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from darknet_metal.metal import registry

__all__ = ["NO_LAYER", "Work", "dispatch_tag", "work_of_tag"]

#: The layer of a dispatch that belongs to no layer (a staging copy between passes).
NO_LAYER = -1


@dataclass(frozen=True)
class Work:
    """One dispatch's kernel, layer (``NO_LAYER`` for none), floating-point operations and
    bytes moved (the least traffic: every element its roles may touch, read once and
    written once)."""

    kernel: str
    layer: int
    flops: int
    bytes: int


_lock = threading.Lock()
_tags: dict[Work, int] = {}
_works: list[Work] = []


def dispatch_tag(kernel: str, args: Mapping[str, int | float], sizes: Mapping[str, int],
                 layer: int = NO_LAYER) -> int:
    """The tag (>= 1) of a dispatch of ``kernel`` with these arguments and grid sizes, made
    for ``layer``."""
    flops, moved = registry.kernel(kernel).work(args, sizes)
    work = Work(kernel, int(layer), flops, moved)
    with _lock:
        tag = _tags.get(work)
        if tag is None:
            _works.append(work)
            tag = _tags[work] = len(_works)
        return tag


def work_of_tag(tag: int) -> Work | None:
    """The work of a tag ``dispatch_tag`` gave; None for 0 (an untagged dispatch) or a tag
    it never gave."""
    with _lock:
        return _works[tag - 1] if 0 < tag <= len(_works) else None
