/* One instruction-set variant of the direct 3x3 convolution's row kernel (see
 * dm_conv3x3_direct_rows_f32 in kernels.h). A template, included once per variant with
 *   DM_DR_NAME   the function's name,
 *   DM_DR_ATTR   its attributes (the target it is compiled for),
 *   DM_DR_VEC    a float vector type, DM_DR_VECU its unaligned, aliasing twin,
 *   DM_DR_XV     vectors of output columns per block,
 *   DM_DR_FH     filters computed together: 8 (the block of DM_DIRECT_FB), or 4, in two
 *                turns, where 16 registers cannot hold 8 filters' accumulators for more
 *                than one vector (AVX2: 4 x 2 vectors load 6 values per 8 products where
 *                8 x 1 loads 9),
 *   DM_DR_MAC    (acc, w, s): acc += w * s lane by lane, either the product rounded and then
 *                added (Darknet's own arithmetic, which training reproduces) or fused, rounded
 *                once (inference),
 * defined; it undefines them. The variants of one arithmetic differ only in how many columns
 * and filters a block holds (the accumulators must fit the set's registers): every output is
 * the same chain of multiply-adds in (c, ky, kx) order from 0, then + bias, then the
 * activation, so they compute the same bits. */

static DM_DR_ATTR void DM_DR_NAME(ptrdiff_t channels, ptrdiff_t height, ptrdiff_t width,
                                  ptrdiff_t stride, const float *bias, ptrdiff_t filters,
                                  int act, const float *scratch, ptrdiff_t fb0, ptrdiff_t fb1,
                                  ptrdiff_t y0, ptrdiff_t y1, float *out)
{
    enum { LANES = sizeof(DM_DR_VEC) / sizeof(float), XB = LANES * DM_DR_XV };
    const ptrdiff_t out_h = (height - 1) / stride + 1, out_w = (width - 1) / stride + 1;
    const ptrdiff_t pw = dm_direct_phase_width(out_w), row_len = stride * pw;
    const ptrdiff_t plane = (height + 2) * row_len, k = channels * 9;
    /* Tap kx of output column x reads padded column stride*x + kx: phase kx % stride, at
     * kx / stride past x. */
    const ptrdiff_t tap[3] = {0, (1 % stride) * pw + 1 / stride, (2 % stride) * pw + 2 / stride};
    /* Every filter block of a row before the next row: the row's input (channels x 3 padded
     * rows) is read from memory once, then from cache (filter blocks outermost was measured
     * up to 3x slower once the input outgrows the cache). */
    for (ptrdiff_t y = y0; y < y1; y++)
    for (ptrdiff_t fb = fb0; fb < fb1; fb++) {
        const ptrdiff_t nf = filters - fb * DM_DIRECT_FB < DM_DIRECT_FB
                                 ? filters - fb * DM_DIRECT_FB
                                 : DM_DIRECT_FB;
        float *o = out + (fb * DM_DIRECT_FB * out_h + y) * out_w;
        for (ptrdiff_t x0 = 0; x0 < out_w; x0 += XB)
        for (ptrdiff_t f0 = 0; f0 < nf; f0 += DM_DR_FH) {
            DM_DR_VEC acc[DM_DR_FH][DM_DR_XV];
#pragma GCC unroll 8
            for (int f = 0; f < DM_DR_FH; f++)
#pragma GCC unroll 4
                for (int v = 0; v < DM_DR_XV; v++)
                    acc[f][v] = (DM_DR_VEC){0};
            const float *wk = scratch + channels * plane + fb * k * DM_DIRECT_FB + f0;
            for (ptrdiff_t c = 0; c < channels; c++) {
                for (int ky = 0; ky < 3; ky++) {
                    const float *row = scratch + c * plane + (stride * y + ky) * row_len + x0;
                    /* Not unrolled: the three taps' loads and broadcasts at once spill
                     * accumulators. */
#pragma GCC unroll 1
                    for (int kx = 0; kx < 3; kx++, wk += DM_DIRECT_FB) {
                        DM_DR_VEC s[DM_DR_XV];
#pragma GCC unroll 4
                        for (int v = 0; v < DM_DR_XV; v++)
                            s[v] = *(const DM_DR_VECU *)(row + tap[kx] + v * LANES);
#pragma GCC unroll 8
                        for (int f = 0; f < DM_DR_FH; f++) {
                            /* wk[f] in every lane (x - 0 is x exactly: only the
                             * broadcast). */
                            const DM_DR_VEC w = wk[f] - (DM_DR_VEC){0};
#pragma GCC unroll 4
                            for (int v = 0; v < DM_DR_XV; v++)
                                DM_DR_MAC(acc[f][v], w, s[v]);
                        }
                    }
                }
            }
            const ptrdiff_t nx = out_w - x0 < XB ? out_w - x0 : XB;
            for (ptrdiff_t f = 0; f < DM_DR_FH && f0 + f < nf; f++) {
                float *dst = o + (f0 + f) * out_h * out_w + x0;
                for (int v = 0; v < DM_DR_XV; v++) {
                    const DM_DR_VEC r = acc[f][v] + bias[fb * DM_DIRECT_FB + f0 + f];
                    if (nx == XB)
                        *(DM_DR_VECU *)(dst + v * LANES) = r;
                    else
                        for (ptrdiff_t j = 0; j < LANES && v * LANES + j < nx; j++)
                            dst[v * LANES + j] = r[j];
                }
            }
        }
        /* The activation on the finished rows while they are in L1, out of line: the one
         * dm_act_f32 computes everywhere (inlined into a fused variant it would be contracted
         * into fused multiply-adds). */
        for (ptrdiff_t f = 0; act != DM_ACT_LINEAR && f < nf; f++)
            dm_act_f32(o + f * out_h * out_w, out_w, act);
    }
}

#undef DM_DR_NAME
#undef DM_DR_ATTR
#undef DM_DR_VEC
#undef DM_DR_VECU
#undef DM_DR_XV
#undef DM_DR_FH
#undef DM_DR_MAC
