"""Triton's ``ModelConfig`` message: ``config.pbtxt`` parsed with protobuf's text-format
parser into the message class generated from Triton's own ``model_config.proto`` (shipped in
the ``tritonclient`` wheel), and the message as the JSON the ``/config`` route answers."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from darknet_metal.errors import DependencyError, RepositoryError

__all__ = ["config_json", "enum_value", "new_config", "parse_config"]

_MODULE = "tritonclient.grpc.model_config_pb2"
_INSTALL = 'pip install "darknet-metal[serve]"'


def _load_module() -> Any:
    """The generated module, loaded from its file: importing it as a submodule would run
    ``tritonclient.grpc``'s ``__init__``, which needs gRPC, and the message needs only
    protobuf. Registered under its own name so that a later ``tritonclient.grpc`` import
    finds it instead of registering the same proto file twice."""
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    try:
        import google.protobuf  # noqa: F401
        spec = importlib.util.find_spec("tritonclient")
    except ImportError as exc:
        raise DependencyError(f"serving needs protobuf and tritonclient: {_INSTALL}") from exc
    if spec is None or not spec.submodule_search_locations:
        raise DependencyError(f"serving needs tritonclient (Triton's model config): {_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / "grpc" / "model_config_pb2.py"
    if not path.is_file():
        raise DependencyError(f"{path}: tritonclient without Triton's model config; {_INSTALL}")
    module_spec = importlib.util.spec_from_file_location(_MODULE, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # a protobuf runtime older than the generated code
        raise DependencyError(f"{path} does not load with this protobuf ({exc}); "
                              f"{_INSTALL}") from exc
    sys.modules[_MODULE] = module
    return module



def new_config() -> Any:
    """An empty ``ModelConfig`` message."""
    return _load_module().ModelConfig()


def enum_value(enum: str, name: str) -> int:
    """The number of value ``name`` of Triton's enum ``enum`` ("DataType",
    "ModelInput.Format", ...)."""
    owner = _load_module()
    for part in enum.split("."):
        owner = getattr(owner, part)
    return int(owner.Value(name))


def parse_config(path: str | os.PathLike[str]) -> Any:
    """``config.pbtxt`` at ``path`` as a ``ModelConfig`` message. Raises ``RepositoryError``
    naming the file and line for unreadable text, unknown fields or wrong value types."""
    from google.protobuf import text_format

    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RepositoryError(f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                              path=path) from exc
    except OSError as exc:
        raise RepositoryError(f"cannot read the model config ({exc.strerror})",
                              path=path) from exc
    config = new_config()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        line = exc.GetLine() if exc.GetLine() and exc.GetLine() > 0 else None
        message = str(exc)
        # The parser prefixes "line:column : "; the error names the line itself.
        head, sep, rest = message.partition(" : ")
        if sep and head.replace(":", "").isdigit():
            message = rest
        raise RepositoryError(f"not a Triton model config: {message}", path=path,
                              line=line) from exc
    return config


def config_json(config: Any) -> dict[str, Any]:
    """``config`` as Triton's ``/config`` route answers it: proto field names, every
    field, enums by name, 64-bit integers as JSON numbers (protobuf's JSON mapping would
    quote them)."""
    from google.protobuf import json_format

    data = json_format.MessageToDict(config, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    return _unquote_int64(config.DESCRIPTOR, data)


_INT64_TYPES = frozenset({3, 4, 6, 16, 18})  # INT64, UINT64, FIXED64, SFIXED64, SINT64


def _unquote_int64(descriptor: Any, data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                value_field = field.message_type.fields_by_name["value"]
                if value_field.message_type is not None:
                    data[field.name] = {k: _unquote_int64(value_field.message_type, v)
                                        for k, v in value.items()}
            elif isinstance(value, list):
                data[field.name] = [_unquote_int64(field.message_type, v) for v in value]
            else:
                data[field.name] = _unquote_int64(field.message_type, value)
        elif field.type in _INT64_TYPES:
            data[field.name] = ([int(v) for v in value] if isinstance(value, list)
                                else int(value))
    return data
