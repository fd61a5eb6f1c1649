/* One instruction-set variant of dm_gemm8_f32 (kernels.h), the product of weights packed by
 * dm_pack8_f32 with row-major planes. A template, included once per variant with
 *   DM_PG_NAME   the function's name, DM_PG_ATTR its attributes,
 *   DM_PG_VEC    a float vector type, DM_PG_VECU its unaligned, aliasing twin,
 *   DM_PG_XV     vectors of columns per block,
 *   DM_PG_FH     filters computed together: 8 (the packed block), or 4 where the registers
 *                cannot hold 8 filters' accumulators with their operands (16 AVX2 registers:
 *                4 filters x 3 vectors take 12 accumulators, 3 columns and a weight, and
 *                load 7 values per 12 fused multiply-adds where 8 x 1 loads 9 per 8),
 *   DM_PG_FMA    (acc, a, b): acc = a * b + acc rounded once, lane by lane,
 *   DM_PG_COPY   floats of the panel the right-hand rows may be copied to (dm_gemm8_copies;
 *                DM_GEMM8_PANEL, or 1 for a variant that never copies and so keeps 128 KiB
 *                off its threads' stacks),
 * defined; it undefines them. Every output is the chain of fused multiply-adds in k order
 * from 0, then + bias, then the activation, whatever the variant: all compute the same bits.
 *
 * With 4 filters at a time, the two halves of a block of 8 take turns over runs of
 * DM_GEMM8_KRUN rows of b (a run's columns stay in L1 for the second half; the sums wait in
 * registers spilled to the stack between runs, stored and reloaded exactly). A block short of
 * columns at the end of a run computes only the vectors it needs (a 13x13 Winograd layer's 49
 * tiles: 24 + 24 + 8 columns with AVX2, not 24 x 3). */

#define DM_PG_CAT2(a, b) a##b
#define DM_PG_CAT(a, b) DM_PG_CAT2(a, b)
#define DM_PG_BLOCK DM_PG_CAT(DM_PG_NAME, _block)
#define DM_PG_TAIL DM_PG_CAT(DM_PG_NAME, _tail)

/* The variant's lanes a vector and columns a block (<name>_columns: dm_gemm8_columns). */
enum {
    DM_PG_CAT(DM_PG_NAME, _lanes) = sizeof(DM_PG_VEC) / sizeof(float),
    DM_PG_CAT(DM_PG_NAME, _columns) = DM_PG_CAT(DM_PG_NAME, _lanes) * DM_PG_XV
};

/* One block: the 8 filters of block mb (nf of them below m) times xv vectors of columns of
 * b's k rows: from bx, rows ldb floats apart (or, when b has only n < xv * LANES columns, a
 * zero-padded copy of its rows from bx), stored to c's columns [x, end), which are the
 * block's columns from x - xs on. Always inlined with a constant xv, so its loops unroll. */
