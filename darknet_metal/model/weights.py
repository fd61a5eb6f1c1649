"""Darknet ``.weights`` files: read and write, checked exactly against the cfg.

Layout: int32 major, minor, revision; ``seen`` (images trained on) as uint64 when
``major*10 + minor >= 2``, else uint32; then, for every layer with parameters, float32 arrays
in the order each layer's op gives (``Op.stored_params``). When major or minor exceeds
1000, arrays the op marks (connected weights) are stored transposed (Darknet's convention).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import numpy as np

from darknet_metal.errors import ArgumentError, WeightsError
from darknet_metal.files import atomic_write

#: A layer's parameter arrays by name, as a ``.weights`` file stores them.
Params = dict[str, np.ndarray]


class StoredLayer(Protocol):
    """What reading and writing ``.weights`` needs of a layer (``ops.Op`` has it)."""

    index: int
    kind: str
    param_shapes: dict[str, tuple[int, ...]]

    @property
    def values(self) -> dict[str, Any]: ...

    def stored_params(self, *, reading: bool = True) -> list[tuple[str, tuple[int, ...]]]: ...

    def stored_transposed(self, name: str) -> bool: ...


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


def stored_params(spec: StoredLayer, *, reading: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the arrays a layer stores in a ``.weights`` file, in file order (the
    layer's op decides; ``reading`` as Darknet reads them, e.g. ``dontloadscales=1``)."""
    return spec.stored_params(reading=reading)


def weights_file_size(specs: list[StoredLayer], header: WeightsHeader | None = None) -> int:
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


@dataclass
class WeightsCoverage:
    """What a ``.weights`` file gave a network: ``loaded``, the indices of the layers whose
    parameters came from ``path``; ``initialised``, those of the layers with parameters that
    were initialised instead (a backbone file covers only the first layers)."""

    path: str
    loaded: list[int]
    initialised: list[int]

    def describe(self) -> str:
        """One line for logs: which layers came from the file and which were initialised."""
        def spans(indices: list[int]) -> str:
            if not indices:
                return "none"
            runs, start, prev = [], indices[0], indices[0]
            for i in [*indices[1:], None]:
                if i is not None and i == prev + 1:
                    prev = i
                    continue
                runs.append(f"{start}" if start == prev else f"{start}-{prev}")
                if i is not None:
                    start = prev = i
            return ", ".join(runs)

        return (f"{self.path}: loaded the parameters of {len(self.loaded)} layers "
                f"({spans(self.loaded)}), initialised {len(self.initialised)} "
                f"({spans(self.initialised)})")


def read_weights(path: str | os.PathLike[str], specs: list[StoredLayer]
                 ) -> tuple[WeightsHeader, dict[int, Params]]:
    """Read a ``.weights`` file that must hold exactly the parameters of ``specs``.

    Returns the header and, per layer index with parameters, float32 arrays by name in the
    shapes of ``Op.param_shapes``. Raises ``WeightsError`` naming the layer when the
    file is short, long, or holds non-finite or impossible values.
    """
    header, params, _ = _read(path, specs, prefix=False, upto=None)
    return header, params


def read_weights_prefix(path: str | os.PathLike[str], specs: list[StoredLayer], *,
                        upto: int | None = None
                        ) -> tuple[WeightsHeader, dict[int, Params], WeightsCoverage]:
    """Read the parameters of the first layers of ``specs`` from ``path``, as Darknet reads a
    backbone (``yolov4-tiny.conv.29``) or ``partial`` reads a cut.

    Without ``upto`` the file must end exactly after some layer's last array (every layer up
    to there is loaded); with ``upto`` (a layer count) the file must hold at least the layers
    before ``upto`` and whatever follows them is not read. Raises ``WeightsError`` naming the
    layer when the file ends inside one, holds more than the network, or holds non-finite or
    impossible values. Returns the header, the arrays read, and which layers they cover.
    """
    if upto is not None and not 1 <= upto <= len(specs):
        raise ArgumentError(f"the layer count must be in [1, {len(specs)}] (the cfg has "
                            f"{len(specs)} layers), not {upto}")
    return _read(path, specs, prefix=True, upto=upto)


