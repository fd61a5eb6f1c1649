"""Darknet's ``.data`` file: ``key = value`` lines naming a dataset's parts.

Read as Darknet V5's ``read_data_cfg`` (``src-lib/option_list.cpp``) reads it: spaces and tabs
around keys and values are dropped; a line whose first non-blank character is ``#`` or ``;``
is a comment; ``:`` separates a key from its value as ``=`` does (the first of either ends
the key); Windows line endings are fine; text after a value is part of it (there are no
comments after a value). When a key appears twice, Darknet's ``option_find`` takes the
first: so does this reader, with a warning at the later line.

Keys: ``classes``, ``train``, ``valid``, ``names``, ``backup`` are used; ``test``, ``labels``,
``results``, ``eval``, ``map``, ``difficult``, ``top``, ``leaves`` (other Darknet commands'
keys) are kept in ``Dataset.options``; any other key is a warning. Paths are resolved by
:func:`darknet_metal.datasets.paths.resolve`: the working directory first (Darknet's rule),
then the ``.data`` file's folder.

Differences from Darknet: a line that is not ``key = value`` is an error (Darknet warns and
goes on); ``classes`` must be a positive integer (Darknet's ``atoi`` reads ``3x`` as 3 and
``x`` as 0); without ``valid`` the train set is validated on (Darknet's ``train_detector``
and ``map`` do the same) with a warning; without ``names`` the classes are named by number.
"""

from __future__ import annotations

import re
from pathlib import Path

from darknet_metal.datasets.dataset import Dataset, Sample, darknet_labels, read_image_list
from darknet_metal.datasets.labels import read_names
from darknet_metal.datasets.paths import resolve
from darknet_metal.datasets.problems import Problems
from darknet_metal.datasets.textfile import read_lines
from darknet_metal.errors import DatasetError

__all__ = ["KNOWN_KEYS", "load_data_file", "parse_data_file"]

#: Every key a Darknet command reads from a ``.data`` file.
KNOWN_KEYS = (
    "classes", "train", "valid", "names", "backup",
    "test", "labels", "results", "eval", "map", "difficult", "top", "leaves",
)  # fmt: skip

# Darknet's strip() splits "KEY = VAL" with this pattern (lazy key up to the first ':' or '=').
_KEY_VALUE = re.compile(r"^\s*([^=]*?)\s*[:=]\s*(.*?)\s*$")


def parse_data_file(path: Path, problems: Problems) -> dict[str, tuple[str, int]]:
    """``{key: (value, line)}`` of a ``.data`` file, the first of duplicate keys kept;
    faults added to ``problems``. ``DatasetError`` when the file cannot be read."""
    entries: dict[str, tuple[str, int]] = {}
    for number, text in read_lines(path, ".data file"):
        stripped = text.strip()
        if not stripped or stripped[0] in "#;":
            continue
        match = _KEY_VALUE.match(text)
        if match is None:
            problems.error(path, number, f"not a 'key = value' line: '{stripped}'")
            continue
        key, value = match.group(1), match.group(2)
        if not key:
            problems.error(path, number, f"no key before the '=': '{stripped}'")
            continue
        if key in entries:
            problems.warning(
                path, number, f"duplicate key '{key}': the first, at line {entries[key][1]}, "
                "is used (as Darknet does)"
            )
            continue
        entries[key] = (value, number)
        if key not in KNOWN_KEYS:
            problems.warning(path, number, f"unknown key '{key}' (Darknet's keys: "
                             f"{', '.join(KNOWN_KEYS)})")
    return entries


def load_data_file(path: Path) -> Dataset:
    """The dataset a ``.data`` file describes (problems in ``Dataset.problems``)."""
    path = Path(path)
    problems = Problems()
    entries = parse_data_file(path, problems)
    folder = path.parent

    def value_of(key: str) -> tuple[str, int] | None:
        entry = entries.get(key)
        if entry is not None and not entry[0]:
            problems.error(path, entry[1], f"'{key}' has no value")
            return None
        return entry

    names: list[str] | None = None
    names_entry = value_of("names")
    if names_entry is not None:
        names_path = resolve(names_entry[0], folder)
        try:
            names = read_names(names_path, problems)
        except DatasetError as exc:
            problems.error(path, names_entry[1], f"names = {names_entry[0]}: {exc.reason}"
                           f"{_comment_hint(names_entry[0])} (looked for {exc.path})")

    classes = _read_classes(path, value_of("classes"), names, problems)
    if names is None:
        if "names" not in entries:
            problems.warning(path, None, "no 'names' key: classes are named by their number")
        names = [str(i) for i in range(classes)]
    elif len(names) != classes and names_entry is not None:
        problems.error(
            path, names_entry[1], f"the names file has {len(names)} name"
            f"{'s' if len(names) != 1 else ''} but classes = {classes}"
        )

    sets: dict[str, list[Sample]] = {}
    for key in ("train", "valid"):
        entry = value_of(key)
        if entry is None:
            continue
        list_path = resolve(entry[0], folder)
        try:
            sets[key] = read_image_list(list_path, problems, label_rule=darknet_labels)
        except DatasetError as exc:
            problems.error(path, entry[1], f"{key} = {entry[0]}: {exc.reason}"
                           f"{_comment_hint(entry[0])} (looked for {exc.path})")
            sets[key] = []
    if "train" not in entries and "valid" not in entries:
        problems.error(path, None, "neither 'train' nor 'valid' is given: no images")
    elif "train" not in entries:
        problems.warning(path, None, "no 'train' key: the dataset has no training set")
    valid_is_train = "valid" not in entries and "train" in entries
    if valid_is_train:
        problems.warning(path, None, "no 'valid' key: the train set is validated on, as "
                         "Darknet does")
        sets["valid"] = sets.get("train", [])

    backup = None
    backup_entry = value_of("backup")
    if backup_entry is not None:
        backup = resolve(backup_entry[0], folder)
        if backup.exists() and not backup.is_dir():
            problems.error(path, backup_entry[1], f"backup = {backup_entry[0]}: {backup} is "
                           "not a folder")

    return Dataset(
        path=path.absolute(),
        format="darknet",
        problems=_in_line_order(problems, path),
        names=names,
        classes=classes,
        backup=backup,
        train=sets.get("train", []),
        valid=sets.get("valid", []),
        options={key: value for key, (value, _) in entries.items()},
        valid_is_train=valid_is_train,
    )


def _in_line_order(problems: Problems, path: Path) -> Problems:
    """The ``.data`` file's own problems first, by line (whole-file ones last), then the
    others (names file, image lists) in the order found."""
    own = [p for p in problems if p.path == str(path)]
    own.sort(key=lambda p: (p.line is None, p.line or 0))
    ordered = Problems(own)
    ordered.extend(p for p in problems if p.path != str(path))
    return ordered


def _read_classes(
    path: Path, entry: tuple[str, int] | None, names: list[str] | None, problems: Problems
) -> int:
    if entry is None:
        if names:
            problems.warning(path, None, f"no 'classes' key: {len(names)} classes, one per "
                             "name in the names file")
            return len(names)
        problems.error(path, None, "no 'classes' key (and no names file to count them)")
        return 0
    text, number = entry
    try:
        classes = int(text)
    except ValueError:
        problems.error(path, number, f"classes = {text}: not an integer")
        return len(names) if names else 0
    if classes <= 0:
        problems.error(path, number, f"classes = {text}: must be at least 1")
        return len(names) if names else 0
    return classes


def _comment_hint(value: str) -> str:
    if "#" in value:
        return " (a '#' after a value is part of it: .data files have no end-of-line comments)"
    return ""
