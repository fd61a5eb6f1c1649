"""``Network``: a Darknet network loaded from a cfg (and weights) on a device."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from darknet_metal.backend import Backend
from darknet_metal.boxes import Detection, YoloHead, detect_boxes
from darknet_metal.cfg import NetConfig, parse_cfg
from darknet_metal.errors import CfgError
from darknet_metal.image import load_image, prepare_input
from darknet_metal.layers import LayerSpec, Shape, build_layers, input_shape
from darknet_metal.params import Params, init_params
from darknet_metal.summary import summary_table
from darknet_metal.weights import WeightsHeader, read_weights, write_weights

#: Devices ``load`` accepts: the CPU reference, the Apple GPU, and the CPU emulator of the
#: Metal compute model (the same kernels as "metal").
DEVICES = ("cpu", "metal", "emu")


def _read_names(names: str | os.PathLike[str] | Sequence[str] | None) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, (str, os.PathLike)):
        path = os.fspath(names)
        try:
            with open(path, encoding="utf-8") as f:
                return [line.strip() for line in f.read().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise CfgError(f"cannot read class names: {e}", path=path) from None
    return [str(n) for n in names]


class Network:
    """A Darknet network: layers from a cfg, parameters, and a compute backend.

    Build one with ``darknet_metal.load``. ``layers`` lists the ``LayerSpec`` of each cfg
    layer (``type``, ``in_shape``, ``out_shape`` as (C, H, W), ``bflops``).
    """

    def __init__(self, config: NetConfig, layers: list[LayerSpec], params: dict[int, Params], *,
                 header: WeightsHeader, names: list[str] | None, device: str, batch: int,
                 dtype: np.dtype | type = np.float32) -> None:
        self.config = config
        self.layers = layers
        self.params = params
        self.header = header
        self.names = names
        self.device = device
        #: The batch size the caller prepared the network for (any batch works in forward).
        self.batch = batch
        self.dtype = np.dtype(dtype)
        _check_device(device)
        self._backend_instance: Backend | None = None

    @property
    def _backend(self) -> Backend:
        # Built on first use, so a cfg can be inspected (summary, layers) without running it.
        if self._backend_instance is None:
            self._backend_instance = _make_backend(self.device, self.layers, self.params,
                                                   self.dtype)
        return self._backend_instance

    def to(self, device: str) -> Network:
        """Moves the network to ``device`` ("cpu", "metal", "emu") and returns it.

        The parameters are the same arrays; the old device's buffers are released, so
        outputs of earlier passes still on that device can no longer be read. Raises
        ValueError for an unknown device, DeviceError for one this machine lacks (the
        network then stays where it was)."""
        _check_device(device)
        if device != self.device:
            if self._backend_instance is not None:
                self._backend_instance.close()
                self._backend_instance = None
            self.device = device
        return self

    @property
    def input_shape(self) -> Shape:
        """(C, H, W) the network takes, from ``[net]``."""
        return input_shape(self.config)

    @property
    def yolo_layers(self) -> list[int]:
        """Indices of the ``[yolo]`` layers (the detection heads), in cfg order."""
        return [spec.index for spec in self.layers if spec.detection_head is not None]

    def forward(self, x: np.ndarray, outputs: Sequence[int] | None = None) -> list[np.ndarray]:
        """Run the network on ``x`` (N, C, H, W) float32 and return layer outputs (copies).

        With ``outputs=None``: one (N, C, H, W) array per ``[yolo]`` layer, holding Darknet's
        ``layer.output`` (logistic applied to x, y, objectness and classes). With
        ``outputs=[i, ...]``: the outputs of those 0-based cfg layers (``[net]`` not counted);
        negative indices count from the end.
        """
        x = np.asarray(x)
        if x.ndim == 3:
            raise ValueError(f"input has shape {x.shape}; expected (N, C, H, W): add a batch "
                             "axis with x[None]")
        if x.ndim != 4 or tuple(x.shape[1:]) != self.input_shape or x.shape[0] < 1:
            raise ValueError(f"input has shape {x.shape}; this network takes (N, "
                             f"{', '.join(map(str, self.input_shape))})")
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"input dtype is {x.dtype}; expected float32")
        wanted = self.yolo_layers if outputs is None else self._check_indices(outputs)
        # Device backends keep outputs on the device and download only the wanted ones.
        outs = self._backend.forward(x, outputs=wanted)
        return [np.array(outs[i]) for i in wanted]

    def profile(self, x: np.ndarray, repeats: int = 5) -> list[float]:
        """Median wall time in milliseconds of each layer over ``repeats`` forward passes."""
        self.forward(x)  # warm up buffers and caches
        runs: list[list[float]] = []
        for _ in range(max(1, repeats)):
            times: list[float] = []
            self._backend.forward(np.asarray(x), timings=times)
            runs.append(times)
        return [1e3 * float(t) for t in np.median(np.array(runs), axis=0)]

    def _check_indices(self, outputs: Sequence[int]) -> list[int]:
        n = len(self.layers)
        result = []
        for i in outputs:
            if not isinstance(i, (int, np.integer)) or not -n <= i < n:
                raise IndexError(f"layer index {i!r} out of range: the network has {n} layers")
            result.append(int(i) % n)
        return result

    def yolo_heads(self) -> list[YoloHead]:
        """What the box decoder needs of each ``[yolo]`` layer."""
        return [self.layers[index].detection_head for index in self.yolo_layers]

    def detect(self, image: str | os.PathLike[str] | np.ndarray, thresh: float = 0.25,
               nms: float = 0.45) -> list[Detection]:
        """Detect objects in one image as ``darknet detector test`` does.

        ``image`` is a path or an HxWx3 uint8 RGB array. Returns one ``Detection`` per (box,
        class) with objectness x class probability above ``thresh`` after NMS with IoU
        threshold ``nms``; boxes in pixels of the original image.
        """
        if not self.yolo_layers:
            raise CfgError("the network has no [yolo] layer to detect with",
                           path=self.config.path)
        if not 0.0 <= thresh <= 1.0 or not 0.0 <= nms <= 1.0:
            raise ValueError(f"thresh={thresh} and nms={nms} must be in [0, 1]")
        img = load_image(image)
        c, h, w = self.input_shape
        if c != 3:
            raise CfgError(f"detect needs a network with channels=3 in [net]; this one takes {c}",
                           path=self.config.path, line=self.config.net.line)
        letterbox = bool(self.config.net.values.get("letter_box"))
        x = prepare_input(img, w, h, letterbox)[None]
        outputs = [out[0] for out in self.forward(x)]
        last_yolo = self.layers[self.yolo_layers[-1]].values
        return detect_boxes(outputs, self.yolo_heads(), w, h, img.shape[2], img.shape[1],
                            thresh=thresh, nms=nms, nms_kind=last_yolo["nms_kind"],
                            beta_nms=last_yolo["beta_nms"], letterbox=letterbox,
                            names=self.names)

    def save_weights(self, path: str | os.PathLike[str]) -> None:
        """Write the parameters as a Darknet ``.weights`` file (version 0.2.0), atomically."""
        write_weights(path, self.layers, self.params, self.header)

    def summary(self) -> str:
        """A Darknet-style table of the layers with their shapes and BFLOPs."""
        return summary_table(self.layers, self.input_shape)

    def __repr__(self) -> str:
        return (f"Network({os.path.basename(self.config.path)!r}, layers={len(self.layers)}, "
                f"input={self.input_shape}, device={self.device!r})")


def _check_device(device: str) -> None:
    """Raise ValueError for an unknown device, DeviceError for one this machine lacks."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
    if device != "cpu":
        from darknet_metal.metal import get_device

        get_device(device)


