"""Problems found in a dataset: one per fault, each locating it by file and line.

Readers collect problems instead of stopping at the first, so ``check-data`` can report
every one at once; :func:`raise_first_error` turns the collected errors into one
``DatasetError`` for callers that cannot go on (training, ``load_dataset``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from darknet_metal.errors import DatasetError

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One fault: ``severity`` "error" (the dataset cannot be used as it is) or "warning"
    (it can, but probably not as meant); ``path`` of the file at fault, ``line`` 1-based
    (None for the whole file), ``message`` saying what was found and what was expected."""

    severity: Severity
    path: str
    line: int | None
    message: str

    def location(self) -> str:
        """``path:line`` (or ``path`` alone)."""
        return self.path if self.line is None else f"{self.path}:{self.line}"

    def __str__(self) -> str:
        return f"{self.location()}: {self.message}"

    def to_dict(self) -> dict[str, object]:
        """The problem as JSON-ready values (``file``, ``line``, ``severity``, ``message``)."""
        return {
            "severity": self.severity,
            "file": self.path,
            "line": self.line,
            "message": self.message,
        }

    def to_error(self) -> DatasetError:
        """The ``DatasetError`` that reports this problem."""
        return DatasetError(self.message, path=self.path, line=self.line)


class Problems(list[Problem]):
    """A list of problems with shorthands to add one."""

    def error(self, path: str | os.PathLike[str], line: int | None, message: str) -> None:
        """Add an error at ``path:line``."""
        self.append(Problem("error", os.fspath(path), line, message))

    def warning(self, path: str | os.PathLike[str], line: int | None, message: str) -> None:
        """Add a warning at ``path:line``."""
        self.append(Problem("warning", os.fspath(path), line, message))

    @property
    def errors(self) -> list[Problem]:
        """The problems of severity "error", in the order found."""
        return [p for p in self if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        """The problems of severity "warning", in the order found."""
        return [p for p in self if p.severity == "warning"]


def raise_first_error(problems: Iterable[Problem]) -> None:
    """Raise the first error among ``problems`` as a ``DatasetError`` (saying how many more
    there are and how to list them all); return when there is none."""
    errors = [p for p in problems if p.severity == "error"]
    if not errors:
        return
    first = errors[0]
    message = first.message
    if len(errors) > 1:
        message += (
            f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''}; "
            "`darknet-metal check-data` lists them all)"
        )
    raise DatasetError(message, path=first.path, line=first.line)
