"""Exceptions raised for bad input. Each names the file, line, layer or value at fault."""

from __future__ import annotations

import os


def _restore(cls: type[BaseException], args: tuple[object, ...],
             state: dict[str, object]) -> BaseException:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class DarknetMetalError(Exception):
    """Base class of every error this package raises on purpose. Errors pickle whole
    (message and attributes), so one raised in a loader process or another rank reads the
    same in the process that reports it."""

    def __reduce__(self) -> tuple[object, ...]:
        # Exception's own pickling calls cls(*args): wrong for keyword-only attributes.
        return (_restore, (type(self), self.args, dict(self.__dict__)))


class ArgumentError(DarknetMetalError, ValueError):
    """An argument with a value the call does not accept; the message names the argument,
    what was given and what is allowed."""


class ArgumentTypeError(DarknetMetalError, TypeError):
    """An argument of a type the call does not accept; the message names the argument, what
    was given and what is allowed."""


class LayerIndexError(DarknetMetalError, IndexError):
    """A layer index outside the network."""


class MemoryLimitError(DarknetMetalError, MemoryError):
    """A network that needs more memory than the machine has, found before allocating it.

    ``needed`` and ``available`` are in bytes."""

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        self.needed = needed
        self.available = available
        super().__init__(message)


class CfgError(DarknetMetalError, ValueError):
    """A `.cfg` file that cannot describe a network.

    Attributes ``path``, ``line`` (1-based, or None) and ``key`` (or None) locate the fault.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        line: int | None = None,
        key: str | None = None,
    ) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.line = line
        self.key = key
        self.reason = message
        where = self.path or "<cfg>"
        if line is not None:
            where += f":{line}"
        if key is not None:
            where += f": key '{key}'"
        super().__init__(f"{where}: {message}")


class WeightsError(DarknetMetalError, ValueError):
    """A `.weights` file that does not hold exactly what the cfg needs.

    Attributes ``path`` and ``layer`` (0-based cfg layer index, or None) locate the fault.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        layer: int | None = None,
        hint: str = "",
        cli_hint: str | None = None,
    ) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.layer = layer
        self.reason = message
        #: What to do about it, in Python's terms and (``cli_hint``, when it differs) in the
        #: command line's: ``str()`` carries the first, ``cli_message`` the second.
        self.hint = hint
        self.cli_hint = hint if cli_hint is None else cli_hint
        where = self.path or "<weights>"
        if layer is not None:
            where += f": layer {layer}"
        self.where = where
        super().__init__(f"{where}: {message}" + (f" {hint}" if hint else ""))

    @property
    def cli_message(self) -> str:
        """The message as a command prints it: the fix in the command line's terms."""
        return f"{self.where}: {self.reason}" + (f" {self.cli_hint}" if self.cli_hint else "")


class DatasetError(DarknetMetalError, ValueError):
    """A dataset (a ``.data`` or dataset ``.yaml`` file, an image list, a names or label file)
    that cannot be read as one.

    Attributes ``path`` and ``line`` (1-based, or None) locate the fault; ``reason`` is the
    message without them.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        line: int | None = None,
    ) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.line = line
        self.reason = message
        where = self.path or "<dataset>"
        if line is not None:
            where += f":{line}"
        super().__init__(f"{where}: {message}")


class ImageError(DarknetMetalError, ValueError):
    """An image that cannot be read or has the wrong shape or type."""


class ImageTooLargeError(ImageError):
    """An image with more pixels than the caller allows (``decode_image``'s ``max_pixels``)."""


class ModelNotFoundError(DarknetMetalError, FileNotFoundError):
    """A bundled model whose weights are not in the cache and cannot be downloaded."""


class DeviceError(DarknetMetalError, RuntimeError):
    """A compute device that is unavailable or failed."""


class BindingError(DeviceError):
    """Buffers that do not fit a kernel's declared roles: a role missing, unknown or bound to
    too small a buffer (see ``darknet_metal.metal.registry.Kernel.bind``), or a program step
    reading a tensor nothing has written yet (two roles swapped). Caught before anything is
    encoded, because a kernel given the wrong buffer reads or writes the wrong memory silently."""


class NonFiniteError(DarknetMetalError, ArithmeticError):
    """A training step produced NaN or infinity (``layer``: the first layer where it was
    found, or None); the step was undone, leaving every parameter, statistic, optimizer
    state and counter as it was before it."""

    def __init__(self, message: str, *, layer: int | None = None) -> None:
        super().__init__(message)
        self.layer = layer


class CheckpointError(DarknetMetalError, ValueError):
    """A training checkpoint (``.state`` beside its ``.weights``) that cannot be read or does
    not fit the network; ``path`` names the file."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.reason = message
        super().__init__(f"{self.path or '<checkpoint>'}: {message}")


class DependencyError(DarknetMetalError, ImportError):
    """An optional library a call needs is not installed; the message names it and the
    ``pip install`` extra that brings it."""


class RepositoryError(DarknetMetalError, ValueError):
    """A model repository (``serve``) that cannot be served: a missing or malformed
    ``config.pbtxt``, a config contradicting its ``.cfg``, a version folder without its files.

    Attributes ``path`` (the file or folder), ``line`` (1-based, or None) and ``field`` (the
    config field at fault, such as ``input[0].dims``, or None) locate the fault.
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None,
                 line: int | None = None, field: str | None = None) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.line = line
        self.field = field
        self.reason = message
        where = self.path or "<repository>"
        if line is not None:
            where += f":{line}"
        if field is not None:
            where += f": field '{field}'"
        super().__init__(f"{where}: {message}")


class RequestError(DarknetMetalError, ValueError):
    """A request the server answers with an error (``serve``): ``status`` is the HTTP status
    (400 bad request, 404 unknown model, 413 too large, ...), the message names the field."""

    def __init__(self, message: str, *, status: int = 400) -> None:
        self.status = status
        super().__init__(message)


class ExportError(DarknetMetalError, ValueError):
    """A network (or an argument) that an export cannot express; the message names the layer,
    its kind and why. Nothing is written."""

    def __init__(self, message: str, *, layer: int | None = None,
                 kind: str | None = None) -> None:
        self.layer = layer
        self.kind = kind
        super().__init__(message)


class Unsupported(Exception):
    """Raised by an op's device or training emitters when a layer cannot run there; the message
    is the reason (reported by ``coverage()``; on a device the layer then runs on the CPU)."""
