# cython: language_level=3
"""3x3, stride-1, pad-1 convolution by Winograd's minimal filtering: F(2x2, 3x3) and F(4x4, 3x3).

Each m x m output tile (``tile`` m = 2 or 4) comes from an (m+2) x (m+2) input tile:
``Y = A^T [sum_c (G g G^T) . (B^T d B)] A``. The channel sum at each of the (m+2)^2 transformed
positions is a GEMM, so the convolution costs (m+2)^2 GEMMs of (F x C) @ (C x tiles) instead of
one of (F x 9C) @ (9C x H*W): 2.25x fewer multiply-adds with F(2x2, 3x3), 4x with F(4x4, 3x3),
for the same result up to rounding. F(2x2)'s transforms only add, subtract and halve; F(4x4)'s
(points 0, +-1, +-2) also scale by 2, 4, 5 and 8 and its filter transform by 1/4, 1/6, 1/12 and
1/24, so its float32 rounding is a few times F(2x2)'s (the bounds are in the tests); in return
its transforms touch (m+2)^2/m^2 = 2.25 values an output where F(2x2)'s touch 4.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64 arrays of
one dtype, checked by ``checks``. The float32 transforms run in ``kernels.h``, the float64
ones in the scalar cdef functions here; both, like the GEMMs (``blas.gemm_rowmajor``), are
``noexcept nogil``. ``winograd_step`` checks its arguments and returns the ``NativeStep``
that runs a whole layer without the GIL.
"""

from cython cimport floating

from darknet_metal.cpu.activation cimport ACT_COUNT, activate_array
from darknet_metal.cpu.blas cimport cpu_threads, gemm_rowmajor_batch, part_fn, run_parts
from darknet_metal.cpu.kernels cimport (
    DM_ACT_LINEAR,
    DM_GEMM8_M,
    dm_gemm8_f32,
    dm_pack8_f32,
    dm_pack8_size,
    dm_wino2_input_f32,
    dm_wino2_output_f32,
    dm_wino4_input_f32,
    dm_wino4_output_f32,
)
from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input, check_workspace

#: The output tile sizes m of F(m x m, 3x3) there are transforms for.
TILES = (2, 4)

# G for F(2x2, 3x3) and F(4x4, 3x3): the filter transform U = G g G^T.
_G = {
    2: np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]]),
    4: np.array([[6.0, 0.0, 0.0], [-4.0, -4.0, -4.0], [-4.0, 4.0, -4.0], [1.0, 2.0, 4.0],
                 [1.0, -2.0, 4.0], [0.0, 0.0, 24.0]]) / 24.0,
}


def _check_tile(int tile) -> int:
    if tile not in TILES:
        raise ArgumentError(f"winograd: tile={tile}, expected one of {TILES}")
    return tile


def transform_filters(weights: np.ndarray, channels: int, tile: int = 2) -> np.ndarray:
    """Darknet weights (F, C*3*3) -> the Winograd filters of F(tile x tile, 3x3), computed in
    float64, in the layout ``winograd_step`` takes for their dtype: float64 ((tile+2)^2, F,
    C); float32 ((tile+2)^2, ``packed_size(F, C)``), each position's (F, C) matrix packed for
    ``kernels.h``'s ``dm_gemm8_f32`` (the GEMMs then read the transformed input in place)."""
    g_t = _G[_check_tile(tile)]
    f = weights.shape[0]
    g = np.asarray(weights, np.float64).reshape(f, channels, 3, 3)
    u = np.einsum("ik,fckl,jl->ijfc", g_t, g, g_t)
    u = np.ascontiguousarray(u.reshape((tile + 2) ** 2, f, channels), dtype=weights.dtype)
    if u.dtype != np.float32:
        return u
    packed = np.empty(((tile + 2) ** 2, dm_pack8_size(f, channels)), np.float32)
    cdef float[:, :, ::1] src = u
    cdef float[:, ::1] dst = packed
    cdef Py_ssize_t i
    if f and channels:
        for i in range(u.shape[0]):
            dm_pack8_f32(&src[i, 0, 0], f, channels, &dst[i, 0])
    return packed


def packed_size(int filters, int channels) -> int:
    """Floats of one position's packed float32 Winograd filters."""
    return dm_pack8_size(filters, channels)


