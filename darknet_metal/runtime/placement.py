"""Where a layer runs on a device: its kernels, an alias of its input, or a CPU fallback."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerPlacement"]


@dataclass(frozen=True)
class LayerPlacement:
    """Where a layer runs: ``where`` is "kernels", "fallback" or "alias" (an identity layer whose
    output is its input's buffer); ``kernels`` the kernels it dispatches; ``reason`` why it
    falls back (None otherwise)."""

    index: int
    kind: str
    where: str
    kernels: tuple[str, ...] = ()
    reason: str | None = None
