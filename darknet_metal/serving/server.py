"""``darknet-metal serve MODEL_REPOSITORY``: load the repository, then serve it with uvicorn
until SIGTERM or Ctrl-C, which stop new connections, finish the requests in flight and what
the batchers hold, then exit 0."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from darknet_metal.cli_args import positive_int
from darknet_metal.errors import ArgumentError, DependencyError

__all__ = ["add_commands", "open_socket", "serve"]

_INSTALL = 'pip install "darknet-metal[serve]"'


def add_commands(commands: Any) -> None:
    """Add ``serve`` to ``commands`` (an argparse subparsers object)."""
    from darknet_metal.network import DEVICES

    serve_cmd = commands.add_parser(
        "serve",
        help="serve a model repository over Triton's HTTP inference protocol",
        description=(
            "Serve every model of MODEL_REPOSITORY (Triton's layout: <model>/config.pbtxt "
            "and <model>/<version>/ holding the .cfg, .weights and .names) over the KServe "
            "v2 / Triton HTTP/REST protocol (health, metadata, config, infer with JSON or "
            "binary tensors, statistics), with dynamic batching as each config asks, "
            "POST /v2/models/<model>/detect (an image in, JSON detections out), Prometheus "
            "metrics at /metrics and a demo page at /. SIGTERM or Ctrl-C finish the "
            "requests in flight, then exit."
        ),
    )
    serve_cmd.add_argument("repository", metavar="MODEL_REPOSITORY", type=Path,
                           help="folder of models in Triton's layout")
    serve_cmd.add_argument("--host", default="127.0.0.1",
                           help="address to listen on (default: %(default)s, this machine "
                           "only; 0.0.0.0 for every interface)")
    serve_cmd.add_argument("--port", type=_port, default=8000,
                           help="TCP port (default: %(default)s; 0 picks a free one)")
    serve_cmd.add_argument("--device", default="cpu", choices=DEVICES,
                           help="cpu, metal, emu or cuda (default: %(default)s)")
    serve_cmd.add_argument("--max-body-mb", type=positive_int, default=64, metavar="MB",
                           help="largest request body accepted, after decompression; larger "
                           "ones get 413 (default: %(default)s)")
    serve_cmd.add_argument("--max-image-mpixels", type=positive_int, default=40,
                           metavar="MP", help="largest image /detect decodes, in megapixels "
                           "(default: %(default)s)")
    serve_cmd.add_argument("-q", "--quiet", action="store_true",
                           help="log warnings and errors only (no request log)")
    serve_cmd.set_defaults(run=_run_serve)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"'{text}' is not a TCP port (0-65535)")
    return port


def open_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: a free port). Raises ``OSError``
    naming the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Named TCP so that asyncio sets TCP_NODELAY on each accepted connection: with Nagle's
    # algorithm an answer written in two parts (head, body) waits for the client's delayed
    # ACK, 40 ms on Linux.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve(repository: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int = 8000,
          device: str = "cpu", max_body_bytes: int = 64 * 2**20,
          max_image_pixels: int = 40_000_000, quiet: bool = False) -> None:
    """Load ``repository`` on ``device`` and serve it on ``host``:``port`` until SIGTERM or
    SIGINT (the calling thread must be the main thread). Raises ``RepositoryError`` (or
    ``CfgError``/``WeightsError``) naming the file before listening, ``OSError`` when the
    address cannot be bound, ``DependencyError`` without the ``serve`` extra."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise DependencyError(f"serve needs starlette and uvicorn: {_INSTALL}") from exc
    from darknet_metal.serving.app import ServerLimits, create_app
    from darknet_metal.serving.metrics import ServingStats
    from darknet_metal.serving.repository import read_repository
    from darknet_metal.serving.served import load_models
    from darknet_metal.version import __version__

    if max_body_bytes < 1 or max_image_pixels < 1:
        raise ArgumentError("max_body_bytes and max_image_pixels must be positive")
    sources = read_repository(repository)
    stats = ServingStats(device)
    sock = open_socket(host, port)
    try:
        models = load_models(sources, device, stats, progress=_note)
    except BaseException:
        sock.close()
        raise
    app = create_app(models, stats, ServerLimits(max_body_bytes, max_image_pixels),
                     version=__version__)
    config = uvicorn.Config(app, log_level="warning" if quiet else "info",
                            timeout_graceful_shutdown=60, access_log=not quiet)
    server = uvicorn.Server(config)
    # In place before the address is announced: a SIGTERM that comes before uvicorn takes
    # its signals over asks it to stop as soon as it runs (it checks should_exit), and one
    # that uvicorn re-raises once it has shut down gracefully ends in exit status 0, as a
    # finished service should.
    previous = signal.signal(signal.SIGTERM,
                             lambda signum, frame: setattr(server, "should_exit", True))
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    _note(f"serving {', '.join(m.name for m in models.values())} on "
          f"http://{shown}:{bound_port} (demo page at /, metrics at /metrics)")
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        for model in models.values():  # when the lifespan did not run to its end
            model.close()


def _run_serve(args: argparse.Namespace) -> int:
    serve(args.repository, host=args.host, port=args.port, device=args.device,
          max_body_bytes=args.max_body_mb * 2**20,
          max_image_pixels=args.max_image_mpixels * 1_000_000, quiet=args.quiet)
    return 0


def _note(message: str) -> None:
    print(f"darknet-metal serve: {message}", file=sys.stderr, flush=True)
