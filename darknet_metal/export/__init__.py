"""Export of a network to other formats: ONNX (``export_onnx``).

Owns: the ONNX graph vocabulary the ops write their layers in (``graph``, below the ops),
the model around it (``onnx_model``: outputs, box decoding, metadata, checks, the file;
what it reads of a network and a layer as the protocols ``ExportableNetwork`` and
``ExportableLayer``) and the ``export`` command (``cli``, given ``load`` by the command line).

May import: ``graph``: ``errors`` and ``model``; ``onnx_model`` and ``cli``: also ``files``,
``cli_args`` and ``model``. The ``onnx`` package is imported when a model is built (the
``export`` extra).
"""

from __future__ import annotations

from darknet_metal.export.onnx_model import (
    DEFAULT_OPSET,
    ExportableLayer,
    ExportableNetwork,
    build_model,
    export_onnx,
)

__all__ = ["DEFAULT_OPSET", "ExportableLayer", "ExportableNetwork", "build_model", "export_onnx"]
