"""Kernels of ``shaders/gemm.metal``: ``c = act(op(A)·op(B) + bias + beta*c)`` over slices, in
threadgroup tiles or with ``simdgroup_matrix``, and the epilogue of a product split along K."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Binding, Grid, Kernel
from darknet_metal.metal.kernels.shorthand import ELEMENTS, equals, read, write

SOURCE = "gemm.metal"

#: dm_gemm_args.bias_mode values.
BIAS_NONE, BIAS_ROWS, BIAS_COLS = 0, 1, 2

#: The transpositions of (A, B) the kernels exist for.
TRANSPOSITIONS = ("nn", "nt", "tn")

#: The output tile per threadgroup of both GEMM kernels (rows of C, columns of C).
GEMM_TILE = (64, 64)
_TILED = Grid(("N", "M", "slices"), (16, 8, 1), (GEMM_TILE[1], GEMM_TILE[0], 1))
_SIMD = Grid(("N", "M", "slices"), (128, 1, 1), (GEMM_TILE[1], GEMM_TILE[0], 1))


def gemm_kernel(trans: str, simd: bool) -> str:
    """The float32 GEMM kernel's name for ``trans`` ("nn", "nt", "tn"): ``simdgroup_matrix``
    (``simd``) or threadgroup tiles."""
    return f"gemm_{trans}{'_simd' if simd else ''}_f32"


def _slice_offset(operand: str) -> str:
    """Largest offset zb*<operand>_batch_stride + zg*<operand>_group_stride over the GEMM's
    slices z < slices, (zb, zg) = (z // groups, z % groups). With all strides unsigned it is
    the last slice, or the last group of the previous image when the last image is partial."""
    last = "(slices - 1) // groups"
    batch, group = f"{operand}_batch_stride", f"{operand}_group_stride"
    return (
        f"max(({last})*{batch} + (slices - 1 - ({last})*groups)*{group}, "
        f"min({last}, 1)*(({last} - 1)*{batch} + (groups - 1)*{group}))"
    )


def _gemm(trans: str, simd: bool) -> Kernel:
    # op(A)[r, k] is a[r*lda + k], or a[k*lda + r] stored transposed; likewise op(B)[k, n].
    a_span = "(K - 1)*lda + M" if trans[0] == "t" else "(M - 1)*lda + K"
    b_span = "(N - 1)*ldb + K" if trans[1] == "t" else "(K - 1)*ldb + N"
    # The epilogue adds bias[zg*bias_group_stride + r] (rows) or [... + n] (columns).
    bias = (
        f"min(M, N, 1)*((min(groups, slices) - 1)*bias_group_stride "
        f"+ {equals('bias_mode', BIAS_ROWS)}*M + {equals('bias_mode', BIAS_COLS)}*N)"
    )
    return Kernel(
        name=gemm_kernel(trans, simd),
        source=SOURCE,
        args="dm_gemm_args",
        bindings=(
            # Loads are guarded by r < M, k < K and n < N: an empty operand is not read.
            read("a", f"min(M, K, 1)*({_slice_offset('a')} + {a_span})"),
            read("b", f"min(K, N, 1)*({_slice_offset('b')} + {b_span})"),
            read("bias", bias, used_if="bias_mode"),
            # Read (beta != 0) and written in place: one thread per element does both.
            Binding("inout", "c", f"min(M, N, 1)*({_slice_offset('c')} + (M - 1)*ldc + N)",
                    read_if="beta"),
        ),
        grid=_SIMD if simd else _TILED,
        requires="simdgroup_matrix" if simd else "",
        flops="2*M*N*K*slices",
    )


#: The epilogue of a product split along K: the slots added, the bias, the activation.
GEMM_SPLITS_FWD = Kernel(
    name="gemm_splits_fwd_f32",
    source=SOURCE,
    args="dm_gemm_splits_args",
    bindings=(
        read("part", "images*splits*per_image"),
        read("bias", "min(per_image, 1)*((per_image - 1)//spatial + 1)",
             used_if=equals("bias_mode", BIAS_ROWS)),
        write("c", "images*per_image"),
    ),
    grid=ELEMENTS,
    flops="images*splits*per_image",
)

KERNELS: tuple[Kernel, ...] = (
    *(_gemm(trans, simd) for simd in (False, True) for trans in TRANSPOSITIONS),
    GEMM_SPLITS_FWD,
)

# The half GEMMs serve inference only, which never multiplies by a transposed A.
HALF_TWINS = tuple(gemm_kernel(trans, simd) for simd in (False, True) for trans in ("nn", "nt"))
