/* Hot float32 loops of the CPU reference, written so the compiler vectorises them.
 *
 * On x86-64 Linux each function is compiled three times (AVX-512, AVX2, baseline SSE2) and
 * the loader picks the widest the CPU supports, so the extension stays portable while the
 * loops get wide vectors. Elsewhere (macOS arm64: NEON is the baseline) they compile once.
 * The build disables floating-point contraction, so every variant performs the same
 * operations in the same order and rounds identically: the choice of variant never changes
 * a result.
 *
 * Layouts are NCHW planes, float32, contiguous.
 */
#ifndef DARKNET_METAL_CPU_KERNELS_H
#define DARKNET_METAL_CPU_KERNELS_H

#include <float.h>
#include <stddef.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define DM_CLONES __attribute__((target_clones("avx512f", "avx2", "default"), unused))
#else
#define DM_CLONES __attribute__((unused))
#endif

/* out[c, i] = act(out[c, i] + bias[c]) for c < channels, i < spatial; act is Darknet's
 * leaky (x > 0 ? x : 0.1f*x) when leaky != 0, the identity otherwise. */
static DM_CLONES void dm_bias_act_f32(float *out, const float *bias, ptrdiff_t channels,
                                      ptrdiff_t spatial, int leaky)
{
    for (ptrdiff_t c = 0; c < channels; c++) {
        float *row = out + c * spatial;
        const float b = bias[c];
        if (leaky) {
            for (ptrdiff_t i = 0; i < spatial; i++) {
                float v = row[i] + b;
                row[i] = v > 0.0f ? v : 0.1f * v;
            }
        } else {
            for (ptrdiff_t i = 0; i < spatial; i++)
                row[i] = row[i] + b;
        }
    }
}

/* 2x2 max pooling with stride 2 over `planes` planes of h x w, every window inside the
 * plane (2*out_h <= h, 2*out_w <= w). The comparisons are Darknet's: a strict ">" in the
 * window order (0,0), (0,1), (1,0), (1,1) starting from -FLT_MAX, so NaN never wins. */
static DM_CLONES void dm_maxpool2x2s2_f32(const float *src, float *dst, ptrdiff_t planes,
                                          ptrdiff_t h, ptrdiff_t w, ptrdiff_t out_h,
                                          ptrdiff_t out_w)
{
    for (ptrdiff_t p = 0; p < planes; p++) {
        for (ptrdiff_t i = 0; i < out_h; i++) {
            const float *r0 = src + (p * h + 2 * i) * w;
            const float *r1 = r0 + w;
            float *o = dst + (p * out_h + i) * out_w;
            for (ptrdiff_t j = 0; j < out_w; j++) {
                float best = -FLT_MAX;
                best = r0[2 * j] > best ? r0[2 * j] : best;
                best = r0[2 * j + 1] > best ? r0[2 * j + 1] : best;
                best = r1[2 * j] > best ? r1[2 * j] : best;
                best = r1[2 * j + 1] > best ? r1[2 * j + 1] : best;
                o[j] = best;
            }
        }
    }
}

/* Sixteen floats as one value (GCC/Clang vector extension); the compiler splits it into
 * the widest registers the variant has. dm_v16u may be unaligned and alias float arrays. */
typedef float dm_v16 __attribute__((vector_size(64)));
typedef float dm_v16u __attribute__((vector_size(64), aligned(4), may_alias));

/* Output columns computed together by the direct convolution, and filters per pass. */
#define DM_DIRECT_XB 16
#define DM_DIRECT_FB 8

/* Floats of scratch dm_conv3x3_direct_f32 needs. */
static inline ptrdiff_t dm_conv3x3_direct_scratch(ptrdiff_t channels, ptrdiff_t filters,
                                                  ptrdiff_t height, ptrdiff_t width)
{
    ptrdiff_t wp = (width + DM_DIRECT_XB - 1) / DM_DIRECT_XB * DM_DIRECT_XB + 2;
    ptrdiff_t fblocks = (filters + DM_DIRECT_FB - 1) / DM_DIRECT_FB;
    return channels * (height + 2) * wp + fblocks * channels * 9 * DM_DIRECT_FB;
}

