"""Export of a network to other formats: ONNX (``export_onnx``).

Owns: the ONNX graph vocabulary the ops write their layers in (``graph``, below the ops) and
the model around it (``onnx_model``: outputs, box decoding, metadata, checks, the file).

May import: ``graph``: ``errors`` and ``model``; ``onnx_model``: also ``files`` and, for
type names only, the network and ops. The ``onnx`` package is imported when a model is
built (the ``export`` extra).
"""

from __future__ import annotations

from darknet_metal.export.onnx_model import DEFAULT_OPSET, build_model, export_onnx

__all__ = ["DEFAULT_OPSET", "build_model", "export_onnx"]
