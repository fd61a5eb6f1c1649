"""Model repositories for the serving tests, and ``darknet-metal serve`` run as a child
process (the way users run it) on a free loopback port."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared_paths import SHARED, YOLOV3_TINY

MICRO_DIR = SHARED / "golden" / "darknet-v5-train" / "micro-v4-sgd"
#: yolov3-tiny's input in the serving tests (the COCO weights work at any multiple of 32).
TINY_SIZE = 64

TINY_CONFIG = """\
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 20000 preferred_batch_size: [8] }
"""
MICRO_CONFIG = """\
name: "micro"
max_batch_size: 4
"""


def tiny_cfg_text(size: int = TINY_SIZE) -> str:
    text = (YOLOV3_TINY / "yolov3-tiny.cfg").read_text()
    text = re.sub(r"(?m)^width=\d+", f"width={size}", text)
    return re.sub(r"(?m)^height=\d+", f"height={size}", text)


def add_tiny(repo: Path, name: str = "tiny", config: str | None = TINY_CONFIG,
             version: int = 1, size: int = TINY_SIZE) -> Path:
    """yolov3-tiny (COCO weights and names) at ``size`` as ``repo/name/version``."""
    folder = repo / name / str(version)
    folder.mkdir(parents=True)
    (folder / "yolov3-tiny.cfg").write_text(tiny_cfg_text(size))
    os.symlink(YOLOV3_TINY / "yolov3-tiny.weights", folder / "yolov3-tiny.weights")
    shutil.copy(YOLOV3_TINY / "coco.names", folder / "coco.names")
    if config is not None:
        (repo / name / "config.pbtxt").write_text(config)
    return folder


def add_micro(repo: Path, name: str = "micro", config: str | None = MICRO_CONFIG,
              version: int = 1) -> Path:
    """The micro-v4-sgd network (two [yolo] heads, 128x128) with its golden initial weights."""
    folder = repo / name / str(version)
    folder.mkdir(parents=True)
    shutil.copy(MICRO_DIR / "micro-v4-sgd.cfg", folder / "micro.cfg")
    shutil.copy(MICRO_DIR / "init.weights", folder / "micro.weights")
    if config is not None:
        (repo / name / "config.pbtxt").write_text(config)
    return folder


class ServerProcess:
    """``darknet-metal serve REPO --port 0`` in a child process; ``url`` once it listens.
    Its standard error is collected in ``log`` (for the failure messages)."""

    def __init__(self, repository: Path, *args: str, device: str = "cpu",
                 timeout: float = 180.0) -> None:
        command = [sys.executable, "-m", "darknet_metal", "serve", str(repository),
                   "--port", "0", "--device", device, *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._listening = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._listening.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError(f"the server did not start:\n{self.log}")

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            found = re.search(r" on (http://[^ ]+) \(demo page", line)
            if found:
                self.url = found.group(1)
                self._listening.set()
        self._listening.set()

    @property
    def address(self) -> str:
        """host:port, as tritonclient takes it."""
        return self.url.removeprefix("http://")

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` and wait for the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_until(condition, timeout: float = 30.0, step: float = 0.05) -> bool:
    """Poll ``condition()`` until true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return bool(condition())