def workspace_size(int channels, int filters, int height, int width, int tile=2) -> int:
    """Elements of workspace ``winograd_forward`` needs: transformed input and products."""
    _check_tile(tile)
    cdef Py_ssize_t tiles = ((height + tile - 1) // tile) * ((width + tile - 1) // tile)
    return (tile + 2) ** 2 * tiles * (channels + filters)


cdef inline void input_tile(const floating* src, Py_ssize_t height, Py_ssize_t width,
                            Py_ssize_t y0, Py_ssize_t x0, floating* v,
                            Py_ssize_t plane) noexcept nogil:
    cdef floating d[4][4]
    cdef floating t[4][4]
    cdef Py_ssize_t i, j, y, xx
    for i in range(4):
        y = y0 + i
        for j in range(4):
            xx = x0 + j
            if 0 <= y < height and 0 <= xx < width:
                d[i][j] = src[y * width + xx]
            else:
                d[i][j] = 0
    for j in range(4):
        t[0][j] = d[0][j] - d[2][j]
        t[1][j] = d[1][j] + d[2][j]
        t[2][j] = d[2][j] - d[1][j]
        t[3][j] = d[1][j] - d[3][j]
    for i in range(4):
        v[(i * 4 + 0) * plane] = t[i][0] - t[i][2]
        v[(i * 4 + 1) * plane] = t[i][1] + t[i][2]
        v[(i * 4 + 2) * plane] = t[i][2] - t[i][1]
        v[(i * 4 + 3) * plane] = t[i][1] - t[i][3]


cdef void input_transform(const floating* x, Py_ssize_t channels, Py_ssize_t height,
                          Py_ssize_t width, Py_ssize_t tiles_y, Py_ssize_t tiles_x,
                          floating* v) noexcept nogil:
    """v[(i*4 + j), c, tile] = (B^T d B)[i, j] for the 4x4 input tile d at (2ty-1, 2tx-1)."""
    cdef Py_ssize_t tiles = tiles_y * tiles_x, plane = channels * tiles
    cdef Py_ssize_t c, ty, tx
    for c in range(channels):
        for ty in range(tiles_y):
            for tx in range(tiles_x):
                input_tile(x + c * height * width, height, width, 2 * ty - 1, 2 * tx - 1,
                           v + c * tiles + ty * tiles_x + tx, plane)


cdef inline void output_tile(const floating* m, Py_ssize_t plane, floating bias,
                             Py_ssize_t height, Py_ssize_t width, Py_ssize_t y0,
                             Py_ssize_t x0, floating* dst) noexcept nogil:
    cdef floating p[4][4]
    cdef floating s[2][4]
    cdef floating r[2][2]
    cdef Py_ssize_t i, j
    for i in range(4):
        for j in range(4):
            p[i][j] = m[(i * 4 + j) * plane]
    for j in range(4):
        s[0][j] = p[0][j] + p[1][j] + p[2][j]
        s[1][j] = p[1][j] - p[2][j] - p[3][j]
    for i in range(2):
        r[i][0] = s[i][0] + s[i][1] + s[i][2]
        r[i][1] = s[i][1] - s[i][2] - s[i][3]
    for i in range(2):
        if y0 + i < height:
            for j in range(2):
                if x0 + j < width:
                    dst[(y0 + i) * width + x0 + j] = r[i][j] + bias


cdef void output_transform(const floating* m, const floating* bias, Py_ssize_t filters,
                           Py_ssize_t height, Py_ssize_t width, Py_ssize_t tiles_y,
                           Py_ssize_t tiles_x, int act, floating* out) noexcept nogil:
    """out[f] = A^T m A + bias[f] for every tile, then the activation, per filter."""
    cdef Py_ssize_t tiles = tiles_y * tiles_x, plane = filters * tiles
    cdef Py_ssize_t f, ty, tx
    for f in range(filters):
        for ty in range(tiles_y):
            for tx in range(tiles_x):
                output_tile(m + f * tiles + ty * tiles_x + tx, plane, bias[f], height, width,
                            2 * ty, 2 * tx, out + f * height * width)
        activate_array(out + f * height * width, height * width, act)


cdef inline void _bt4(const floating* d, Py_ssize_t ds, floating* o,
                      Py_ssize_t os) noexcept nogil:
    # B^T of F(4x4, 3x3) on six values d[k*ds], into o[k*os]; dm_wino4_input_f32's formulas.
    o[0] = 4 * d[0] - 5 * d[2 * ds] + d[4 * ds]
    o[os] = -4 * d[ds] - 4 * d[2 * ds] + d[3 * ds] + d[4 * ds]
    o[2 * os] = 4 * d[ds] - 4 * d[2 * ds] - d[3 * ds] + d[4 * ds]
    o[3 * os] = -2 * d[ds] - d[2 * ds] + 2 * d[3 * ds] + d[4 * ds]
    o[4 * os] = 2 * d[ds] - d[2 * ds] - 2 * d[3 * ds] + d[4 * ds]
    o[5 * os] = 4 * d[ds] - 5 * d[3 * ds] + d[5 * ds]


cdef inline void _at4(const floating* p, Py_ssize_t ps, floating* o,
                      Py_ssize_t os) noexcept nogil:
    # A^T of F(4x4, 3x3) on six values p[k*ps], into o[k*os]; kernels.h's DM_WINO4_AT.
    o[0] = p[0] + p[ps] + p[2 * ps] + p[3 * ps] + p[4 * ps]
    o[os] = p[ps] - p[2 * ps] + 2 * p[3 * ps] - 2 * p[4 * ps]
    o[2 * os] = p[ps] + p[2 * ps] + 4 * p[3 * ps] + 4 * p[4 * ps]
    o[3 * os] = p[ps] - p[2 * ps] + 8 * p[3 * ps] - 8 * p[4 * ps] + p[5 * ps]


cdef void input_transform4(const floating* x, Py_ssize_t channels, Py_ssize_t height,
                           Py_ssize_t width, Py_ssize_t tiles_y, Py_ssize_t tiles_x,
                           floating* v) noexcept nogil:
    """v[(i*6 + j), c, tile] = (B^T d B)[i, j] for the 6x6 input tile d at (4ty-1, 4tx-1):
    rows combined first (per column), then columns."""
    cdef Py_ssize_t tiles = tiles_y * tiles_x, plane = channels * tiles
    cdef Py_ssize_t c, ty, tx, i, j, y, xx
    cdef floating d[6][6]
    cdef floating t[6][6]
    cdef const floating* src
    for c in range(channels):
        src = x + c * height * width
        for ty in range(tiles_y):
            for tx in range(tiles_x):
                for i in range(6):
                    y = 4 * ty - 1 + i
                    for j in range(6):
                        xx = 4 * tx - 1 + j
                        d[i][j] = src[y * width + xx] if (0 <= y < height
                                                           and 0 <= xx < width) else 0
                for j in range(6):
                    _bt4(&d[0][j], 6, &t[0][j], 6)
                for i in range(6):
                    _bt4(&t[i][0], 1, v + i * 6 * plane + c * tiles + ty * tiles_x + tx,
                         plane)


cdef void output_transform4(const floating* m, const floating* bias, Py_ssize_t filters,
                            Py_ssize_t height, Py_ssize_t width, Py_ssize_t tiles_y,
                            Py_ssize_t tiles_x, int act, floating* out) noexcept nogil:
    """out[f] = A^T m A + bias[f] for every 4x4 tile (rows of m first, then columns), then
    the activation, per filter."""
    cdef Py_ssize_t tiles = tiles_y * tiles_x, plane = filters * tiles
    cdef Py_ssize_t f, ty, tx, i, j, k
    cdef floating p[6][6]
    cdef floating s[4][6]
    cdef floating r[4][4]
    cdef floating* dst
    for f in range(filters):
        dst = out + f * height * width
        for ty in range(tiles_y):
            for tx in range(tiles_x):
                for i in range(6):
                    for j in range(6):
                        p[i][j] = m[(i * 6 + j) * plane + f * tiles + ty * tiles_x + tx]
                for j in range(6):
                    _at4(&p[0][j], 6, &s[0][j], 6)
                for i in range(4):
                    _at4(&s[i][0], 1, &r[i][0], 1)
                for i in range(4):
                    if 4 * ty + i >= height:
                        break
                    for j in range(4):
                        if 4 * tx + j < width:
                            dst[(4 * ty + i) * width + 4 * tx + j] = r[i][j] + bias[f]
        activate_array(dst, height * width, act)


cdef enum:  # buffer roles
    WINO_X, WINO_FILTERS, WINO_BIAS, WINO_OUT, WINO_WORKSPACE

cdef struct WinogradParams:
    Py_ssize_t batch, channels, height, width, filters
    int act, tile


# Parts per thread of a parallel transform: more parts than threads, so a thread that gets
# fewer cycles (the cores shared with other processes) takes fewer of them.
cdef int TRANSFORM_PARTS_PER_THREAD = 4


ctypedef struct TransformJob:
    const float* x       # input transform: the image
    const float* m       # output transform: the GEMM results
    const float* bias
    float* v             # input transform: the transformed tiles
    float* out           # output transform: the image
    Py_ssize_t count     # channels (input) or filters (output)
    Py_ssize_t span      # of them per part
    Py_ssize_t height, width, tiles_y, tiles_x
    int act, tile


cdef void _input_part(void* ctx, int part) noexcept nogil:
    cdef TransformJob* j = <TransformJob*>ctx
    cdef Py_ssize_t c0 = part * j.span, c1 = min(j.count, c0 + j.span)
    if j.tile == 4:
        dm_wino4_input_f32(j.x, j.count, c0, c1, j.height, j.width, j.tiles_y, j.tiles_x, j.v)
    else:
        dm_wino2_input_f32(j.x, j.count, c0, c1, j.height, j.width, j.tiles_y, j.tiles_x, j.v)


cdef void _output_part(void* ctx, int part) noexcept nogil:
    cdef TransformJob* j = <TransformJob*>ctx
    cdef Py_ssize_t f0 = part * j.span, f1 = min(j.count, f0 + j.span)
    if j.tile == 4:
        dm_wino4_output_f32(j.m, j.bias, j.count, f0, f1, j.height, j.width, j.tiles_y,
                            j.tiles_x, j.act, j.out)
    else:
        dm_wino2_output_f32(j.m, j.bias, j.count, f0, f1, j.height, j.width, j.tiles_y,
                            j.tiles_x, j.act, j.out)


ctypedef struct GemmJob:
    const float* filters  # packed, a position after another
    const float* v
    float* m
    Py_ssize_t channels, nf, tiles


cdef void _gemm_part(void* ctx, int part) noexcept nogil:
    cdef GemmJob* j = <GemmJob*>ctx
    dm_gemm8_f32(j.nf, j.channels, j.filters + part * dm_pack8_size(j.nf, j.channels),
                 j.v + part * j.channels * j.tiles, j.tiles, NULL, DM_ACT_LINEAR, 0,
                 (j.nf + DM_GEMM8_M - 1) // DM_GEMM8_M, 0, j.tiles,
                 j.m + part * j.nf * j.tiles, j.tiles)


cdef inline void _run_split(part_fn fn, TransformJob* job, int threads) noexcept nogil:
    cdef Py_ssize_t parts = min(job.count, <Py_ssize_t>threads * TRANSFORM_PARTS_PER_THREAD)
    job.span = (job.count + parts - 1) // parts
    run_parts(fn, job, <int>((job.count + job.span - 1) // job.span))


cdef void _winograd(const floating* x, const floating* filters, const floating* bias,
                    floating* out, floating* workspace, const WinogradParams* p) noexcept nogil:
    cdef Py_ssize_t channels = p.channels, height = p.height, width = p.width
    cdef Py_ssize_t nf = p.filters, plane = height * width
    cdef int tile = p.tile, alpha = p.tile + 2
    cdef Py_ssize_t tiles_y = (height + tile - 1) // tile, tiles_x = (width + tile - 1) // tile
    cdef Py_ssize_t tiles = tiles_y * tiles_x
    cdef floating* v = workspace
    cdef floating* m = v + alpha * alpha * channels * tiles
    cdef Py_ssize_t b
    cdef TransformJob job
    cdef GemmJob gemm_job
    cdef int threads = cpu_threads()
    if channels == 0 or nf == 0:
        threads = 1  # nothing to split (and no part of zero width)
    job.tile = tile
    for b in range(p.batch):
        if floating is float:
            # The transforms are about as much work as the GEMMs on thin layers: shared out
            # among the GEMM threads like them (by channels, then by filters).
            job.x = x + b * channels * plane
            job.v = v
            job.count = channels
            job.height, job.width, job.tiles_y, job.tiles_x = height, width, tiles_y, tiles_x
            job.span = channels
            if threads > 1:
                _run_split(_input_part, &job, threads)
            else:
                _input_part(&job, 0)
        elif tile == 4:
            input_transform4(x + b * channels * plane, channels, height, width, tiles_y,
                             tiles_x, v)
        else:
            input_transform(x + b * channels * plane, channels, height, width, tiles_y,
                            tiles_x, v)
        if floating is float:
            # A part per position: its packed filters times its transformed tiles.
            gemm_job.filters, gemm_job.v, gemm_job.m = filters, v, m
            gemm_job.channels, gemm_job.nf, gemm_job.tiles = channels, nf, tiles
            run_parts(_gemm_part, &gemm_job, alpha * alpha)
        else:
            gemm_rowmajor_batch(alpha * alpha, False, False, <int>nf, <int>tiles,
                                <int>channels, filters, <int>channels, nf * channels,
                                v, <int>tiles, channels * tiles,
                                0, m, <int>tiles, nf * tiles)
        if floating is float:
            job.m, job.bias, job.out = m, bias, out + b * nf * plane
            job.count, job.act = nf, p.act
            job.span = nf
            if threads > 1:
                _run_split(_output_part, &job, threads)
            else:
                _output_part(&job, 0)
        elif tile == 4:
            output_transform4(m, bias, nf, height, width, tiles_y, tiles_x, p.act,
                              out + b * nf * plane)
        else:
            output_transform(m, bias, nf, height, width, tiles_y, tiles_x, p.act,
                             out + b * nf * plane)


cdef void _winograd_step(const StepData* d) noexcept nogil:
    cdef const WinogradParams* p = <const WinogradParams*>d.params
    if d.f32:
        _winograd(<const float*>d.buf[WINO_X], <const float*>d.buf[WINO_FILTERS],
                  <const float*>d.buf[WINO_BIAS], <float*>d.buf[WINO_OUT],
                  <float*>d.buf[WINO_WORKSPACE], p)
    else:
        _winograd(<const double*>d.buf[WINO_X], <const double*>d.buf[WINO_FILTERS],
                  <const double*>d.buf[WINO_BIAS], <double*>d.buf[WINO_OUT],
                  <double*>d.buf[WINO_WORKSPACE], p)


def winograd_step(x, filters, bias, out, workspace, int act) -> NativeStep:
    """``out = act(conv3x3(x, stride 1, pad 1) + bias)`` through F(2x2, 3x3) or F(4x4, 3x3),
    as ``filters`` were transformed for.

    x: (N, C, H, W); filters: ``transform_filters`` with tile 2 or 4 ((16 or 36, F, C) in
    float64, packed (16 or 36, ``packed_size(F, C)``) in float32); bias: (F,); out: (N, F, H, W); workspace: 1-D, at least ``workspace_size(C, F,
    H, W, tile)`` elements. All C-contiguous, of one dtype (float32 or float64). ``act`` is
    an elementwise activation id.
    """
    check_input("x", x)
    check_input("filters", filters, (2, 3), x, layout="(16 or 36, F, C) or (16 or 36, packed)")
    check_input("bias", bias, (1,), x, layout="(F,)")
    check_input("out", out, (4,), x, writable=True)
    cdef Py_ssize_t batch, channels, height, width
    cdef Py_ssize_t nf = bias.shape[0]
    batch, channels, height, width = x.shape
    tile = {16: 2, 36: 4}.get(filters.shape[0], 0)
    layout = ((filters.shape[0], dm_pack8_size(nf, channels)) if x.dtype == np.float32
              else (filters.shape[0], nf, channels))
    if tile == 0 or filters.shape != layout:
        raise ArgumentError(f"winograd_forward: filters shape {filters.shape}, expected "
                            f"{(16,) + layout[1:]} or {(36,) + layout[1:]} "
                            f"(transform_filters of {nf} filters, {channels} channels)")
    if out.shape != (batch, nf, height, width):
        raise ArgumentError(f"winograd_forward: out {out.shape} / bias {bias.shape} do not "
                            f"match ({batch}, {nf}, {height}, {width})")
    check_workspace(workspace, x, workspace_size(channels, nf, height, width, tile),
                    "winograd_forward")
    if not 0 <= act < ACT_COUNT:
        raise ArgumentError(f"winograd_forward: activation id {act} out of range")
    cdef NativeStep step = new_step(_winograd_step, f"winograd{tile}x{tile}_3x3",
                                    (x, filters, bias, out, workspace),
                                    x.dtype == np.float32, sizeof(WinogradParams))
    cdef WinogradParams* p = <WinogradParams*>step.data.params
    p.batch, p.channels, p.height, p.width, p.filters = batch, channels, height, width, nf
    p.act, p.tile = act, tile
    return step


def winograd_forward(x, filters, bias, out, workspace, int act) -> None:
    """``winograd_step(x, filters, bias, out, workspace, act)`` run once."""
    winograd_step(x, filters, bias, out, workspace, act).run()