static inline __attribute__((always_inline)) DM_PG_ATTR void DM_PG_BLOCK(
    ptrdiff_t k, const float *ap, const float *bx, ptrdiff_t ldb, ptrdiff_t n, ptrdiff_t xs,
    ptrdiff_t x, ptrdiff_t end, ptrdiff_t nf, const float *bias, int act, int fetch,
    int wfetch, float *c, ptrdiff_t ldc, const int xv)
{
    enum {
        LANES = DM_PG_CAT(DM_PG_NAME, _lanes),
        XB = DM_PG_CAT(DM_PG_NAME, _columns),
        HALVES = DM_GEMM8_M / DM_PG_FH
    };
    const ptrdiff_t width = (ptrdiff_t)xv * LANES;
    /* Rows of b one turn of the halves takes (all of them with one half). */
    const ptrdiff_t krun = HALVES == 1 ? k : DM_GEMM8_KRUN;
    /* Halves holding a filter below m (the others are zero weights). */
    const int halves = (int)((nf + DM_PG_FH - 1) / DM_PG_FH);
    DM_PG_VEC sums[HALVES][DM_PG_FH][DM_PG_XV];
    for (int h = 0; h < HALVES; h++)
        for (int f = 0; f < DM_PG_FH; f++)
            for (int v = 0; v < DM_PG_XV; v++)
                sums[h][f][v] = (DM_PG_VEC){0};
    /* b's rows in place, or, with fewer columns than the block, copied by runs of
     * DM_GEMM8_KC rows into a zero-padded panel (the chain of each output goes on from one
     * run to the next unchanged). */
    float panel[DM_GEMM8_KC][XB];
    const ptrdiff_t kstep = n < width && krun > DM_GEMM8_KC ? DM_GEMM8_KC : krun;
    for (ptrdiff_t k0 = 0; k0 < k; k0 += kstep) {
        const ptrdiff_t k1 = k - k0 < kstep ? k : k0 + kstep;
        const float *b0 = bx + k0 * ldb;
        ptrdiff_t step = ldb;
        if (n < width) {
            for (ptrdiff_t kk = k0; kk < k1; kk++) {
                memcpy(panel[kk - k0], bx + kk * ldb, (size_t)n * sizeof(float));
                memset(panel[kk - k0] + n, 0, (size_t)(XB - n) * sizeof(float));
            }
            b0 = panel[0];
            step = XB;
        }
        for (int h = 0; h < halves; h++) {
            DM_PG_VEC acc[DM_PG_FH][DM_PG_XV];
#pragma GCC unroll 8
            for (int f = 0; f < DM_PG_FH; f++)
#pragma GCC unroll 4
                for (int v = 0; v < xv; v++)
                    acc[f][v] = sums[h][f][v];
            const float *bp = b0, *wk = ap + k0 * DM_GEMM8_M + h * DM_PG_FH;
            for (ptrdiff_t kk = k0; kk < k1; kk++, bp += step, wk += DM_GEMM8_M) {
                /* The first pass over a run of columns read in place takes each of b's k
                 * rows from memory: one stream per row, more than the hardware prefetchers
                 * follow, so each row's next blocks are asked for here. */
                if (fetch && h == 0)
                    __builtin_prefetch(bp + DM_GEMM8_PREFETCH, 0, 3);
                /* The weights' stream, when this block is the first to read them (one
                 * line per two rows). */
                if (wfetch && h == 0 && (kk & 1) == 0)
                    __builtin_prefetch(wk + DM_GEMM8_WFETCH, 0, 3);
                DM_PG_VEC s[DM_PG_XV];
#pragma GCC unroll 4
                for (int v = 0; v < xv; v++)
                    s[v] = *(const DM_PG_VECU *)(bp + v * LANES);
#pragma GCC unroll 8
                for (int f = 0; f < DM_PG_FH; f++) {
                    /* wk[f] in every lane (x - 0 is x exactly, so this is only the
                     * broadcast). */
                    const DM_PG_VEC w = wk[f] - (DM_PG_VEC){0};
#pragma GCC unroll 4
                    for (int v = 0; v < xv; v++)
                        DM_PG_FMA(acc[f][v], w, s[v]);
                }
            }
#pragma GCC unroll 8
            for (int f = 0; f < DM_PG_FH; f++)
#pragma GCC unroll 4
                for (int v = 0; v < xv; v++)
                    sums[h][f][v] = acc[f][v];
        }
    }
    const int whole = xs == x && end - x == width;
    for (int h = 0; h < halves; h++) {
        const int f0 = h * DM_PG_FH;
        const int rows = nf - f0 < DM_PG_FH ? (int)(nf - f0) : DM_PG_FH;
        if (whole && (act == DM_ACT_LINEAR || act == DM_ACT_LEAKY)) {
            /* All of the block's columns are this part's, linear or leaky: bias and
             * activation in registers, stored straight to c (the select below is
             * dm_act_f32's "x > 0 ? x : 0.1f * x", one multiply, nothing to contract). */
            for (int f = 0; f < rows; f++) {
                float *row = c + (f0 + f) * ldc + x;
#pragma GCC unroll 4
                for (int v = 0; v < xv; v++) {
                    DM_PG_VEC r = bias ? sums[h][f][v] + bias[f0 + f] : sums[h][f][v];
                    if (act == DM_ACT_LEAKY) {
                        const __typeof__(r > 0.0f) pos = r > 0.0f;
                        const __typeof__(pos) scaled = (__typeof__(pos))(0.1f * r);
                        r = (DM_PG_VEC)((pos & (__typeof__(pos))r) | (~pos & scaled));
                    }
                    *(DM_PG_VECU *)(row + v * LANES) = r;
                }
            }
            continue;
        }
        /* Bias and activation on the block in L1, then its new columns out. */
        float tmp[DM_PG_FH][XB];
        for (int f = 0; f < DM_PG_FH; f++)
            for (int v = 0; v < DM_PG_XV; v++) {
                DM_PG_VEC r = (DM_PG_VEC){0};
                if (v < xv)
                    r = f < rows && bias ? sums[h][f][v] + bias[f0 + f] : sums[h][f][v];
                *(DM_PG_VECU *)(tmp[f] + v * LANES) = r;
            }
        /* Out of line: the activation is the one dm_act_f32 computes everywhere (inlined
         * here it would be contracted into fused multiply-adds). */
        if (act != DM_ACT_LINEAR)
            dm_act_f32(tmp[0], DM_PG_FH * XB, act);
        for (int f = 0; f < rows; f++)
            memcpy(c + (f0 + f) * ldc + x, tmp[f] + (x - xs),
                   (size_t)(end - x) * sizeof(float));
    }
}

