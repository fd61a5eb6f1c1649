"""Shorthands the kernel tables are written with: role constructors, expression builders the
extent grammar lacks, and the grid rules several shader families share."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Binding, Grid

__all__ = ["ELEMENTS", "PLANE_3D", "SPATIAL_3D", "equals", "flag", "read", "read_write",
           "write", "x_to_y"]

#: One thread per element of a flat array.
ELEMENTS = Grid(("n",), (256,))
#: One thread per (pixel, channel, image) of an (N, C, H*W) array.
SPATIAL_3D = Grid(("spatial", "channels", "batch"), (64, 4, 1))
#: One thread per output pixel of each (image, channel) plane.
PLANE_3D = Grid(("out_w", "out_h", "planes"), (16, 16, 1))


def read(role: str, extent: str, used_if: str = "") -> Binding:
    """A float32 role the kernel reads (``used_if``: see ``Binding``)."""
    return Binding("in", role, extent, used_if)


def write(role: str, extent: str) -> Binding:
    """A float32 role the kernel writes without reading it."""
    return Binding("out", role, extent)


def read_write(role: str, extent: str) -> Binding:
    """A float32 role the kernel updates in place (reads, then writes)."""
    return Binding("inout", role, extent)


def x_to_y(x: str, y: str) -> tuple[Binding, ...]:
    """The roles of a kernel reading ``x`` and writing ``y``, with these extents."""
    return (read("x", x), write("y", y))


def flag(name: str) -> str:
    """1 when the u32 field ``name`` is nonzero (the kernels test ``!= 0u``), else 0."""
    return f"min({name}, 1)"


def equals(name: str, value: int) -> str:
    """1 when ``name == value``, else 0: the grammar has no comparisons."""
    return f"(1 - min(1, max({name} - {value}, {value} - {name})))"
