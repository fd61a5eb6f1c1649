"""Bundled models and the cache of their pretrained weights.

The package ships the official cfg of each bundled model and the COCO class names; the
weights (tens to hundreds of MB) are downloaded on first use into a cache directory laid
out as ``<cache>/NAME/NAME.weights``:

- the cache is ``$DARKNET_METAL_HOME`` when set, else ``~/.cache/darknet_metal``;
- downloads come from the official URL, or from ``$DARKNET_METAL_MIRROR/NAME/NAME.weights``
  when that variable holds a base URL laid out like the cache;
- a download lands in a hidden temporary file at the top of the cache and is renamed into
  ``NAME/NAME.weights`` only after its size (and SHA-256, where known) matched, so the cache
  never holds a partial or corrupt file under the final name; the ``NAME`` folder is made
  only then, and a failed download removes its temporary file and every folder it made,
  leaving the cache as it was. Files and folders get the usual permissions (umask applied).

The cfg and names always come from the package, even when the cache directory also holds a
``NAME.cfg`` or ``coco.names``: the registry pairs each
weights file with the exact cfg it was trained with, so a stray or edited cfg next to the
weights cannot silently change the network. A custom cfg is loaded by path instead
(``darknet_metal.load(cfg, weights)`` or ``darknet-metal detect --cfg C --weights W``).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import secrets
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import BinaryIO, NamedTuple

from darknet_metal.errors import ModelNotFoundError

__all__ = ["DOWNLOAD_TIMEOUT", "HOME_ENV", "MIRROR_ENV", "MODELS", "SAMPLE_IMAGE", "ModelFiles",
           "ModelSpec", "cache_dir", "get_spec", "model_files", "model_names", "weights_path",
           "weights_url"]

HOME_ENV = "DARKNET_METAL_HOME"
MIRROR_ENV = "DARKNET_METAL_MIRROR"

#: Seconds a single blocking network operation (connect, one read) may take.
DOWNLOAD_TIMEOUT = 30.0

_CHUNK = 1 << 20
_DATA_DIR = Path(__file__).resolve().parent.parent / "data"

#: Darknet's sample image (a dog, a bicycle and a truck), shipped with the package.
SAMPLE_IMAGE = _DATA_DIR / "images" / "dog.jpg"


@dataclass(frozen=True)
class ModelSpec:
    """One bundled model: where its files are and what its weights must be.

    ``size`` is the exact length of the weights file in bytes; ``sha256`` its hex digest,
    or None when no trusted digest is recorded (the size is then the only check).
    ``backbone_layers``: how many first layers make the backbone Darknet's README trains the
    model from (``darknet partial ... yolov4-tiny.conv.29 29``).
    """

    name: str
    cfg: Path
    names: Path
    url: str
    size: int
    sha256: str | None
    backbone_layers: int


class ModelFiles(NamedTuple):
    """Paths of the three files that make a runnable model."""

    cfg: Path
    weights: Path
    names: Path


def _spec(name: str, url: str, size: int, sha256: str | None, backbone: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        cfg=_DATA_DIR / "cfg" / f"{name}.cfg",
        names=_DATA_DIR / "coco.names",
        url=url,
        size=size,
        sha256=sha256,
        backbone_layers=backbone,
    )


_PJREDDIE = "https://pjreddie.com/media/files"
_ALEXEYAB = "https://github.com/AlexeyAB/darknet/releases/download"

#: The bundled models, by name. URLs are those given in the Darknet READMEs.
MODELS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            _spec(
                "yolov3-tiny",
                f"{_PJREDDIE}/yolov3-tiny.weights",
                35_434_956,
                "dccea06f59b781ec1234ddf8d1e94b9519a97f4245748a7d4db75d5b7080a42c",
                15,  # yolov3-tiny.conv.15
            ),
            _spec(
                "yolov4-tiny",
                f"{_ALEXEYAB}/darknet_yolo_v4_pre/yolov4-tiny.weights",
                24_251_276,
                None,
                29,  # yolov4-tiny.conv.29
            ),
            # darknet53.conv.74: Darknet's README takes it from ImageNet's darknet53.weights;
            # the first 74 layers of the COCO weights are that backbone trained further.
            _spec("yolov3", f"{_PJREDDIE}/yolov3.weights", 248_007_048, None, 74),
            _spec(
                "yolov4",
                f"{_ALEXEYAB}/darknet_yolo_v3_optimal/yolov4.weights",
                257_717_640,
                None,
                137,  # yolov4.conv.137
            ),
        )
    }
)


def model_names() -> list[str]:
    """Names of the bundled models, in registry order."""
    return list(MODELS)


def get_spec(name: str) -> ModelSpec:
    """The registry entry of ``name``; ModelNotFoundError listing the known names if absent."""
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(MODELS)
        raise ModelNotFoundError(f"unknown model '{name}'; known models: {known}") from None


def cache_dir() -> Path:
    """The weights cache: ``$DARKNET_METAL_HOME``, default ``~/.cache/darknet_metal``."""
    home = os.environ.get(HOME_ENV, "").strip()
    if home:
        return Path(home).expanduser()
    return Path.home() / ".cache" / "darknet_metal"


def weights_path(name: str) -> Path:
    """Where the cache keeps the weights of ``name``: ``<cache>/NAME/NAME.weights``."""
    get_spec(name)
    return cache_dir() / name / f"{name}.weights"


def weights_url(name: str) -> str:
    """The URL the weights of ``name`` are downloaded from (the mirror when one is set)."""
    spec = get_spec(name)
    mirror = os.environ.get(MIRROR_ENV, "").strip()
    if mirror:
        return f"{mirror.rstrip('/')}/{name}/{name}.weights"
    return spec.url


def model_files(
    name: str,
    *,
    download: bool = True,
    progress: bool = True,
    timeout: float = DOWNLOAD_TIMEOUT,
) -> ModelFiles:
    """Paths of the bundled cfg, the cached weights and the names file of model ``name``.

    When the weights are not cached and ``download`` is true, they are fetched (see the
    module docstring), with a progress bar on stderr when ``progress`` is true; ``timeout``
    bounds each blocking network operation, in seconds.

    Raises ModelNotFoundError for an unknown name, a cached file of the wrong size, weights
    absent with ``download`` false, a failed download (the message says where to put the
    file by hand) or a downloaded file whose size or SHA-256 is not the expected one.
    """
    spec = get_spec(name)
    target = weights_path(name)
    if target.exists():
        _check_cached(spec, target)
    elif not download:
        raise ModelNotFoundError(
            f"the weights of '{name}' are not in the cache; download {spec.url} "
            f"and put it at {target} (expected {spec.size} bytes)"
        )
    else:
        _download(spec, weights_url(name), target, progress=progress, timeout=timeout)
    return ModelFiles(cfg=spec.cfg, weights=target, names=spec.names)


def _check_cached(spec: ModelSpec, target: Path) -> None:
    # Only the size: hashing hundreds of MB on every load would cost seconds; the hash was
    # checked when the file was downloaded.
    if not target.is_file():
        raise ModelNotFoundError(f"{target} is not a regular file; remove it and retry")
    size = target.stat().st_size
    if size != spec.size:
        raise ModelNotFoundError(
            f"{target} has {size} bytes, expected {spec.size} for '{spec.name}' "
            f"(incomplete or not the official file); delete it to download it again "
            f"from {spec.url}"
        )


def _download(spec: ModelSpec, url: str, target: Path, *, progress: bool, timeout: float) -> None:
    manual = (
        f"download {spec.url} by hand and put it at {target} (expected {spec.size} bytes), "
        f"or set {MIRROR_ENV} to a server laid out as NAME/NAME.weights"
    )
    # The temporary file sits at the top of the cache (same file system as the target, so
    # the final rename is atomic); the model folder is made only once the file is good.
    root = target.parent.parent
    created: list[Path] = []
    done = False
    try:
        try:
            created += _make_dirs(root)
            tmp = root / f".{target.name}.{secrets.token_hex(6)}.part"
            # O_EXCL: never write through a file or link that appeared under this name;
            # mode 0o666 lets the umask decide the permissions, as for any new file.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as exc:
            raise ModelNotFoundError(
                f"cannot write to the weights cache {root}: {exc.strerror or exc}; "
                f"set {HOME_ENV} to a writable directory, or {manual}"
            ) from exc
        try:
            with os.fdopen(fd, "wb") as out:
                try:
                    size, digest = _fetch(spec, url, out, progress=progress, timeout=timeout)
                except (
                    urllib.error.URLError,
                    http.client.HTTPException,
                    OSError,
                    ValueError,
                ) as exc:
                    raise ModelNotFoundError(
                        f"could not download the weights of '{spec.name}' from {url}: "
                        f"{_reason(exc)}; {manual}"
                    ) from exc
                out.flush()
                os.fsync(out.fileno())
            _check_download(spec, url, size, digest, manual)
            try:
                created += _make_dirs(target.parent)
                os.replace(tmp, target)
            except OSError as exc:
                raise ModelNotFoundError(
                    f"cannot write to the weights cache {target.parent}: "
                    f"{exc.strerror or exc}; set {HOME_ENV} to a writable directory, or {manual}"
                ) from exc
            done = True
        finally:
            if not done:
                with contextlib.suppress(OSError):
                    tmp.unlink()
    finally:
        if not done:
            _remove_dirs(created)


def _make_dirs(path: Path) -> list[Path]:
    """Create ``path`` and its missing parents; returns the folders made here, outermost
    first (a folder another process makes meanwhile is not counted)."""
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    made = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                if not folder.is_dir():
                    raise
                continue
            made.append(folder)
    except OSError:
        _remove_dirs(made)
        raise
    return made


def _remove_dirs(made: list[Path]) -> None:
    """Remove the folders ``_make_dirs`` made, innermost first, each only while empty."""
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _fetch(
    spec: ModelSpec, url: str, out: BinaryIO, *, progress: bool, timeout: float
) -> tuple[int, str]:
    """Stream ``url`` into ``out``; returns (bytes written, sha256 hex digest).

    Stops early, with what it has, when the server announces or sends more bytes than the
    expected size, so a wrong file is not downloaded in full before being rejected.
    """
    from tqdm import tqdm

    request = urllib.request.Request(url, headers={"User-Agent": "darknet-metal"})
    hasher = hashlib.sha256()
    written = 0
    with urllib.request.urlopen(request, timeout=timeout) as response:
        announced = response.headers.get("Content-Length")
        if announced is not None and announced.isdigit() and int(announced) != spec.size:
            return int(announced), "(not downloaded)"
        with tqdm(
            total=spec.size,
            desc=f"{spec.name}.weights",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            disable=not progress,
            leave=False,
        ) as bar:
            while written <= spec.size:
                chunk = response.read(_CHUNK)
                if not chunk:
                    break
                out.write(chunk)
                hasher.update(chunk)
                written += len(chunk)
                bar.update(len(chunk))
    if announced is not None and written < int(announced):
        # urllib returns a short body without complaint when the peer hangs up early.
        raise ConnectionError(f"connection closed after {written} of {announced} bytes")
    return written, hasher.hexdigest()


def _check_download(spec: ModelSpec, url: str, size: int, digest: str, manual: str) -> None:
    if size != spec.size:
        raise ModelNotFoundError(
            f"the file at {url} has {size} bytes, expected {spec.size} for '{spec.name}'; "
            f"nothing was saved; {manual}"
        )
    if spec.sha256 is not None and digest != spec.sha256:
        raise ModelNotFoundError(
            f"the file at {url} has sha256 {digest}, expected {spec.sha256} for "
            f"'{spec.name}'; nothing was saved; {manual}"
        )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