/* The last columns [j0, j1) of b, fewer than a vector (DM_GEMM8_TAIL_MAX at most), for the
 * filters of blocks [g0, g1) (at most DM_GEMM8_TAIL_BLOCKS): a block's 8 filters side by side
 * in one 8-lane vector times one column's value, where a vector block would compute a whole
 * vector of columns for them (a 13x13 Winograd layer's 49 tiles: 32 + 16 + 1 columns, not
 * 32 + 32). Each block is its own chain, so the blocks' multiply-adds overlap; the same chain
 * per output as the vector blocks (fused multiply-adds in kk order from 0, + bias, the
 * activation), so the same bits. The blocks' weights were just read (in L2). */
static inline DM_PG_ATTR void DM_PG_TAIL(ptrdiff_t m, ptrdiff_t k, const float *packed,
                                         const float *b, ptrdiff_t ldb, const float *bias,
                                         int act, ptrdiff_t g0, ptrdiff_t g1, ptrdiff_t j0,
                                         ptrdiff_t j1, float *c, ptrdiff_t ldc)
{
    enum { G = DM_GEMM8_TAIL_BLOCKS };
    const int gn = (int)(g1 - g0);
    for (ptrdiff_t j = j0; j < j1; j++) {
        dm_v8 acc[G];
#pragma GCC unroll 8
        for (int g = 0; g < G; g++)
            acc[g] = (dm_v8){0};
        const float *bp = b + j, *ap = packed + g0 * k * DM_GEMM8_M;
        for (ptrdiff_t kk = 0; kk < k; kk++, bp += ldb, ap += DM_GEMM8_M) {
            /* b[kk][j] in every lane (x - 0 is x exactly: only the broadcast). */
            const dm_v8 s = *bp - (dm_v8){0};
#pragma GCC unroll 8
            for (int g = 0; g < G; g++)
                if (g < gn) {
                    const dm_v8 w = *(const dm_v8u *)(ap + g * k * DM_GEMM8_M);
                    DM_PG_FMA(acc[g], w, s);
                }
        }
        for (int g = 0; g < gn; g++) {
            const ptrdiff_t f0 = (g0 + g) * DM_GEMM8_M;
            const int rows = m - f0 < DM_GEMM8_M ? (int)(m - f0) : DM_GEMM8_M;
            float r[DM_GEMM8_M];
            *(dm_v8u *)r = acc[g];
            for (int f = 0; f < rows; f++)
                r[f] = bias ? r[f] + bias[f0 + f] : r[f];
            /* Out of line, as the vector blocks' activation (not contracted). */
            if (act != DM_ACT_LINEAR)
                dm_act_f32(r, rows, act);
            for (int f = 0; f < rows; f++)
                c[(f0 + f) * ldc + j] = r[f];
        }
    }
}

