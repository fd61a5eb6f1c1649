"""Darknet ``.weights`` files: read and write, checked exactly against the cfg.

Layout: int32 major, minor, revision; ``seen`` (images trained on) as uint64 when
``major*10 + minor >= 2``, else uint32; then, for every layer with parameters, float32 arrays
in the order each layer's op gives (``LayerSpec.stored_params``). When major or minor exceeds
1000, arrays the op marks (connected weights) are stored transposed (Darknet's convention).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from darknet_metal.errors import ArgumentError, WeightsError
from darknet_metal.files import atomic_write
from darknet_metal.layers import LayerSpec
from darknet_metal.params import Params


@dataclass
class WeightsHeader:
    """The header of a ``.weights`` file."""

    major: int = 0
    minor: int = 2
    revision: int = 0
    seen: int = 0

    @property
    def seen_is_64bit(self) -> bool:
        return self.major * 10 + self.minor >= 2

    @property
    def transposed(self) -> bool:
        return self.major > 1000 or self.minor > 1000

    @property
    def nbytes(self) -> int:
        return 12 + (8 if self.seen_is_64bit else 4)


def stored_params(spec: LayerSpec, *, reading: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the arrays a layer stores in a ``.weights`` file, in file order (the
    layer's op decides; ``reading`` as Darknet reads them, e.g. ``dontloadscales=1``)."""
    return spec.stored_params(reading=reading)


def weights_file_size(specs: list[LayerSpec], header: WeightsHeader | None = None) -> int:
    """Exact size in bytes of the ``.weights`` file for these layers."""
    header = header or WeightsHeader()
    count = sum(int(np.prod(shape)) for spec in specs if not spec.values.get("dontload")
                for _, shape in stored_params(spec))
    return header.nbytes + 4 * count


def _read_header(data: bytes, path: str) -> WeightsHeader:
    if len(data) < 16:
        raise WeightsError(f"file has {len(data)} bytes, too short for a Darknet header", path=path)
    major, minor, revision = np.frombuffer(data, "<i4", 3).tolist()
    header = WeightsHeader(major, minor, revision)
    # Real files have major 0 or 1 and small minors (or the +1000 transposed marker);
    # anything else means this is not a weights file.
    plausible = (0 <= major <= 1001 and 0 <= minor <= 1010 and 0 <= revision < 1 << 24
                 and (major <= 1 or major == 1001))
    if not plausible:
        raise WeightsError(f"header version {major}.{minor}.{revision} is not a Darknet weights "
                           "header (is this a .weights file?)", path=path)
    if len(data) < header.nbytes:
        raise WeightsError(f"file has {len(data)} bytes, too short for a Darknet header",
                           path=path)
    dtype = "<u8" if header.seen_is_64bit else "<u4"
    header.seen = int(np.frombuffer(data, dtype, 1, 12)[0])
    return header


def read_weights(path: str | os.PathLike[str], specs: list[LayerSpec]
                 ) -> tuple[WeightsHeader, dict[int, Params]]:
    """Read a ``.weights`` file that must hold exactly the parameters of ``specs``.

    Returns the header and, per layer index with parameters, float32 arrays by name in the
    shapes of ``LayerSpec.param_shapes``. Raises ``WeightsError`` naming the layer when the
    file is short, long, or holds non-finite or impossible values.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise WeightsError(f"cannot read: {e.strerror or e}", path=path) from None
    header = _read_header(data, path)
    needed = weights_file_size(specs, header)
    hint = (f"({len(data)} bytes; the cfg needs {needed}: is this the cfg these weights were "
            "trained with?)")
    layout = [(spec, name, shape) for spec in specs if not spec.values.get("dontload")
              for name, shape in stored_params(spec)]
    # Sizes first, so a file for another cfg is reported as such rather than by its values.
    offset = header.nbytes
    for spec, name, shape in layout:
        offset += 4 * int(np.prod(shape))
        if offset > len(data):
            raise WeightsError(f"file ends inside {spec.kind} '{name}' {hint}", path=path,
                               layer=spec.index)
    if offset != len(data):
        raise WeightsError(f"{len(data) - offset} bytes left after the last layer {hint}",
                           path=path)
    offset = header.nbytes
    params: dict[int, Params] = {}
    for spec, name, shape in layout:
        count = int(np.prod(shape))
        array = np.frombuffer(data, "<f4", count, offset).astype(np.float32)
        offset += 4 * count
        if header.transposed and spec.stored_transposed(name):
            array = array.reshape(shape[1], shape[0]).T
        array = np.ascontiguousarray(array.reshape(shape))
        if not np.isfinite(array).all():
            raise WeightsError(f"{spec.kind} '{name}' holds NaN or infinite values", path=path,
                               layer=spec.index)
        if name == "rolling_variance" and (array < 0).any():
            raise WeightsError(f"{spec.kind} 'rolling_variance' has negative values", path=path,
                               layer=spec.index)
        params.setdefault(spec.index, {})[name] = array
    return header, params


def write_weights(path: str | os.PathLike[str], specs: list[LayerSpec],
                  params: dict[int, Params], header: WeightsHeader | None = None) -> None:
    """Write a Darknet ``.weights`` file atomically (temporary file, then rename), with the
    permissions a new file gets under the umask.

    The header is written as version 0.2.0 with a 64-bit ``seen``, which Darknet and OpenCV
    read. ``params`` maps layer index to arrays named as in ``LayerSpec.param_shapes``.
    """
    path = os.fspath(path)
    header = WeightsHeader(0, 2, 0, header.seen if header else 0)
    chunks = [np.array([header.major, header.minor, header.revision], "<i4").tobytes(),
              np.array([header.seen], "<u8").tobytes()]
    for spec in specs:
        for name, shape in stored_params(spec, reading=False):
            array = np.asarray(params[spec.index][name], dtype="<f4")
            if array.shape != shape:
                raise ArgumentError(f"layer {spec.index} '{name}' has shape {array.shape}, "
                                    f"the cfg needs {shape}")
            chunks.append(np.ascontiguousarray(array).tobytes())

    def write(f: BinaryIO) -> None:
        for chunk in chunks:
            f.write(chunk)

    atomic_write(path, write)
