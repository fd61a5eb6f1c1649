"""The HTTP routes of ``darknet-metal serve``: an ASGI application (Starlette) speaking the
KServe v2 / Triton HTTP/REST protocol, plus ``/detect``, ``/metrics`` and the demo page.

Every error is answered as JSON ``{"error": "..."}`` naming the field: 400 for a bad request,
404 for an unknown model, version or route, 405 for a wrong method, 413 for a body or image
above the limits, 500 (logged) for anything unexpected — never by stopping the server. A body
that is not what the route reads (JSON for ``infer``, an image for ``/detect``) is described
by its length and first bytes. The ready routes answer 200 only for versions warmed up at
load (``served.warm_up``).
Request bodies are read in the event loop up to ``max_body_bytes``; decoding, checking and
encoding tensors and images run in worker threads, and networks in the batchers' threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from darknet_metal.errors import ImageError, ImageTooLargeError, RequestError
from darknet_metal.image_errors import decode_failure
from darknet_metal.inference.detector import Detector
from darknet_metal.inference.image import decode_image
from darknet_metal.serving.metrics import ServingStats
from darknet_metal.serving.model_config import config_json
from darknet_metal.serving.served import UNBATCHED_MAX_ROWS, ServedModel, ServedVersion
from darknet_metal.serving.tensors import (
    describe_body,
    image_format,
    infer_response,
    read_infer_request,
)

__all__ = ["ServerLimits", "create_app"]

log = logging.getLogger("darknet_metal.serve")

#: The protocol extensions answered (Triton's names).
EXTENSIONS = ["binary_tensor_data", "statistics", "model_repository"]


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what a request may make the server hold: ``max_body_bytes`` of body (after
    decompression) and ``max_image_pixels`` pixels in an image sent to ``/detect``."""

    max_body_bytes: int = 64 * 2**20
    max_image_pixels: int = 40_000_000


