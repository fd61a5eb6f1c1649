"""Cases of ``shaders/gemm.metal``: every GEMM, tiled and simdgroup_matrix, against float64
NumPy products, at sizes no tile divides: the bias by rows and by columns, the activation in
the epilogue, ``beta * c`` accumulated (and never read with beta 0), batch and group slices,
a leading dimension wider than the matrix (its pad left alone), the plain product's
store-only epilogue, the half twins, and a product split along K with its epilogue."""

from __future__ import annotations

import numpy as np

from darknet_metal.diagnostics.kernel_cases.activation import activated
from darknet_metal.diagnostics.kernel_cases.half import near_half
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Close,
    Exact,
    KernelCase,
    Step,
    nan_filled,
    normal,
)
from darknet_metal.metal.dispatch import BIAS_COLS, BIAS_NONE, BIAS_ROWS, gemm_args
from darknet_metal.model.activations import ACTIVATION_ID

GEMMS = ("gemm_nn_f32", "gemm_nn_simd_f32", "gemm_nt_f32", "gemm_nt_simd_f32", "gemm_tn_f32",
         "gemm_tn_simd_f32")


def operands(rng: np.random.Generator, name: str, m: int, n: int,
             k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """op(A) (m x k) and op(B) (k x n), and A and B as kernel ``name`` reads them."""
    trans = name.split("_")[1]
    a_op, b_op = normal(rng, (m, k)), normal(rng, (k, n))
    a = np.ascontiguousarray(a_op.T) if trans[0] == "t" else a_op
    b = np.ascontiguousarray(b_op.T) if trans[1] == "t" else b_op
    return a_op, b_op, a, b


def _leading(name: str, m: int, n: int, k: int) -> tuple[int, int]:
    trans = name.split("_")[1]
    return (m if trans[0] == "t" else k), (k if trans[1] == "t" else n)


def _product(a_op: np.ndarray, b_op: np.ndarray) -> np.ndarray:
    return a_op.astype(np.float64) @ b_op.astype(np.float64)


def _accumulating(name: str, m: int, n: int, k: int, *, beta: float, pad: int,
                  held: float | None = None) -> KernelCase:
    """c = leaky(op(A) @ op(B) + bias + beta * c) with ``pad`` columns past N (ldc > N) that
    must keep what they held; c holds ``held`` everywhere, or random values."""
    lda, ldb = _leading(name, m, n, k)
    args, sizes = gemm_args(M=m, N=n, K=k, lda=lda, ldb=ldb, ldc=n + pad, bias_mode=BIAS_ROWS,
                            act=ACTIVATION_ID["leaky"], beta=beta)

    def make(rng: np.random.Generator) -> CaseData:
        a_op, b_op, a, b = operands(rng, name, m, n, k)
        bias = normal(rng, m)
        c = normal(rng, (m, n + pad)) if held is None else np.full((m, n + pad), held,
                                                                   np.float32)
        ref = _product(a_op, b_op) + bias[:, None] + beta * c[:, :n].astype(np.float64)
        want = activated(ref.astype(np.float32), "leaky")
        return CaseData({"a": a, "b": b, "bias": bias, "c": c},
                        (Check("c", want, Close(1e-4, 1e-4 * np.sqrt(k)), np.s_[:, :n]),
                         Check("c", c[:, n:], Exact(), np.s_[:, n:])))

    return KernelCase(f"{name}-{m}x{n}x{k}-beta{beta:g}-ldc+{pad}", (Step(name, args, sizes),),
                      make)


def _beta_zero_never_reads_c(name: str) -> KernelCase:
    """An uninitialised output (NaN and infinities) cannot leak into beta = 0 results."""
    m, n, k = 19, 35, 9
    lda, ldb = _leading(name, m, n, k)
    args, sizes = gemm_args(M=m, N=n, K=k, lda=lda, ldb=ldb, ldc=n, bias_mode=BIAS_NONE, act=0)

    def make(rng: np.random.Generator) -> CaseData:
        a_op, b_op, a, b = operands(rng, name, m, n, k)
        c = nan_filled((m, n))
        c[::3] = np.inf
        return CaseData({"a": a, "b": b, "c": c},
                        (Check("c", _product(a_op, b_op), Close(1e-5, 1e-5)),))

    return KernelCase(f"{name}-{m}x{n}x{k}-beta0-c_unread",
                      (Step(name, args, sizes, {"a": "a", "b": "b", "bias": None, "c": "c"}),),
                      make)


def _plain(name: str) -> KernelCase:
    """The plain product (no bias, beta 0, linear: the kernels' store-only epilogue) over two
    slices, at sizes with whole 64x64 tiles (loaded and stored without guards) beside edge
    tiles, and a K whose last step is partial; ldc wider than N, its pad left alone."""
    slices, m, n, k, pad = 2, 130, 136, 40, 5
    lda, ldb = _leading(name, m, n, k)
    args, sizes = gemm_args(M=m, N=n, K=k, lda=lda, ldb=ldb, ldc=n + pad, bias_mode=BIAS_NONE,
                            act=0, slices=slices, a_batch_stride=m * k, b_batch_stride=k * n,
                            c_batch_stride=m * (n + pad))

    def make(rng: np.random.Generator) -> CaseData:
        pairs = [operands(rng, name, m, n, k) for _ in range(slices)]
        c = nan_filled((slices, m, n + pad))
        c[:, :, n:] = 7.0
        want = np.stack([_product(a_op, b_op) for a_op, b_op, _, _ in pairs])
        return CaseData({"a": np.stack([a for _, _, a, _ in pairs]),
                         "b": np.stack([b for _, _, _, b in pairs]), "c": c},
                        (Check("c", want, Close(1e-5, 1e-5 * np.sqrt(k)), np.s_[:, :, :n]),
                         Check("c", c[:, :, n:], Exact(), np.s_[:, :, n:])))

    return KernelCase(f"{name}-{slices}x{m}x{n}x{k}-plain-ldc+{pad}",
                      (Step(name, args, sizes, {"a": "a", "b": "b", "bias": None, "c": "c"}),),
                      make)


def _sliced(name: str, *, accumulate: bool) -> KernelCase:
    """Slice z = image * groups + group offsets A by group, B and C by image and group: with
    a per-group bias and logistic, or (``accumulate``) beta 1 reading C through the same
    offsets as the write."""
    batch, groups, m, n, k = 2, 3, 5, 11, 7
    args, sizes = gemm_args(
        M=m, N=n, K=k, lda=k, ldb=n, ldc=n, groups=groups, slices=batch * groups,
        bias_mode=BIAS_NONE if accumulate else BIAS_ROWS,
        act=0 if accumulate else ACTIVATION_ID["logistic"], beta=1.0 if accumulate else 0.0,
        a_group_stride=m * k, b_batch_stride=groups * k * n, b_group_stride=k * n,
        c_batch_stride=groups * m * n, c_group_stride=m * n,
        bias_group_stride=0 if accumulate else m)

    def make(rng: np.random.Generator) -> CaseData:
        a, b = normal(rng, (groups, m, k)), normal(rng, (batch, groups, k, n))
        product = np.einsum("gmk,bgkn->bgmn", a.astype(np.float64), b.astype(np.float64))
        if accumulate:
            c = normal(rng, (batch, groups, m, n))
            return CaseData({"a": a, "b": b, "c": c},
                            (Check("c", product + c, Close(1e-5, 1e-5)),))
        bias = normal(rng, (groups, m))
        want = 1.0 / (1.0 + np.exp(-(product + bias[None, :, :, None])))
        return CaseData({"a": a, "b": b, "bias": bias, "c": nan_filled((batch, groups, m, n))},
                        (Check("c", want, Close(1e-5, 1e-6)),))

    buffers = {"a": "a", "b": "b", "bias": None if accumulate else "bias", "c": "c"}
    detail = "beta1" if accumulate else "bias-logistic"
    return KernelCase(f"{name}-{batch}x{groups}x{m}x{n}x{k}-slices-{detail}",
                      (Step(name, args, sizes, buffers),), make)


def _bias_per_column(name: str) -> KernelCase:
    m, n, k = 3, 37, 19
    args, sizes = gemm_args(M=m, N=n, K=k, lda=k, ldb=k, ldc=n, bias_mode=BIAS_COLS, act=0)

    def make(rng: np.random.Generator) -> CaseData:
        a, b, bias = normal(rng, (m, k)), normal(rng, (n, k)), normal(rng, n)
        want = _product(a, b.T) + bias[None, :]
        return CaseData({"a": a, "b": b, "bias": bias, "c": nan_filled((m, n))},
                        (Check("c", want, Close(1e-5, 1e-5)),))

    return KernelCase(f"{name}-{m}x{n}x{k}-bias_cols", (Step(name, args, sizes),), make)


def _sum_splits(per_image: int, images: int, splits: int, spatial: int, *, bias: bool,
                act: str) -> KernelCase:
    """c = act(the slots of each image added + a bias per row) against float64."""
    args = dict(per_image=per_image, images=images, splits=splits, spatial=spatial,
                bias_mode=BIAS_ROWS if bias else BIAS_NONE, act=ACTIVATION_ID[act])

    def make(rng: np.random.Generator) -> CaseData:
        part = normal(rng, (images, splits, per_image), 3.0)
        b = normal(rng, -(-per_image // spatial))
        total = part.astype(np.float64).sum(axis=1)
        if bias:
            total += np.repeat(b.astype(np.float64), spatial)[:per_image]
        want = activated(total.astype(np.float32), act)
        arrays = {"part": part, "c": nan_filled((images, per_image))}
        if bias:
            arrays["bias"] = b
        return CaseData(arrays, (Check("c", want, Close(1e-5, 1e-5)),))

    buffers = {"part": "part", "bias": "bias" if bias else None, "c": "c"}
    return KernelCase(
        f"gemm_splits_fwd_f32-{images}x{splits}x{per_image}-{'bias-' if bias else ''}{act}",
        (Step("gemm_splits_fwd_f32", args, {"n": images * per_image}, buffers),), make)


def _split_forward(name: str, m: int, n: int, k: int, images: int, run: int) -> KernelCase:
    """A convolution's forward split along K as a late layer at a small batch runs it: slice
    z of a GEMM is image z // runs, run z % runs, into slot z of the partial sums (the last,
    shorter run a GEMM of its own), then the slots added with the bias and leaky; against
    the float64 product of the whole K."""
    whole, rest = divmod(k, run)
    splits = whole + (rest > 0)
    steps = []
    for at, runs, length in ((0, whole, run), (whole, int(rest > 0), rest)):
        if runs == 0:
            continue
        args, sizes = gemm_args(M=m, N=n, K=length, lda=k, ldb=n, ldc=n, groups=runs,
                                slices=images * runs, a_group_stride=run,
                                b_batch_stride=k * n, b_group_stride=run * n,
                                c_batch_stride=splits * m * n, c_group_stride=m * n,
                                bias_mode=BIAS_NONE, act=0)
        steps.append(Step(name, args, sizes, {"a": "a", "b": "b", "bias": None, "c": "part"},
                          {"a": at * run, "b": at * run * n, "c": at * m * n}))
    steps.append(Step("gemm_splits_fwd_f32",
                      dict(per_image=m * n, images=images, splits=splits, spatial=n,
                           bias_mode=BIAS_ROWS, act=ACTIVATION_ID["leaky"]),
                      {"n": images * m * n}, {"part": "part", "bias": "bias", "c": "c"}))

    def make(rng: np.random.Generator) -> CaseData:
        a, b, bias = normal(rng, (m, k)), normal(rng, (images, k, n)), normal(rng, m)
        exact = np.einsum("mk,ikn->imn", a.astype(np.float64), b.astype(np.float64))
        exact += bias.astype(np.float64)[None, :, None]
        want = np.where(exact > 0, exact, 0.1 * exact)
        return CaseData({"a": a, "b": b, "bias": bias,
                         "part": nan_filled((images * splits * m * n,)),
                         "c": nan_filled((images, m, n))},
                        (Check("c", want, Close(1e-4, 1e-4 * np.sqrt(k))),))

    return KernelCase(f"{name}-split_k-{images}x{m}x{n}x{k}-run{run}", tuple(steps), make)


def _half(variant: str) -> KernelCase:
    """Two slices of leaky(A @ op(B) + bias) in half storage against float64."""
    m, n, k, slices = 37, 45, 70, 2
    nt = "_nt" in variant
    args, sizes = gemm_args(M=m, N=n, K=k, lda=k, ldb=k if nt else n, ldc=n, slices=slices,
                            bias_mode=BIAS_ROWS, act=ACTIVATION_ID["leaky"], a_batch_stride=m * k,
                            b_batch_stride=n * k, c_batch_stride=m * n)

    def make(rng: np.random.Generator) -> CaseData:
        a = normal(rng, (slices, m, k), 0.3).astype(np.float16)
        b = normal(rng, (slices, n, k) if nt else (slices, k, n)).astype(np.float16)
        bias = normal(rng, m).astype(np.float16)
        bb = b.astype(np.float64).transpose(0, 2, 1) if nt else b.astype(np.float64)
        exact = a.astype(np.float64) @ bb + bias.astype(np.float64)[None, :, None]
        exact = np.where(exact > 0, exact, 0.1 * exact)
        # The float sum of 70 products adds ~70 float ulps at most: far below half's.
        return CaseData({"a": a, "b": b, "bias": bias, "c": nan_filled((slices, m, n),
                                                                       np.float16)},
                        (Check("c", exact, near_half(exact)),))

    return KernelCase(f"{variant}_f16-{slices}x{m}x{n}x{k}",
                      (Step(f"{variant}_f16", args, sizes),), make)


CASES: tuple[KernelCase, ...] = (
    *(_accumulating(name, m, n, k, beta=0.0, pad=3, held=55.0) for name in GEMMS
      for m, n, k in ((17, 33, 29), (1, 1, 1), (32, 32, 16), (40, 7, 70))),
    # Sizes not multiples of the tiles (64x64x16 and 32x32x16; past two of them).
    *(_accumulating(name, m, n, k, beta=beta, pad=2) for name in GEMMS
      for beta in (0.0, 1.0, 0.5) for m, n, k in ((37, 45, 21), (5, 3, 70), (33, 1, 17),
                                                  (65, 130, 47), (64, 64, 16), (130, 70, 33))),
    *(_beta_zero_never_reads_c(name) for name in GEMMS),
    *(_plain(name) for name in GEMMS),
    *(_sliced(name, accumulate=acc) for name in ("gemm_nn_f32", "gemm_nn_simd_f32")
      for acc in (True, False)),
    *(_bias_per_column(name) for name in ("gemm_nt_f32", "gemm_nt_simd_f32")),
    *(_half(variant) for variant in ("gemm_nn", "gemm_nt", "gemm_nn_simd", "gemm_nt_simd")),
    _sum_splits(7, 1, 1, 7, bias=False, act="linear"),
    _sum_splits(3 * 29, 2, 5, 29, bias=True, act="leaky"),
    _sum_splits(1000, 3, 18, 13, bias=True, act="mish"),
    _sum_splits(512, 1, 2, 169, bias=False, act="logistic"),
    *(_split_forward(name, 70, 37, 600, 2, 256) for name in ("gemm_nn_f32", "gemm_nn_simd_f32")),
    _split_forward("gemm_nn_f32", 5, 3, 512, 1, 256),
)
