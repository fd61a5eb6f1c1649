"""Cases of ``shaders/im2col.metal``: the columns of an image and their sum back into it
(col2im, bit for bit: each pixel adds its taps in the reference's order)."""

from __future__ import annotations

import numpy as np

from darknet_metal.cpu import im2col
from darknet_metal.diagnostics.kernel_cases.half import half_twin
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Exact,
    KernelCase,
    Step,
    nan_filled,
    normal,
)


def out_size(size: int, ksize: int, stride: int, pad: int, dilation: int) -> int:
    """A convolution's output height or width (``pad`` the layer's, in dilated pixels)."""
    return (size + 2 * pad * dilation - dilation * (ksize - 1) - 1) // stride + 1


def im2col_args(cg: int, h: int, w: int, ksize: int, sx: int, sy: int, pad: int, dil: int,
                oh: int, ow: int, accumulate: int = 1) -> dict[str, int]:
    """dm_im2col_args of im2col_fwd and col2im_bwd_f32: channels per group, the layer's pad
    (the kernels pad pad*dilation pixels); ``accumulate``: col2im adds into the image (1) or
    sets it (0)."""
    return {"channels": cg, "height": h, "width": w, "ksize": ksize, "stride_x": sx,
            "stride_y": sy, "pad": pad, "dilation": dil, "out_h": oh, "out_w": ow,
            "accumulate": accumulate}


def _im2col(c: int, h: int, w: int, ksize: int, sx: int, sy: int, pad: int,
            dil: int) -> KernelCase:
    oh, ow = out_size(h, ksize, sy, pad, dil), out_size(w, ksize, sx, pad, dil)

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, (c, h, w))
        want = im2col.im2col_forward(x, ksize, sx, sy, pad * dil, dil, oh, ow)
        return CaseData({"image": x, "col": nan_filled(want.shape)},
                        (Check("col", want, Exact()),))

    return KernelCase(
        f"im2col_fwd_f32-{c}x{h}x{w}-k{ksize}-s{sx}x{sy}-p{pad}-d{dil}",
        (Step("im2col_fwd_f32", im2col_args(c, h, w, ksize, sx, sy, pad, dil, oh, ow),
              {"spatial": oh * ow, "channels": c, "slices": 1}),), make)


def _col2im(n: int, c: int, h: int, w: int, ksize: int, sx: int, sy: int, pad: int, dil: int,
            groups: int, accumulate: int = 1) -> KernelCase:
    """col2im adding into a random image, or (``accumulate`` 0) setting an image of NaN: the
    old values are not read and every element is written, the uncovered ones with 0."""
    cg = c // groups
    oh, ow = out_size(h, ksize, sy, pad, dil), out_size(w, ksize, sx, pad, dil)

    def make(rng: np.random.Generator) -> CaseData:
        col = normal(rng, (n * groups, cg * ksize * ksize, oh * ow))
        image = normal(rng, (n, c, h, w)) if accumulate else nan_filled((n, c, h, w))
        want = image.copy() if accumulate else np.zeros_like(image)
        for b in range(n):
            for g in range(groups):
                im2col.col2im_add(col[b * groups + g], want[b, g * cg : (g + 1) * cg], ksize,
                                  sx, sy, pad * dil, dil, oh, ow)
        return CaseData({"col": col, "image": image}, (Check("image", want, Exact()),))

    return KernelCase(
        f"col2im_bwd_f32-{n}x{c}x{h}x{w}-k{ksize}-s{sx}x{sy}-p{pad}-d{dil}-g{groups}"
        + ("" if accumulate else "-set"),
        (Step("col2im_bwd_f32",
              im2col_args(cg, h, w, ksize, sx, sy, pad, dil, oh, ow, accumulate),
              {"spatial": h * w, "channels": cg, "slices": n * groups}),), make)


def _half_columns(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = a["image"].reshape(2, 5, 9, 11)
    return {"col": np.stack([im2col.im2col_forward(x[b], 3, 2, 2, 1, 1, 5, 6)
                             for b in range(2)])}


CASES: tuple[KernelCase, ...] = (
    *(_im2col(*case) for case in ((3, 13, 13, 3, 1, 1, 1, 1), (5, 7, 7, 3, 2, 2, 1, 1),
                                  (7, 7, 5, 3, 2, 1, 2, 2), (3, 1, 1, 3, 1, 1, 1, 1),
                                  (5, 13, 7, 1, 2, 3, 0, 1))),
    *(_col2im(*case) for case in (
        (2, 3, 13, 13, 3, 1, 1, 1, 1, 1),
        (1, 4, 7, 7, 3, 2, 2, 1, 1, 2),
        (1, 5, 9, 7, 3, 1, 2, 2, 2, 1),
        (2, 3, 7, 5, 2, 2, 1, 0, 1, 3),
        (1, 3, 1, 1, 3, 1, 1, 1, 1, 1),
        (1, 2, 8, 9, 5, 3, 2, 2, 1, 1),
        (1, 2, 6, 6, 1, 2, 2, 0, 1, 1),  # 1x1 stride 2: some pixels receive nothing
        (1, 3, 160, 160, 3, 1, 1, 1, 1, 1),  # 76800 image elements
        # Setting, as a delta's first writer does.
        (2, 3, 13, 13, 3, 1, 1, 1, 1, 1, 0),
        (1, 4, 7, 7, 3, 2, 2, 1, 1, 2, 0),
        (1, 2, 8, 9, 5, 3, 2, 2, 1, 1, 0),
        (1, 2, 6, 6, 1, 2, 2, 0, 1, 1, 0),
    )),
    half_twin("im2col_fwd", "2x5x9x11-k3-s2x2-p1",
              im2col_args(5, 9, 11, 3, 2, 2, 1, 1, 5, 6),
              {"spatial": 30, "channels": 5, "slices": 2}, _half_columns, exact=True),
)
