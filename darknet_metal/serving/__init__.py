"""Serving detectors over Triton's (KServe v2) HTTP/REST inference protocol.

``darknet-metal serve MODEL_REPOSITORY`` serves every model of a repository in Triton's
layout (``<repo>/<model>/config.pbtxt`` and ``<repo>/<model>/<version>/`` holding the
``.cfg``, ``.weights`` and ``.names``). The parts, one concept per module:

- ``model_config``: Triton's ``ModelConfig`` message, parsed from ``config.pbtxt``;
- ``repository``: the repository read and checked, each config completed from its ``.cfg``;
- ``batcher``: one model version's network instances behind a dynamic-batching queue;
- ``tensors``: inference requests and responses (JSON tensors, the binary data extension);
- ``metrics``: counters in Prometheus' text format under Triton's metric names;
- ``app``: the HTTP routes (an ASGI application on Starlette);
- ``server``: the command and its process (uvicorn, graceful SIGTERM).

Needs the ``serve`` extra: ``pip install "darknet-metal[serve]"``.

Owns: the server and its protocol. May import anything below it: ``network``, ``inference``,
``model``, ``metal`` (device statistics), ``errors``.
"""
