"""Inference requests and responses of the KServe v2 / Triton HTTP protocol: tensors as JSON
``data`` or, with Triton's binary tensor data extension, as raw little-endian bytes after
the JSON header (``Inference-Header-Content-Length`` giving the header's length).

Every fault is a ``RequestError`` (status 400) naming the field, such as
``inputs[0].shape``. A body that is not what the route reads is described by its length and
first bytes (``describe_body``), never by a Python object's repr.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from darknet_metal.errors import RequestError
from darknet_metal.serving.repository import INPUT_NAME

__all__ = ["InferRequest", "RequestedOutput", "describe_body", "image_format",
           "infer_response", "read_infer_request"]

_FP32 = np.dtype("<f4")
#: Bytes of a body shown in error messages: enough to recognise a format or a typo.
PREVIEW_BYTES = 16
#: The leading bytes of the image formats a client is likely to send, for hints in errors
#: (Pillow reads more; these are the ones worth naming).
_IMAGE_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"), (b"\x89PNG\r\n\x1a\n", "PNG"), (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
)


def describe_body(data: bytes, what: str = "the request body") -> str:
    """``what`` with its length and first bytes, for an error message: ``the request body
    (19 bytes, starting b'hello, not an im'...)``. The bytes are shown as a bytes literal
    (printable ASCII as is, the rest escaped), so the message stays one safe line whatever
    the client sent."""
    if not data:
        return f"{what} (0 bytes)"
    head = data[:PREVIEW_BYTES]
    if len(data) <= PREVIEW_BYTES:
        return f"{what} ({_bytes(len(data))}: {head!r})"
    return f"{what} ({_bytes(len(data))}, starting {head!r}...)"


def image_format(data: bytes) -> str | None:
    """The image format ``data`` starts as (``"JPEG"``, ``"PNG"``, ...), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return next((name for magic, name in _IMAGE_MAGIC if data.startswith(magic)), None)


def _bytes(count: int) -> str:
    return "1 byte" if count == 1 else f"{count} bytes"


@dataclass(frozen=True)
class RequestedOutput:
    """An output to answer with: its tensor ``name`` and whether as binary data."""

    name: str
    binary: bool


@dataclass(frozen=True)
class InferRequest:
    """A checked request: ``x`` (n, C, H, W) float32 finite, the ``outputs`` to answer
    with, and the client's ``id`` (echoed back) if it gave one."""

    x: np.ndarray
    outputs: tuple[RequestedOutput, ...]
    id: str | None


def read_infer_request(body: bytes, header_length: str | None, *,
                       input_shape: Sequence[int], max_batch_size: int,
                       output_names: Sequence[str], max_rows: int) -> InferRequest:
    """Check and decode an ``infer`` request ``body`` for a model taking (n, *input_shape)
    with n up to ``max_batch_size`` (0: up to ``max_rows``) and answering ``output_names``.
    ``header_length``: the ``Inference-Header-Content-Length`` header, or None when the
    body is all JSON."""
    size = len(body)
    if header_length is None:
        split = size
    else:
        try:
            split = int(header_length)
        except ValueError:
            split = -1
        if not 0 < split <= size:
            raise RequestError(f"header Inference-Header-Content-Length: '{header_length}' "
                               f"is not a length within the body's {size} bytes")
    try:
        header = json.loads(body[:split])
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RequestError(_not_json(body, split, exc)) from None
    if not isinstance(header, dict):
        raise RequestError(f"the request is a JSON {type(header).__name__}; expected an "
                           "object with 'inputs'")
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError(f"id: expected a string, not {_json_type(request_id)}")
    parameters = _object(header.get("parameters", {}), "parameters")
    for key in ("sequence_id", "shared_memory_region"):
        if parameters.get(key):
            raise RequestError(f"parameters.{key}: not supported by this server")
    binary_output = _boolean(parameters.get("binary_data_output", False),
                             "parameters.binary_data_output")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError(f"inputs: expected a list holding the '{INPUT_NAME}' tensor")
    if len(inputs) != 1:
        raise RequestError(f"inputs: {len(inputs)} tensors; this model takes one, "
                           f"'{INPUT_NAME}'")
    x = _read_input(_object(inputs[0], "inputs[0]"), body, split, input_shape,
                    max_batch_size or max_rows, max_batch_size == 0)
    return InferRequest(x=x, outputs=_read_outputs(header.get("outputs"), output_names,
                                                   binary_output), id=request_id)


def _not_json(body: bytes, split: int, exc: Exception) -> str:
    """The message for a request whose JSON (all of ``body``, or its first ``split`` bytes
    with the binary extension) does not parse: what was received, why it does not parse,
    and where an image file should have gone."""
    what = describe_body(body[:split], "the request body" if split == len(body)
                         else "the request's JSON header")
    reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
    found = image_format(body)
    hint = (f"; a {found} image goes to the model's /detect route, not /infer"
            if found else "")
    return f"{what} is not JSON ({reason}){hint}"