def create_app(models: dict[str, ServedModel], stats: ServingStats,
               limits: ServerLimits = ServerLimits(), *, version: str = "") -> Any:
    """The ASGI application serving ``models``. Its lifespan's end finishes what the
    batchers have queued and stops them."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.gzip import GZipMiddleware
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    state = {"ready": False}

    def find(request: Any) -> tuple[ServedModel, ServedVersion]:
        name = request.path_params["name"]
        model = models.get(name)
        if model is None:
            raise RequestError(f"unknown model '{name}' (served: {', '.join(sorted(models))})",
                               status=404)
        wanted = request.path_params.get("version")
        if wanted is None or wanted == "":
            return model, model.latest
        if not wanted.isdigit() or int(wanted) not in model.versions:
            raise RequestError(f"model '{name}' has no version '{wanted}' (served: "
                               f"{', '.join(map(str, sorted(model.versions)))})", status=404)
        return model, model.versions[int(wanted)]

    def answers_json(handler: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Any]:
        @functools.wraps(handler)
        async def wrapped(request: Any) -> Any:
            try:
                return await handler(request)
            except RequestError as exc:
                return JSONResponse({"error": str(exc)}, status_code=exc.status)
            except Exception as exc:
                log.exception("%s %s failed", request.method, request.url.path)
                return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"},
                                    status_code=500)
        return wrapped

    async def read_body(request: Any) -> bytes:
        limit = limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"the body is {declared} bytes; at most {limit}", status=413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(f"the body is more than {limit} bytes", status=413)
            chunks.append(chunk)
        body = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            return body
        if encoding not in ("gzip", "deflate"):
            raise RequestError(f"header Content-Encoding: '{encoding}' is not supported "
                               "(gzip, deflate)", status=415)
        return await asyncio.to_thread(_inflate, body, encoding, limit)

    # --- health and metadata ---------------------------------------------------------------

    @answers_json
    async def live(request: Any) -> Any:
        return Response(status_code=200)

    def is_ready(*versions: ServedVersion) -> bool:
        """Serving, and each of ``versions`` warmed up (so its first request is not the one
        that pays for building the network's executor)."""
        return state["ready"] and all(v.stats.warmed_up for v in versions)

    @answers_json
    async def ready(request: Any) -> Any:
        every = [v for m in models.values() for v in m.versions.values()]
        return Response(status_code=200 if is_ready(*every) else 400)

    @answers_json
    async def server_metadata(request: Any) -> Any:
        return JSONResponse({"name": "darknet-metal", "version": version,
                             "extensions": EXTENSIONS})

    @answers_json
    async def model_metadata(request: Any) -> Any:
        model, served = find(request)
        config = model.source.config
        batch = [-1] if config.max_batch_size > 0 else []
        return JSONResponse({
            "name": model.name,
            "versions": [str(v) for v in sorted(model.versions)],
            "platform": "darknet",
            "inputs": [{"name": t.name, "datatype": "FP32", "shape": batch + list(t.dims)}
                       for t in config.input],
            "outputs": [{"name": t.name, "datatype": "FP32", "shape": batch + list(t.dims)}
                        for t in config.output],
        })

    @answers_json
    async def model_ready(request: Any) -> Any:
        _, served = find(request)
        return Response(status_code=200 if is_ready(served) else 400)

    @answers_json
    async def model_config(request: Any) -> Any:
        model, _ = find(request)
        return JSONResponse(config_json(model.source.config))

    @answers_json
    async def model_stats(request: Any) -> Any:
        if "name" in request.path_params:
            model, served = find(request)
            chosen = ([served] if request.path_params.get("version")
                      else [model.versions[v] for v in sorted(model.versions)])
        else:
            chosen = [m.versions[v] for m in models.values() for v in sorted(m.versions)]
        return JSONResponse({"model_stats": [s.stats.statistics_json() for s in chosen]})

    @answers_json
    async def repository_index(request: Any) -> Any:
        return JSONResponse([{"name": m.name, "version": str(v), "state": "READY"}
                             for m in models.values() for v in sorted(m.versions)])

    @answers_json
    async def repository_control(request: Any) -> Any:
        raise RequestError("models are loaded when the server starts; loading and unloading "
                           "while it runs is not supported", status=400)

    @answers_json
    async def metrics(request: Any) -> Any:
        body = await asyncio.to_thread(stats.exposition)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- inference ---------------------------------------------------------------------------

    async def run_request(request: Any, served: ServedVersion,
                          prepare: Callable[[bytes], tuple[np.ndarray, Any]],
                          finish: Callable[[list[np.ndarray], Any], Any]) -> Any:
        """One request through its phases, timed and counted in the version's statistics:
        the body read, ``prepare(body) -> (x, context)`` and ``finish(outputs, context)`` in
        worker threads around the batcher."""
        arrival = time.monotonic_ns()
        try:
            body = await read_body(request)
            started = time.monotonic_ns()
            x, context = await asyncio.to_thread(prepare, body)
            input_ns = time.monotonic_ns() - started
            outs = await _run(served, x)
            started = time.monotonic_ns()
            answer = await asyncio.to_thread(finish, outs, context)
            output_ns = time.monotonic_ns() - started
        except RequestError:
            served.stats.record_request(False, time.monotonic_ns() - arrival)
            raise
        except Exception:
            served.stats.record_request(False, time.monotonic_ns() - arrival, reason="BACKEND")
            raise
        served.stats.record_request(True, time.monotonic_ns() - arrival, input_ns, output_ns)
        return answer

    @answers_json
    async def infer(request: Any) -> Any:
        model, served = find(request)
        header_length = request.headers.get("inference-header-content-length")

        def prepare(body: bytes) -> tuple[np.ndarray, Any]:
            wanted = read_infer_request(body, header_length,
                                        input_shape=served.network.input_shape,
                                        max_batch_size=model.source.max_batch_size,
                                        output_names=model.output_names,
                                        max_rows=UNBATCHED_MAX_ROWS)
            return wanted.x, wanted

        def finish(outs: list[np.ndarray], wanted: Any) -> tuple[bytes, dict[str, str]]:
            return infer_response(wanted, model.name, served.version,
                                  dict(zip(served.outputs, outs, strict=True)))

        answer, headers = await run_request(request, served, prepare, finish)
        return Response(answer, headers=headers)

    @answers_json
    async def detect(request: Any) -> Any:
        model, served = find(request)

        def prepare(body: bytes) -> tuple[np.ndarray, Any]:
            thresh, nms = (_query_unit(request, key, model.source.parameter(key), default)
                           for key, default in (("thresh", 0.25), ("nms", 0.45)))
            if not body:
                raise RequestError("the body is empty: send an image file's bytes (JPEG, PNG)")
            detector = Detector(served.network, thresh, nms)
            prepared = _prepare_image(detector, body, limits.max_image_pixels, model.name)
            return prepared.x[None], (detector, prepared)

        def finish(outs: list[np.ndarray], context: Any) -> dict[str, Any]:
            detector, prepared = context
            found = detector.detections([out[0] for out in outs], prepared.width,
                                        prepared.height)
            return {
                "model_name": model.name, "model_version": str(served.version),
                "width": prepared.width, "height": prepared.height,
                "detections": [{"class_id": d.class_id, "name": d.name,
                                "confidence": d.confidence, "objectness": d.objectness,
                                "left": d.left, "top": d.top, "width": d.width,
                                "height": d.height} for d in found],
            }

        return JSONResponse(await run_request(request, served, prepare, finish))

    async def demo_page(request: Any) -> Any:
        page = resources.files("darknet_metal.serving").joinpath("demo.html").read_text()
        return HTMLResponse(page)

    async def http_error(request: Any, exc: Any) -> Any:
        return JSONResponse({"error": f"{exc.detail}: {request.method} {request.url.path}"},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state["ready"] = True
        try:
            yield
        finally:
            state["ready"] = False
            for model in models.values():
                await asyncio.to_thread(model.close)

    model_routes = []
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        model_routes += [
            Route(prefix, model_metadata),
            Route(prefix + "/ready", model_ready),
            Route(prefix + "/config", model_config),
            Route(prefix + "/stats", model_stats),
            Route(prefix + "/infer", infer, methods=["POST"]),
            Route(prefix + "/detect", detect, methods=["POST"]),
        ]
    routes = [
        Route("/", demo_page),
        Route("/v2", server_metadata),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2/models/stats", model_stats),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        Route("/v2/repository/models/{name}/load", repository_control, methods=["POST"]),
        Route("/v2/repository/models/{name}/unload", repository_control, methods=["POST"]),
        Route("/metrics", metrics),
        *model_routes,
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error},
                     middleware=[Middleware(GZipMiddleware, minimum_size=1024,
                                            compresslevel=1)])


async def _run(served: ServedVersion, x: np.ndarray) -> list[np.ndarray]:
    """``x`` through the version's batcher; its outputs' rows for ``x``."""
    try:
        future = served.batcher.submit(x)
    except Exception as exc:  # closed: the server is stopping
        raise RequestError(str(exc), status=503) from exc
    return await asyncio.wrap_future(future)


def _prepare_image(detector: Detector, body: bytes, max_pixels: int, model: str) -> Any:
    """``body`` decoded and letterboxed for ``detector``; a ``RequestError`` (400, or 413 for
    an image above ``max_pixels``) saying what the body was when it is not an image."""
    try:
        rgb = decode_image(body, "the request's image", max_pixels)
    except ImageTooLargeError as exc:
        raise RequestError(str(exc), status=413) from exc
    except ImageError as exc:
        raise RequestError(_not_an_image(body, exc, model)) from exc
    return detector.prepare(rgb)


def _not_an_image(body: bytes, exc: ImageError, model: str) -> str:
    """The message for a ``/detect`` body that does not decode: its length and first bytes,
    and why. Pillow's own messages name the file object it read (``cannot identify image
    file <_io.BytesIO object at 0x...>``), which tells a client nothing, so its reason is
    restated in terms of the bytes received."""
    from PIL import UnidentifiedImageError

    what = describe_body(body)
    found = image_format(body)
    send = "; send the bytes of a JPEG, PNG or other image file"
    cause = exc.__cause__
    if cause is None:  # decoded, then refused (an empty image, 32-bit float pixels)
        reason = str(exc).removeprefix("the request's image: ")
        return f"{what} is an image this server cannot use: {reason}"
    if not isinstance(cause, UnidentifiedImageError):
        start = f"it starts as a {found} file, but " if found else ""
        reason = f"{start}decoding fails ({decode_failure(cause)})"
    elif found:
        reason = f"it starts as a {found} file, but its header is cut short or corrupt"
    elif body.lstrip()[:1] in (b"{", b"["):
        return (f"{what} is not an image: it looks like JSON, and inference requests go to "
                f"/v2/models/{model}/infer")
    else:
        reason = "its first bytes match no image format Pillow reads"
    return f"{what} is not an image Pillow can decode: {reason}{send}"


def _query_unit(request: Any, key: str, configured: str | None, default: float) -> float:
    """Query parameter ``key`` in [0, 1], else the config's value, else ``default``."""
    text = request.query_params.get(key)
    if text is None:
        return float(configured) if configured is not None else default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise RequestError(f"query parameter {key}: '{text}' is not a number in [0, 1]")
    return value


def _inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` decompressed, refusing more than ``limit`` bytes out (a small body can
    inflate to gigabytes)."""
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise RequestError(f"the body is not {encoding} data ({exc})") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise RequestError(f"the body inflates to more than {limit} bytes", status=413)
    if not inflater.eof:
        raise RequestError(f"the {encoding} body is truncated")
    return out