/* 3x3, stride 1, pad 1 convolution of one image computed directly (no im2col), for few
 * input channels where the GEMM's inner dimension would be too thin for BLAS.
 * x: (channels, height, width); weights: (filters, channels*9) in (c, ky, kx) order;
 * out: (filters, height, width) = act(sum_{c,ky,kx} w*x + bias), the sum taken in
 * (c, ky, kx) order from 0 and the bias added last. scratch: dm_conv3x3_direct_scratch()
 * floats (a zero-padded copy of x and the weights regrouped by blocks of filters). */
static DM_CLONES void dm_conv3x3_direct_f32(const float *x, ptrdiff_t channels,
                                            ptrdiff_t height, ptrdiff_t width,
                                            const float *weights, const float *bias,
                                            ptrdiff_t filters, int leaky, float *scratch,
                                            float *out)
{
    const ptrdiff_t k = channels * 9;
    const ptrdiff_t wp = (width + DM_DIRECT_XB - 1) / DM_DIRECT_XB * DM_DIRECT_XB + 2;
    const ptrdiff_t hp = height + 2;
    const ptrdiff_t fblocks = (filters + DM_DIRECT_FB - 1) / DM_DIRECT_FB;
    float *padded = scratch;
    float *wblk = scratch + channels * hp * wp;

    memset(padded, 0, (size_t)(channels * hp * wp) * sizeof(float));
    for (ptrdiff_t c = 0; c < channels; c++)
        for (ptrdiff_t y = 0; y < height; y++)
            memcpy(padded + (c * hp + y + 1) * wp + 1, x + (c * height + y) * width,
                   (size_t)width * sizeof(float));
    /* wblk[fb][kk][f]: the FB filters of a block side by side for each tap; filters past
     * the end get zero weights and are never stored. */
    for (ptrdiff_t fb = 0; fb < fblocks; fb++)
        for (ptrdiff_t kk = 0; kk < k; kk++)
            for (ptrdiff_t f = 0; f < DM_DIRECT_FB; f++) {
                ptrdiff_t ff = fb * DM_DIRECT_FB + f;
                wblk[(fb * k + kk) * DM_DIRECT_FB + f] = ff < filters ? weights[ff * k + kk]
                                                                      : 0.0f;
            }

    for (ptrdiff_t fb = 0; fb < fblocks; fb++) {
        const float *wb = wblk + fb * k * DM_DIRECT_FB;
        const ptrdiff_t nf = filters - fb * DM_DIRECT_FB < DM_DIRECT_FB
                                 ? filters - fb * DM_DIRECT_FB
                                 : DM_DIRECT_FB;
        for (ptrdiff_t y = 0; y < height; y++) {
            for (ptrdiff_t x0 = 0; x0 < width; x0 += DM_DIRECT_XB) {
                dm_v16 acc[DM_DIRECT_FB];
                for (int f = 0; f < DM_DIRECT_FB; f++)
                    acc[f] = (dm_v16){0};
                for (ptrdiff_t c = 0; c < channels; c++) {
                    for (int ky = 0; ky < 3; ky++) {
                        const float *row = padded + (c * hp + y + ky) * wp + x0;
                        for (int kx = 0; kx < 3; kx++) {
                            const dm_v16 s = *(const dm_v16u *)(row + kx);
                            const float *wk = wb + ((c * 3 + ky) * 3 + kx) * DM_DIRECT_FB;
                            for (int f = 0; f < DM_DIRECT_FB; f++)
                                acc[f] = acc[f] + wk[f] * s;
                        }
                    }
                }
                const ptrdiff_t nx = width - x0 < DM_DIRECT_XB ? width - x0 : DM_DIRECT_XB;
                for (ptrdiff_t f = 0; f < nf; f++) {
                    const ptrdiff_t ff = fb * DM_DIRECT_FB + f;
                    float *o = out + (ff * height + y) * width + x0;
                    const dm_v16 v = acc[f] + bias[ff];
                    if (nx == DM_DIRECT_XB)
                        *(dm_v16u *)o = v;
                    else
                        for (ptrdiff_t j = 0; j < nx; j++)
                            o[j] = v[j];
                }
            }
            /* The activation on the finished rows while they are in L1. */
            for (ptrdiff_t f = 0; leaky && f < nf; f++) {
                float *o = out + ((fb * DM_DIRECT_FB + f) * height + y) * width;
                for (ptrdiff_t j = 0; j < width; j++)
                    o[j] = o[j] > 0.0f ? o[j] : 0.1f * o[j];
            }
        }
    }
}