def _read(path: str | os.PathLike[str], specs: list[StoredLayer], *, prefix: bool,
          upto: int | None) -> tuple[WeightsHeader, dict[int, Params], WeightsCoverage]:
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise WeightsError(f"cannot read: {e.strerror or e}", path=path) from None
    header = _read_header(data, path)
    wanted = specs if upto is None else specs[:upto]
    needed = weights_file_size(wanted, header)
    hint = (f"({len(data)} bytes; the cfg needs {needed}: is this the cfg these weights were "
            "trained with?)")
    advice: dict[str, Any] = (
        dict(hint="A backbone holding only the first layers loads with partial=True.",
             cli_hint="A backbone holding only the first layers is for training: `darknet-metal "
             "train DATA CFG BACKBONE`.") if not prefix else
        # No one Python call cuts a file: the command is the way out from Python too.
        dict(hint="`darknet-metal partial CFG WEIGHTS OUT N` keeps the first N layers of a "
             "file for the cfg it was trained with.",
             cli_hint="`darknet-metal partial CFG WEIGHTS OUT N` keeps the first N layers of "
             "a file for the cfg it was trained with."))
    layout = [(spec, name, shape) for spec in wanted if not spec.values.get("dontload")
              for name, shape in stored_params(spec)]
    # Sizes first, so a file for another cfg is reported as such rather than by its values.
    offset = header.nbytes
    end = len(data) if upto is None else None
    count = 0  # arrays the file holds whole
    for spec, name, shape in layout:
        offset += 4 * int(np.prod(shape))
        if offset > len(data):
            if prefix and upto is None and offset - 4 * int(np.prod(shape)) == len(data):
                break  # the file ends between arrays: a prefix, if between layers
            raise WeightsError(f"file ends inside {spec.kind} '{name}' {hint}", path=path,
                               layer=spec.index, **advice)
        count += 1
    if end is not None and offset != end and count == len(layout):
        raise WeightsError(f"{len(data) - offset} bytes left after the last layer {hint}",
                           path=path, **advice)
    if count < len(layout) and count and layout[count][0] is layout[count - 1][0]:
        spec, name, _ = layout[count]
        raise WeightsError(f"file ends inside {spec.kind} (before its '{name}') {hint}",
                           path=path, layer=spec.index, **advice)
    if count == 0:
        raise WeightsError(f"holds no layer's parameters {hint}", path=path, **advice)
    offset = header.nbytes
    params: dict[int, Params] = {}
    for spec, name, shape in layout[:count]:
        n = int(np.prod(shape))
        array = np.frombuffer(data, "<f4", n, offset).astype(np.float32)
        offset += 4 * n
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
    with_params = [spec.index for spec in specs if spec.param_shapes]
    coverage = WeightsCoverage(path, [i for i in with_params if i in params],
                               [i for i in with_params if i not in params])
    return header, params, coverage


def write_weights(path: str | os.PathLike[str], specs: list[StoredLayer],
                  params: dict[int, Params], header: WeightsHeader | None = None, *,
                  upto: int | None = None) -> None:
    """Write a Darknet ``.weights`` file atomically (temporary file, then rename), with the
    permissions a new file gets under the umask.

    The header is written as version 0.2.0 with a 64-bit ``seen``, which Darknet and OpenCV
    read. ``params`` maps layer index to arrays named as in ``Op.param_shapes``.
    ``upto``: write only the layers before it (Darknet's ``partial``).
    """
    chunks = weights_bytes(specs, params, header, upto=upto)

    def write(f: BinaryIO) -> None:
        for chunk in chunks:
            f.write(chunk)

    atomic_write(path, write)


def weights_bytes(specs: list[StoredLayer], params: dict[int, Params],
                  header: WeightsHeader | None = None, *,
                  upto: int | None = None) -> Iterator[bytes]:
    """The contents of the ``.weights`` file ``write_weights`` writes, in pieces: every
    shape is checked first (ArgumentError), then each piece is made as it is taken, so a
    writer holds one array's bytes at a time."""
    if upto is not None and not 1 <= upto <= len(specs):
        raise ArgumentError(f"the layer count must be in [1, {len(specs)}] (the cfg has "
                            f"{len(specs)} layers), not {upto}")
    header = WeightsHeader(0, 2, 0, header.seen if header else 0)
    arrays = []
    for spec in specs[:upto]:
        for name, shape in stored_params(spec, reading=False):
            array = np.asarray(params[spec.index][name])
            if array.shape != shape:
                raise ArgumentError(f"layer {spec.index} '{name}' has shape {array.shape}, "
                                    f"the cfg needs {shape}")
            arrays.append(array)
    return _weights_pieces(header, arrays)


def _weights_pieces(header: WeightsHeader, arrays: list[np.ndarray]) -> Iterator[bytes]:
    yield np.array([header.major, header.minor, header.revision], "<i4").tobytes()
    yield np.array([header.seen], "<u8").tobytes()
    for array in arrays:
        yield np.ascontiguousarray(array, dtype="<f4").tobytes()