def _read_input(tensor: Mapping[str, Any], body: bytes, split: int,
                input_shape: Sequence[int], max_rows: int, unbatched: bool) -> np.ndarray:
    where = "inputs[0]"
    name = tensor.get("name")
    if name != INPUT_NAME:
        raise RequestError(f"{where}.name: {json.dumps(name)}; this model's input is "
                           f"'{INPUT_NAME}'")
    if tensor.get("datatype") != "FP32":
        raise RequestError(f"{where}.datatype: {json.dumps(tensor.get('datatype'))}; "
                           "expected \"FP32\"")
    shape = tensor.get("shape")
    want = [-1, *input_shape]
    if (not isinstance(shape, list) or len(shape) != 4
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
        raise RequestError(f"{where}.shape: {json.dumps(shape)}; expected {want} "
                           "(batch, channels, height, width)")
    if list(shape[1:]) != list(input_shape) or not 1 <= shape[0] <= max_rows:
        batch = "any batch from 1" if unbatched else f"a batch of 1 to {max_rows}"
        raise RequestError(f"{where}.shape: {shape}; this model takes {want} with {batch}")
    count = math.prod(shape)
    parameters = _object(tensor.get("parameters", {}), f"{where}.parameters")
    if parameters.get("shared_memory_region") is not None:
        raise RequestError(f"{where}.parameters.shared_memory_region: shared memory is not "
                           "supported by this server")
    binary_size = parameters.get("binary_data_size")
    if binary_size is not None:
        if (not isinstance(binary_size, int) or isinstance(binary_size, bool)
                or binary_size != count * 4):
            raise RequestError(f"{where}.parameters.binary_data_size: {json.dumps(binary_size)};"
                               f" shape {shape} of FP32 is {count * 4} bytes")
        if "data" in tensor:
            raise RequestError(f"{where}: both 'data' and binary_data_size given")
        if len(body) - split != binary_size:
            raise RequestError(f"{where}.parameters.binary_data_size: {binary_size} bytes, "
                               f"but {len(body) - split} follow the JSON header")
        x = np.frombuffer(body, dtype=_FP32, count=count, offset=split).astype(np.float32)
    else:
        if split != len(body):
            raise RequestError(f"{len(body) - split} bytes follow the JSON header, but no "
                               "input gives a binary_data_size")
        x = _json_data(tensor.get("data"), f"{where}.data", count, shape)
    x = x.reshape(shape)
    if not np.isfinite(x).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(x))[0])
        raise RequestError(f"{where}.data: a NaN or infinite value at index {list(bad)}")
    return x


def _json_data(data: Any, where: str, count: int, shape: list[int]) -> np.ndarray:
    if not isinstance(data, list):
        raise RequestError(f"{where}: expected a list of {count} numbers (or binary data), "
                           f"not {_json_type(data)}")
    try:
        values = np.array(data)
    except (ValueError, TypeError):
        raise RequestError(f"{where}: not a flat or regularly nested list of numbers") from None
    numeric = (np.issubdtype(values.dtype, np.integer)
               or np.issubdtype(values.dtype, np.floating))
    if not numeric or values.size != count:
        what = f"{values.size} values" if numeric else "values that are not all numbers"
        raise RequestError(f"{where}: holds {what}; shape {shape} needs {count} numbers")
    with np.errstate(over="ignore"):
        return values.astype(np.float32).ravel()


def _read_outputs(outputs: Any, names: Sequence[str],
                  binary_default: bool) -> tuple[RequestedOutput, ...]:
    if outputs is None:
        return tuple(RequestedOutput(name, binary_default) for name in names)
    if not isinstance(outputs, list):
        raise RequestError(f"outputs: expected a list, not {_json_type(outputs)}")
    chosen: list[RequestedOutput] = []
    for i, item in enumerate(outputs):
        output = _object(item, f"outputs[{i}]")
        name = output.get("name")
        if name not in names:
            raise RequestError(f"outputs[{i}].name: {json.dumps(name)} is not an output of "
                               f"this model ({', '.join(names)})")
        if any(o.name == name for o in chosen):
            raise RequestError(f"outputs[{i}].name: '{name}' is requested twice")
        parameters = _object(output.get("parameters", {}), f"outputs[{i}].parameters")
        for key in ("classification", "shared_memory_region"):
            if parameters.get(key):
                raise RequestError(f"outputs[{i}].parameters.{key}: not supported by this "
                                   "server")
        binary = _boolean(parameters.get("binary_data", binary_default),
                          f"outputs[{i}].parameters.binary_data")
        chosen.append(RequestedOutput(name, binary))
    return tuple(chosen)


def infer_response(request: InferRequest, model: str, version: int,
                   arrays: Mapping[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers for ``request``: ``arrays`` maps each requested
    output to its (n, C, H, W) float32 rows. Binary outputs follow the JSON header, in the
    order of ``outputs``."""
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for wanted in request.outputs:
        array = np.ascontiguousarray(arrays[wanted.name], dtype=_FP32)
        entry: dict[str, Any] = {"name": wanted.name, "datatype": "FP32",
                                 "shape": list(array.shape)}
        if wanted.binary:
            blob = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            # float32 -> Python float (a double) -> shortest repr: read back as float32,
            # every value is the same bits.
            entry["data"] = array.ravel().tolist()
        outputs.append(entry)
    header: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if request.id is not None:
        header["id"] = request.id
    header["outputs"] = outputs
    text = json.dumps(header, separators=(",", ":")).encode()
    if not blobs:
        return text, {"content-type": "application/json"}
    return b"".join([text, *blobs]), {"content-type": "application/octet-stream",
                                      "inference-header-content-length": str(len(text))}


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise RequestError(f"{where}: expected a JSON object, not {_json_type(value)}")
    return value


def _boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{where}: expected true or false, not {json.dumps(value)}")
    return value


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