/* Tiles of one tile row transformed together by the Winograd kernels (stack buffers). */
#define DM_WINO_CHUNK 64

/* Winograd F(2x2, 3x3) input transform, V = B^T d B for the 4x4 tile d of every channel at
 * (2*ty - 1, 2*tx - 1) (zero outside the image): v[(i*4 + j)*plane + c*tiles + ty*tiles_x
 * + tx] with tiles = tiles_y*tiles_x and plane = channels*tiles. Columns of the tile are
 * combined first, then rows, as the scalar reference does. A run of tiles is handled at once:
 * the even and odd input columns are split apart so every step is a contiguous loop. */
static DM_CLONES void dm_wino2_input_f32(const float *x, ptrdiff_t channels, ptrdiff_t height,
                                         ptrdiff_t width, ptrdiff_t tiles_y, ptrdiff_t tiles_x,
                                         float *v)
{
    const ptrdiff_t tiles = tiles_y * tiles_x, plane = channels * tiles;
    float ev[4][DM_WINO_CHUNK + 1], od[4][DM_WINO_CHUNK + 1];
    float te[4][DM_WINO_CHUNK + 1], to[4][DM_WINO_CHUNK + 1];
    for (ptrdiff_t c = 0; c < channels; c++) {
        const float *xc = x + c * height * width;
        for (ptrdiff_t ty = 0; ty < tiles_y; ty++) {
            for (ptrdiff_t tx0 = 0; tx0 < tiles_x; tx0 += DM_WINO_CHUNK) {
                const ptrdiff_t n = tiles_x - tx0 < DM_WINO_CHUNK ? tiles_x - tx0
                                                                  : DM_WINO_CHUNK;
                /* ev[i][m] = x[y][2(tx0+m) - 1], od[i][m] = x[y][2(tx0+m)], y = 2ty-1+i. */
                for (int i = 0; i < 4; i++) {
                    const ptrdiff_t y = 2 * ty - 1 + i;
                    if (y < 0 || y >= height) {
                        for (ptrdiff_t m = 0; m <= n; m++)
                            ev[i][m] = od[i][m] = 0.0f;
                        continue;
                    }
                    const float *row = xc + y * width;
                    for (ptrdiff_t m = 0; m <= n; m++) {
                        const ptrdiff_t e = 2 * (tx0 + m) - 1, o = e + 1;
                        ev[i][m] = e >= 0 && e < width ? row[e] : 0.0f;
                        od[i][m] = o < width ? row[o] : 0.0f;
                    }
                }
                for (ptrdiff_t m = 0; m <= n; m++) {
                    te[0][m] = ev[0][m] - ev[2][m];
                    te[1][m] = ev[1][m] + ev[2][m];
                    te[2][m] = ev[2][m] - ev[1][m];
                    te[3][m] = ev[1][m] - ev[3][m];
                    to[0][m] = od[0][m] - od[2][m];
                    to[1][m] = od[1][m] + od[2][m];
                    to[2][m] = od[2][m] - od[1][m];
                    to[3][m] = od[1][m] - od[3][m];
                }
                float *dst = v + c * tiles + ty * tiles_x + tx0;
                for (int i = 0; i < 4; i++) {
                    float *d0 = dst + (i * 4 + 0) * plane, *d1 = dst + (i * 4 + 1) * plane;
                    float *d2 = dst + (i * 4 + 2) * plane, *d3 = dst + (i * 4 + 3) * plane;
                    for (ptrdiff_t m = 0; m < n; m++) {
                        d0[m] = te[i][m] - te[i][m + 1];
                        d1[m] = to[i][m] + te[i][m + 1];
                        d2[m] = te[i][m + 1] - to[i][m];
                        d3[m] = to[i][m] - to[i][m + 1];
                    }
                }
            }
        }
    }
}