static DM_PG_ATTR void DM_PG_NAME(ptrdiff_t m, ptrdiff_t k, const float *packed,
                                     const float *b, ptrdiff_t n, const float *bias, int act,
                                     ptrdiff_t mb0, ptrdiff_t mb1, ptrdiff_t x0, ptrdiff_t x1,
                                     float *c, ptrdiff_t ldc)
{
    enum { LANES = DM_PG_CAT(DM_PG_NAME, _lanes), XB = DM_PG_CAT(DM_PG_NAME, _columns) };
    /* Columns a pass over the filter blocks takes: their k rows of b stay in L2 meanwhile. */
    ptrdiff_t chunk = DM_GEMM8_PANEL / k / XB * XB;
    if (chunk < XB)
        chunk = XB;
    /* On CPUs that gain from it (dm_gemm8_copies) and where a chunk's k rows fit (k <=
     * DM_GEMM8_PANEL / XB), its rows are first copied here block by block, each block's rows
     * one after the other: the filter blocks then read one stream from L2 instead of k rows a
     * page or more apart. */
    float copy[DM_PG_COPY] __attribute__((aligned(64)));
    const int copied = n >= XB && chunk * k <= DM_PG_COPY && dm_gemm8_copies();
    /* b's last n % LANES columns, when few and this part's, go to the tail (DM_PG_TAIL);
     * the vector blocks stop before them. */
    const ptrdiff_t tail = x1 == n && n % LANES <= DM_GEMM8_TAIL_MAX ? n % LANES : 0;
    const ptrdiff_t xv1 = x1 - tail;
    if (tail > 0 && xv1 <= x0)
        for (ptrdiff_t g0 = mb0; g0 < mb1; g0 += DM_GEMM8_TAIL_BLOCKS) {
            const ptrdiff_t g1 =
                mb1 - g0 < DM_GEMM8_TAIL_BLOCKS ? mb1 : g0 + DM_GEMM8_TAIL_BLOCKS;
            DM_PG_TAIL(m, k, packed, b, n, bias, act, g0, g1, x0, x1, c, ldc);
        }
    for (ptrdiff_t c0 = x0; c0 < xv1; c0 += chunk) {
        const ptrdiff_t c1 = xv1 - c0 < chunk ? xv1 : c0 + chunk;
        for (ptrdiff_t x = c0; copied && x < c1; x += XB) {
            const float *src = b + (x + XB <= n ? x : n - XB);
            float *dst = copy + (x - c0) * k;
            for (ptrdiff_t kk = 0; kk < k; kk++, src += n, dst += XB)
#pragma GCC unroll 4
                for (int v = 0; v < DM_PG_XV; v++)
                    *(DM_PG_VEC *)(dst + v * LANES) = *(const DM_PG_VECU *)(src + v * LANES);
        }
        for (ptrdiff_t mb = mb0; mb < mb1; mb++) {
            const ptrdiff_t nf = m - mb * DM_GEMM8_M < DM_GEMM8_M ? m - mb * DM_GEMM8_M
                                                                 : DM_GEMM8_M;
            const float *ap = packed + mb * k * DM_GEMM8_M;
            float *cb = c + mb * DM_GEMM8_M * ldc;
            const float *bb = bias ? bias + mb * DM_GEMM8_M : NULL;
            const int fetch = mb == mb0 && !copied;
            for (ptrdiff_t x = c0; x < c1; x += XB) {
                const ptrdiff_t end = c1 - x < XB ? c1 : x + XB;
                /* Vectors the block needs; the last block of b may start inside the one
                 * before, whose columns it computes again and does not store (with fewer
                 * columns than it, b is copied into a zero-padded panel from column 0). */
                const int xv = (int)((end - x + LANES - 1) / LANES);
                const ptrdiff_t width = (ptrdiff_t)xv * LANES;
                const ptrdiff_t xs = x + width <= n ? x : (n < width ? 0 : n - width);
                const float *bx = b + xs;
                ptrdiff_t ldb = n;
                if (copied) {
                    /* The copy holds the block's XB columns from x + XB <= n ? x : n - XB. */
                    bx = copy + (x - c0) * k + (xs - (x + XB <= n ? x : n - XB));
                    ldb = XB;
                }
#if DM_PG_XV > 1
                if (xv == 1) {
                    DM_PG_BLOCK(k, ap, bx, ldb, n, xs, x, end, nf, bb, act, fetch, x == c0,
                                cb, ldc, 1);
                    continue;
                }
#endif
#if DM_PG_XV > 2
                if (xv == 2) {
                    DM_PG_BLOCK(k, ap, bx, ldb, n, xs, x, end, nf, bb, act, fetch, x == c0,
                                cb, ldc, 2);
                    continue;
                }
#endif
                DM_PG_BLOCK(k, ap, bx, ldb, n, xs, x, end, nf, bb, act, fetch, x == c0, cb,
                            ldc, DM_PG_XV);
            }
            /* After the last chunk of each DM_GEMM8_TAIL_BLOCKS filter blocks, their tail
             * (their weights still in cache). */
            if (tail > 0 && c1 == xv1 &&
                ((mb - mb0 + 1) % DM_GEMM8_TAIL_BLOCKS == 0 || mb + 1 == mb1)) {
                const ptrdiff_t g0 = mb - (mb - mb0) % DM_GEMM8_TAIL_BLOCKS;
                DM_PG_TAIL(m, k, packed, b, n, bias, act, g0, mb + 1, xv1, x1, c, ldc);
            }
        }
    }
}

#undef DM_PG_BLOCK
#undef DM_PG_TAIL
#undef DM_PG_CAT
#undef DM_PG_CAT2
#undef DM_PG_NAME
#undef DM_PG_ATTR
#undef DM_PG_VEC
#undef DM_PG_VECU
#undef DM_PG_XV
#undef DM_PG_FH
#undef DM_PG_FMA
#undef DM_PG_COPY