def _make_backend(device: str, specs: list[LayerSpec], params: dict[int, Params],
                  dtype: np.dtype) -> Backend:
    if device == "cpu":
        from darknet_metal.cpu_backend import CpuBackend

        return CpuBackend(specs, params, dtype)
    from darknet_metal.gpu_backend import GpuBackend

    return GpuBackend(specs, params, dtype, device=device)


def load(cfg: str | os.PathLike[str], weights: str | os.PathLike[str] | None = None, *,
         names: str | os.PathLike[str] | Sequence[str] | None = None, device: str = "cpu",
         batch: int = 1, seed: int | None = None, dtype: np.dtype | type = np.float32,
         input_size: tuple[int, int] | None = None) -> Network:
    """Load a Darknet network.

    ``cfg``: the ``.cfg`` path. ``weights``: a ``.weights`` path, or None to initialise the
    parameters as Darknet does (reproducibly with ``seed``). ``names``: a ``.names`` path or a
    list of class names. ``device``: ``"cpu"``, ``"metal"`` (Apple GPU) or ``"emu"`` (the Metal
    kernels in the CPU emulator; DeviceError when unavailable). ``batch``: the batch size to
    prepare for (any batch size works in ``forward``). ``dtype``: float32, or float64 for
    gradient checks (CPU only).
    ``input_size``: (width, height) in pixels replacing ``[net]``'s, as editing the cfg would
    (convolutional weights do not depend on it).
    Raises ``CfgError`` / ``WeightsError`` naming the file and line or layer at fault.
    """
    if not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be a positive integer, not {batch!r}")
    config = parse_cfg(cfg)
    if input_size is not None:
        width, height = (int(v) for v in input_size)
        if width < 1 or height < 1:
            raise ValueError(f"input_size must be positive (width, height), not {input_size!r}")
        config.net.values["width"], config.net.values["height"] = width, height
    layers = build_layers(config)
    params = init_params(layers, seed)
    header = WeightsHeader()
    if weights is not None:
        header, loaded = read_weights(weights, layers)
        for index, layer in loaded.items():
            params[index].update(layer)
    return Network(config, layers, params, header=header, names=_read_names(names), device=device,
                   batch=int(batch), dtype=dtype)