/* Winograd F(2x2, 3x3) output transform with the bias and, when leaky != 0, Darknet's leaky
 * fused: out[f] = act(A^T M A + bias[f]) for every 2x2 output tile, where
 * M[i][j] = mm[(i*4 + j)*plane + f*tiles + tile] and plane = filters*tiles. Rows of M are
 * combined first, then columns, then the bias is added, as the scalar reference does. */
static DM_CLONES void dm_wino2_output_f32(const float *mm, const float *bias, ptrdiff_t filters,
                                          ptrdiff_t height, ptrdiff_t width, ptrdiff_t tiles_y,
                                          ptrdiff_t tiles_x, int leaky, float *out)
{
    const ptrdiff_t tiles = tiles_y * tiles_x, plane = filters * tiles;
    float r[2][2][DM_WINO_CHUNK];
    for (ptrdiff_t f = 0; f < filters; f++) {
        const float b = bias[f];
        float *of = out + f * height * width;
        for (ptrdiff_t ty = 0; ty < tiles_y; ty++) {
            for (ptrdiff_t tx0 = 0; tx0 < tiles_x; tx0 += DM_WINO_CHUNK) {
                const ptrdiff_t n = tiles_x - tx0 < DM_WINO_CHUNK ? tiles_x - tx0
                                                                  : DM_WINO_CHUNK;
                const float *p = mm + f * tiles + ty * tiles_x + tx0;
#define DM_P(i, j) p[((i) * 4 + (j)) * plane + m]
                for (ptrdiff_t m = 0; m < n; m++) {
                    float s0[4], s1[4];
                    for (int j = 0; j < 4; j++) {
                        s0[j] = DM_P(0, j) + DM_P(1, j) + DM_P(2, j);
                        s1[j] = DM_P(1, j) - DM_P(2, j) - DM_P(3, j);
                    }
                    float v00 = s0[0] + s0[1] + s0[2] + b, v01 = s0[1] - s0[2] - s0[3] + b;
                    float v10 = s1[0] + s1[1] + s1[2] + b, v11 = s1[1] - s1[2] - s1[3] + b;
                    if (leaky) {
                        v00 = v00 > 0.0f ? v00 : 0.1f * v00;
                        v01 = v01 > 0.0f ? v01 : 0.1f * v01;
                        v10 = v10 > 0.0f ? v10 : 0.1f * v10;
                        v11 = v11 > 0.0f ? v11 : 0.1f * v11;
                    }
                    r[0][0][m] = v00;
                    r[0][1][m] = v01;
                    r[1][0][m] = v10;
                    r[1][1][m] = v11;
                }
#undef DM_P
                for (int i = 0; i < 2; i++) {
                    const ptrdiff_t y = 2 * ty + i;
                    if (y >= height)
                        break;
                    float *row = of + y * width + 2 * tx0;
                    /* Tiles whose both columns are inside, then a possible half tile. */
                    const ptrdiff_t full = (width - 2 * tx0) / 2 < n ? (width - 2 * tx0) / 2 : n;
                    for (ptrdiff_t m = 0; m < full; m++) {
                        row[2 * m] = r[i][0][m];
                        row[2 * m + 1] = r[i][1][m];
                    }
                    if (full < n)
                        row[2 * full] = r[i][0][full];
                }
            }
        }
    }
}

#endif
