"""OpenCV DNN as an independent reference for Darknet layers.

OpenCV's Darknet importer (``cv2.dnn.readNetFromDarknet``, present in opencv-python < 5)
reads the same ``.cfg`` + ``.weights`` files as Darknet and runs them with its own code, so
it is a peer implementation to compare against. This module only uses NumPy and OpenCV: it
must stay independent of the package under test.

How OpenCV names the layers it creates: each cfg section ``i`` (0-based, ``[net]`` not
counted) becomes one or more OpenCV layers named ``<kind>_<i>``, in this order:

- ``[convolutional]`` -> ``conv_i``, then ``bn_i`` if ``batch_normalize=1``;
- ``[connected]`` -> ``fullyConnected_i`` (+ ``bn_i``);
- ``[maxpool]`` -> ``pool_i``; ``[avgpool]`` -> ``avgpool_i``; ``[softmax]`` -> ``softmax_i``;
- ``[route]`` -> ``concat_i`` (or ``identity_i`` for one input); ``[shortcut]`` ->
  ``shortcut_i``; ``[upsample]`` -> ``upsample_i``; ``[reorg]`` -> ``reorg_i``;
  ``[scale_channels]`` -> ``scale_channels_i``; ``[sam]`` -> ``sam_i``;
- ``[yolo]`` -> ``permute_i`` (the input in NHWC order) then ``yolo_i``;
- a non-linear ``activation=`` of any section adds one more layer named after the Darknet
  activation, e.g. ``leaky_<i+1>``, ``mish_<i+1>``, ``logistic_<i+1>``: OpenCV 4.14 numbers
  it with the *next* section's index, so names alone are ambiguous.

Darknet's output of section ``i`` (after batch norm and activation) is the output of the
last layer created for it: the activation layer that directly follows the layers named
``<kind>_i`` if there is one, else the last ``<kind>_i``. ``opencv_layer_names`` rebuilds
that mapping by walking the layers in creation order. Limits of the mapping:

- ``[yolo]``: OpenCV's ``yolo_i`` emits decoded detections (one row per cell and anchor:
  box centre/size relative to the image, objectness, class scores), not Darknet's
  ``layer.output``. It is refused here; compare the preceding convolution instead.
- Darknet layer kinds or options OpenCV does not implement (``[reorg3d]``, reverse
  upsample, weighted shortcuts, ``maxpool_depth``, ``stride_x != stride_y``, most
  activations) make ``readNetFromDarknet`` raise ``cv2.error``.
- OpenCV runs in float32 and may fuse layers (conv + activation); values agree with Darknet
  to about 1e-5 relative, not bit for bit.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["opencv_layer_outputs", "opencv_layer_names", "write_darknet_weights"]

_NAME_RE = re.compile(r"^(?P<kind>.+)_(?P<index>\d+)$")

#: Darknet activation names; OpenCV names its activation layers after them.
_ACTIVATION_KINDS = frozenset(
    "leaky relu relu6 logistic loggy tanh elu selu gelu mish swish hard_mish hardtan lhtan "
    "plse stair ramp relie revleaky normalize_channels normalize_channels_softmax "
    "normalize_channels_softmax_maxval".split()
)


def write_darknet_weights(
    path: str | os.PathLike[str],
    arrays: Sequence[np.ndarray],
    major: int = 0,
    minor: int = 2,
) -> None:
    """Write a Darknet ``.weights`` file holding ``arrays`` one after the other.

    The header is int32 ``major``, ``minor``, ``revision=0`` and then ``seen=0`` as uint64
    when ``major*10 + minor >= 2`` (as uint32 otherwise), all little-endian. Each array is
    flattened in C order and written as float32. For a ``[convolutional]`` layer Darknet
    expects, in this order: biases[n], then (only with ``batch_normalize=1``) scales[n],
    rolling_mean[n], rolling_variance[n], then weights[n, c/groups, size, size].

    The file is written to a temporary file in the same directory and renamed into place.
    """
    path = Path(path)
    seen_dtype = "<u8" if major * 10 + minor >= 2 else "<u4"
    header = np.array([major, minor, 0], dtype="<i4").tobytes() + np.zeros(1, seen_dtype).tobytes()
    body = b"".join(np.ascontiguousarray(a, dtype="<f4").tobytes() for a in arrays)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header + body)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def opencv_layer_names(net: object) -> dict[int, str]:
    """Map each 0-based cfg section index to the OpenCV layer holding its Darknet output.

    ``net`` is a ``cv2.dnn.Net`` from ``readNetFromDarknet``. Layers are visited in creation
    order; an activation layer is attributed to the section of the layer before it (see the
    module docstring), any other ``<kind>_<i>`` to section ``i``, the last one winning.
    """
    mapping: dict[int, str] = {}
    current: int | None = None
    for name in net.getLayerNames():  # type: ignore[attr-defined]
        m = _NAME_RE.match(name)
        if not m:
            continue
        if m.group("kind") in _ACTIVATION_KINDS and current is not None:
            mapping[current] = name
        else:
            current = int(m.group("index"))
            mapping[current] = name
    return mapping


def opencv_layer_outputs(
    cfg_path: str | os.PathLike[str],
    weights_path: str | os.PathLike[str],
    x: np.ndarray,
    layer_indices: Sequence[int],
) -> list[np.ndarray]:
    """Run OpenCV DNN on ``x`` and return the outputs of the given cfg layers.

    x: float32 array of shape (N, C, H, W), the network input (no scaling is applied).
    layer_indices: 0-based cfg section indices (``[net]`` not counted).
    Returns one float32 array per index, in Darknet's layout: (N, C, H, W) for image layers,
    (N, F) as OpenCV gives it for ``[connected]``/``[softmax]`` on flat inputs.

    Raises ValueError for an index OpenCV has no layer for, or for a ``[yolo]`` layer,
    whose OpenCV output is a detection list rather than Darknet's ``layer.output``.
    """
    import cv2

    net = cv2.dnn.readNetFromDarknet(os.fspath(cfg_path), os.fspath(weights_path))
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
    names = opencv_layer_names(net)
    wanted = []
    for i in layer_indices:
        if i not in names:
            raise ValueError(f"OpenCV has no layer for cfg section {i}; it has {sorted(names)}")
        if names[i].startswith("yolo_"):
            raise ValueError(
                f"cfg section {i} is a [yolo] layer: OpenCV's output there is a detection "
                "list, not Darknet's layer.output"
            )
        wanted.append(names[i])
    net.setInput(np.ascontiguousarray(x, dtype=np.float32))
    outs = net.forward(wanted)
    return [np.array(o, dtype=np.float32) for o in outs]
