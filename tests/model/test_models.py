"""The bundled-model registry, the weights cache and the download path.

Downloads go to a local HTTP server (a thread on 127.0.0.1) standing in for the mirror; the
reference is the genuine yolov3-tiny weights file in ../shared/models, hashed here.
"""

from __future__ import annotations

import contextlib
import filecmp
import functools
import hashlib
import http.server
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from shared_paths import SHARED

from darknet_metal.errors import ModelNotFoundError
from darknet_metal.model import bundled as models

SHARED_MODELS = SHARED / "models"
REAL_WEIGHTS = SHARED_MODELS / "yolov3-tiny" / "yolov3-tiny.weights"
REAL_SIZE = 35_434_956
REAL_SHA256 = "dccea06f59b781ec1234ddf8d1e94b9519a97f4245748a7d4db75d5b7080a42c"

# Sizes of the official files as published (bytes).
OFFICIAL_SIZES = {
    "yolov3-tiny": 35_434_956,
    "yolov4-tiny": 24_251_276,
    "yolov3": 248_007_048,
    "yolov4": 257_717_640,
}


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


class _ShortBodyHandler(http.server.BaseHTTPRequestHandler):
    """Announces the full size but sends only the first bytes, then hangs up."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(REAL_SIZE))
        self.end_headers()
        with open(REAL_WEIGHTS, "rb") as f:
            self.wfile.write(f.read(100_000))
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _serve(handler: type[http.server.BaseHTTPRequestHandler], **kwargs: object) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, **kwargs))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _serve_dir(directory: Path) -> contextlib.AbstractContextManager[str]:
    return _serve(_QuietHandler, directory=str(directory))


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if not p.is_dir()] if root.exists() else []


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DARKNET_METAL_HOME", str(cache))
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    return cache


def test_registry_entries_match_the_official_files() -> None:
    assert set(models.MODELS) == set(OFFICIAL_SIZES)
    for name, spec in models.MODELS.items():
        assert spec.name == name
        assert spec.size == OFFICIAL_SIZES[name]
        assert spec.cfg.is_file() and spec.cfg.name == f"{name}.cfg"
        assert spec.names.is_file()
        assert spec.url.startswith("https://") and spec.url.endswith(f"/{name}.weights")
    assert models.MODELS["yolov3"].url == "https://pjreddie.com/media/files/yolov3.weights"
    assert models.MODELS["yolov4"].url == (
        "https://github.com/AlexeyAB/darknet/releases/download/"
        "darknet_yolo_v3_optimal/yolov4.weights"
    )
    assert models.MODELS["yolov4-tiny"].url == (
        "https://github.com/AlexeyAB/darknet/releases/download/"
        "darknet_yolo_v4_pre/yolov4-tiny.weights"
    )


def test_yolov3_tiny_size_and_hash_are_those_of_the_real_file() -> None:
    spec = models.MODELS["yolov3-tiny"]
    assert REAL_WEIGHTS.stat().st_size == spec.size == REAL_SIZE
    assert _sha256(REAL_WEIGHTS) == spec.sha256 == REAL_SHA256


def test_bundled_names_are_the_80_coco_classes() -> None:
    lines = models.MODELS["yolov3-tiny"].names.read_text().splitlines()
    assert len(lines) == 80
    assert lines == (SHARED_MODELS / "cfg" / "coco.names").read_text().splitlines()


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DARKNET_METAL_HOME", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "x"
    assert models.weights_path("yolov4") == tmp_path / "x" / "yolov4" / "yolov4.weights"
    monkeypatch.delenv("DARKNET_METAL_HOME")
    assert models.cache_dir() == Path.home() / ".cache" / "darknet_metal"


def test_weights_url_uses_the_mirror(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DARKNET_METAL_MIRROR", raising=False)
    assert models.weights_url("yolov3-tiny") == models.MODELS["yolov3-tiny"].url
    monkeypatch.setenv("DARKNET_METAL_MIRROR", "http://host:8/base/")
    assert models.weights_url("yolov3-tiny") == "http://host:8/base/yolov3-tiny/yolov3-tiny.weights"


def test_download_from_mirror(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _serve_dir(SHARED_MODELS) as url:
        monkeypatch.setenv("DARKNET_METAL_MIRROR", url)
        files = models.model_files("yolov3-tiny", progress=True)
    target = home / "yolov3-tiny" / "yolov3-tiny.weights"
    assert files.weights == target
    assert filecmp.cmp(target, REAL_WEIGHTS, shallow=False)
    assert _sha256(target) == REAL_SHA256
    assert _files_under(home) == [target], "temporary files left in the cache"
    assert files.cfg == models.MODELS["yolov3-tiny"].cfg
    assert files.names == models.MODELS["yolov3-tiny"].names

    # The cached copy is used from now on: no server needed.
    monkeypatch.setenv("DARKNET_METAL_MIRROR", _closed_port_url())
    assert models.model_files("yolov3-tiny", progress=False).weights == target


def _bad_mirror(tmp_path: Path, content: bytes) -> Path:
    root = tmp_path / "mirror"
    (root / "yolov3-tiny").mkdir(parents=True)
    (root / "yolov3-tiny" / "yolov3-tiny.weights").write_bytes(content)
    return root


def test_truncated_download_is_rejected(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _bad_mirror(tmp_path, REAL_WEIGHTS.read_bytes()[:1_000_000])
    with _serve_dir(root) as url:
        monkeypatch.setenv("DARKNET_METAL_MIRROR", url)
        with pytest.raises(ModelNotFoundError) as info:
            models.model_files("yolov3-tiny", progress=False)
    message = str(info.value)
    assert "1000000 bytes" in message and str(REAL_SIZE) in message
    assert _files_under(home) == []


def test_corrupted_download_is_rejected(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = bytearray(REAL_WEIGHTS.read_bytes())
    data[20_000_000] ^= 0xFF
    root = _bad_mirror(tmp_path, bytes(data))
    bad_hash = hashlib.sha256(data).hexdigest()
    with _serve_dir(root) as url:
        monkeypatch.setenv("DARKNET_METAL_MIRROR", url)
        with pytest.raises(ModelNotFoundError) as info:
            models.model_files("yolov3-tiny", progress=False)
    message = str(info.value)
    assert bad_hash in message and REAL_SHA256 in message
    assert _files_under(home) == []


def test_connection_dropped_mid_download(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _serve(_ShortBodyHandler) as url:
        monkeypatch.setenv("DARKNET_METAL_MIRROR", url)
        with pytest.raises(ModelNotFoundError) as info:
            models.model_files("yolov3-tiny", progress=False)
    message = str(info.value)
    assert "connection closed after 100000 of 35434956 bytes" in message
    assert str(home / "yolov3-tiny" / "yolov3-tiny.weights") in message
    assert _files_under(home) == []


def test_server_down_says_where_to_put_the_file(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = _closed_port_url()
    monkeypatch.setenv("DARKNET_METAL_MIRROR", url)
    with pytest.raises(ModelNotFoundError) as info:
        models.model_files("yolov3-tiny", progress=False)
    message = str(info.value)
    assert str(home / "yolov3-tiny" / "yolov3-tiny.weights") in message
    assert f"{url}/yolov3-tiny/yolov3-tiny.weights" in message
    assert _files_under(home) == []


def test_http_error_says_where_to_put_the_file(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty").mkdir()
    with _serve_dir(tmp_path / "empty") as url:
        monkeypatch.setenv("DARKNET_METAL_MIRROR", url)
        with pytest.raises(ModelNotFoundError) as info:
            models.model_files("yolov4-tiny", progress=False)
    message = str(info.value)
    assert "404" in message
    assert str(home / "yolov4-tiny" / "yolov4-tiny.weights") in message
    assert _files_under(home) == []


def test_silent_server_times_out(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A listening socket that never answers: the connection succeeds, the response never comes.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        monkeypatch.setenv("DARKNET_METAL_MIRROR", f"http://127.0.0.1:{listener.getsockname()[1]}")
        with pytest.raises(ModelNotFoundError) as info:
            models.model_files("yolov3-tiny", progress=False, timeout=0.3)
    message = str(info.value)
    assert "timed out" in message
    assert str(home / "yolov3-tiny" / "yolov3-tiny.weights") in message
    assert _files_under(home) == []


def test_cached_file_is_used_without_network(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = home / "yolov3-tiny" / "yolov3-tiny.weights"
    target.parent.mkdir(parents=True)
    os.symlink(REAL_WEIGHTS, target)
    monkeypatch.setenv("DARKNET_METAL_MIRROR", _closed_port_url())
    files = models.model_files("yolov3-tiny", progress=False)
    assert files.weights == target
    assert files.cfg.read_text() == models.MODELS["yolov3-tiny"].cfg.read_text()


def test_shared_models_directory_works_as_a_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DARKNET_METAL_HOME", str(SHARED_MODELS))
    monkeypatch.setenv("DARKNET_METAL_MIRROR", _closed_port_url())
    files = models.model_files("yolov3-tiny", download=False)
    assert files.weights == REAL_WEIGHTS


def test_cached_file_of_wrong_size_is_reported(home: Path) -> None:
    target = home / "yolov3-tiny" / "yolov3-tiny.weights"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\0" * 1234)
    with pytest.raises(ModelNotFoundError) as info:
        models.model_files("yolov3-tiny", progress=False)
    message = str(info.value)
    assert str(target) in message and "1234 bytes" in message and str(REAL_SIZE) in message
    assert target.read_bytes() == b"\0" * 1234, "the user's file must not be touched"


def test_missing_weights_without_download(home: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        models.model_files("yolov3", download=False)
    message = str(info.value)
    assert str(home / "yolov3" / "yolov3.weights") in message
    assert "https://pjreddie.com/media/files/yolov3.weights" in message


def test_unwritable_cache_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DARKNET_METAL_HOME", str(blocker))
    monkeypatch.setenv("DARKNET_METAL_MIRROR", _closed_port_url())
    with pytest.raises(ModelNotFoundError, match="DARKNET_METAL_HOME"):
        models.model_files("yolov3-tiny", progress=False)


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        models.model_files("yolov9-huge")
    message = str(info.value)
    assert "yolov9-huge" in message
    for name in OFFICIAL_SIZES:
        assert name in message


def _snapshot(root: Path) -> dict[str, tuple[str, int]] | None:
    """Every path under ``root`` (folders too) with its kind and mode; None if absent."""
    if not root.exists():
        return None
    return {
        str(p.relative_to(root)): ("dir" if p.is_dir() else "file", p.stat().st_mode)
        for p in [root, *root.rglob("*")]
    }


@pytest.mark.parametrize("failure", ["404", "unreachable"])
@pytest.mark.parametrize("layout", ["absent", "absent-parents", "existing"])
def test_failed_download_leaves_the_cache_as_it_was(
    failure: str, layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "a" / "b" / "cache" if layout == "absent-parents" else tmp_path / "cache"
    if layout == "existing":
        (home / "yolov3").mkdir(parents=True)
        (home / "yolov3" / "notes.txt").write_text("kept")
    monkeypatch.setenv("DARKNET_METAL_HOME", str(home))
    before = _snapshot(tmp_path)
    (tmp_path / "empty").mkdir()
    with contextlib.ExitStack() as stack:
        if failure == "404":
            url = stack.enter_context(_serve_dir(tmp_path / "empty"))
        else:
            url = _closed_port_url()
        monkeypatch.setenv("DARKNET_METAL_MIRROR", url)
        with pytest.raises(ModelNotFoundError):
            models.model_files("yolov4-tiny", progress=False)
    (tmp_path / "empty").rmdir()
    assert _snapshot(tmp_path) == before


def test_model_folder_is_made_only_for_a_good_file(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A truncated file is rejected after the whole body arrived: no NAME folder either.
    root = _bad_mirror(tmp_path, REAL_WEIGHTS.read_bytes()[:1_000_000])
    home.mkdir()
    with _serve_dir(root) as url:
        monkeypatch.setenv("DARKNET_METAL_MIRROR", url)
        with pytest.raises(ModelNotFoundError):
            models.model_files("yolov3-tiny", progress=False)
    assert list(home.iterdir()) == []


def test_download_respects_the_umask(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = os.umask(0o027)
    try:
        with _serve_dir(SHARED_MODELS) as url:
            monkeypatch.setenv("DARKNET_METAL_MIRROR", url)
            files = models.model_files("yolov3-tiny", progress=False)
    finally:
        os.umask(old)
    assert files.weights.stat().st_mode & 0o777 == 0o640
    assert files.weights.parent.stat().st_mode & 0o777 == 0o750
    assert home.stat().st_mode & 0o777 == 0o750
