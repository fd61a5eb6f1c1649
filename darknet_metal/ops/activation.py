"""A layer's ``activation=`` key, shared by the ops that have one.

Elementwise activations are fused into a convolution's or connected layer's GEMM epilogue;
the channel-mixing ones (``normalize_channels*``) run after the layer's main work, as do all
activations of the combining layers (shortcut, scale_channels, sam), whose kernels do not
fuse them.
"""

from __future__ import annotations

import numpy as np

from darknet_metal.cpu import activation as cpu_activation
from darknet_metal.cpu import fill as cpu_fill
from darknet_metal.cpu.step import NativeStep
from darknet_metal.model.activations import ACTIVATION_ID, ACTIVATIONS, CHANNEL_ACTIVATIONS
from darknet_metal.runtime.program import LayerEmitter, Tensor

LINEAR = ACTIVATION_ID["linear"]


def is_channel_activation(act: int) -> bool:
    """Whether activation id ``act`` mixes the channels of a pixel."""
    return ACTIVATIONS[act] in CHANNEL_ACTIVATIONS


def fused_activation(act: int) -> int:
    """The activation a fusing kernel applies: ``act``, or linear when it must run after."""
    return LINEAR if is_channel_activation(act) else act


def activation_steps_after(out: np.ndarray, act: int, fused: bool) -> list[NativeStep]:
    """The CPU step applying ``act`` to ``out`` in place, unless the layer's own kernel did
    (``fused`` and elementwise) or it is linear."""
    if act != LINEAR and (not fused or is_channel_activation(act)):
        return [cpu_activation.activate_step(out, act)]
    return []



def emit_activation_after(e: LayerEmitter, act: int, fused: bool) -> None:
    """The device step applying ``act`` to the layer's output in place, when one is needed
    (same rule as ``activation_steps_after``)."""
    if act == LINEAR or (fused and not is_channel_activation(act)):
        return
    n, c, h, w = e.shape(e.output)
    out = e.output
    if is_channel_activation(act):
        e.kernel(
            f"{ACTIVATIONS[act]}_fwd_f32",
            {"x": out, "y": out},
            {"spatial": h * w, "batch": n},
            batch=n,
            channels=c,
            spatial=h * w,
        )
    else:
        total = n * c * h * w
        e.kernel("activation_fwd_f32", {"x": out, "y": out}, {"n": total}, n=total, act=act)


#: Activations whose derivative Darknet takes from the activation's input (it keeps
#: ``activation_input`` for them); the others take it from the output.
INPUT_GRADIENT = frozenset(ACTIVATION_ID[n] for n in ("gelu", "mish", "swish", "hard_mish"))


def activation_input(e: LayerEmitter, act: int) -> Tensor:
    """Training forward: where a layer's kernel writes its values before ``act``: a kept
    copy for activations differentiated from their input, else the output itself."""
    if act in INPUT_GRADIENT:
        return e.tensor("activation_input", e.shape(e.output))
    return e.output


def emit_cpu_activation_train(e: LayerEmitter, act: int, pre: Tensor) -> None:
    """Training forward: ``output = act(pre)`` with Darknet's scalar functions (``pre`` from
    ``activation_input``)."""
    if pre != e.output:
        e.host([pre], [e.output], lambda r, w: [cpu_fill.copy_step(r[0], w[0]),
                                                cpu_activation.activate_step(w[0], act)])
    elif act != LINEAR:
        e.host([e.output], [e.output], lambda r, w: [cpu_activation.activate_step(w[0], act)])


def emit_cpu_activation_gradient(e: LayerEmitter, act: int, pre: Tensor) -> None:
    """Backward: ``delta *= act'``, from ``pre`` or the output as Darknet takes it."""
    if act == LINEAR:
        return
    source = pre if act in INPUT_GRADIENT else e.output
    e.host([source, e.delta], [e.delta],
           lambda r, w: [cpu_activation.activation_gradient_step(r[0], w[0], act)])


def emit_device_activation_train(e: LayerEmitter, act: int, pre: Tensor) -> None:
    """``emit_cpu_activation_train`` with kernels: ``output = act(pre)``."""
    if pre == e.output and act == LINEAR:
        return
    if is_channel_activation(act):
        emit_activation_after(e, act, fused=False)  # pre is the output for these
        return
    total = int(np.prod(e.shape(e.output)))
    e.kernel("activation_fwd_f32", {"x": pre, "y": e.output}, {"n": total}, n=total, act=act)


def emit_device_activation_gradient(e: LayerEmitter, act: int, pre: Tensor) -> None:
    """``emit_cpu_activation_gradient`` with kernels: ``delta *= act'``."""
    if act == LINEAR:
        return
    n, c, h, w = e.shape(e.output)
    if is_channel_activation(act):
        e.kernel(f"{ACTIVATIONS[act]}_bwd_f32", {"y": e.output, "delta": e.delta},
                 {"spatial": h * w, "batch": n}, batch=n, channels=c, spatial=h * w)
        return
    total = n * c * h * w
    e.kernel("activation_bwd_f32", {"y_or_x": pre if act in INPUT_GRADIENT else e.output,
                                    "delta": e.delta}, {"n": total}, n=total, act=act)
