/* A float32 array copied and checked for NaN and infinity in one read (a batch staged where
 * a device reads it). The test is on the bits (all exponent bits set), so it vectorises and
 * no floating-point setting changes it. Where the destination is 16-byte aligned on x86-64,
 * the stores bypass the caches: the destination is written once and read by the device's
 * copy engine, and a cached store would first read every line it writes. */
#ifndef DM_COPY_FINITE_H
#define DM_COPY_FINITE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define DM_EXPONENT_BITS 0x7F800000u

/* 1 when src[0..n) holds a NaN or an infinity; dst[0..n) = src[0..n) unless dst is NULL. */
static inline int dm_copy_finite(const uint32_t *restrict src, uint32_t *restrict dst,
                                 size_t n) {
    uint32_t seen = 0;
    size_t i = 0;
#if defined(__SSE2__)
    if (dst != NULL && ((uintptr_t)dst & 15u) == 0) {
        const __m128i exponent = _mm_set1_epi32((int)DM_EXPONENT_BITS);
        __m128i bad = _mm_setzero_si128();
        for (; i + 4 <= n; i += 4) {
            __m128i v = _mm_loadu_si128((const __m128i *)(src + i));
            bad = _mm_or_si128(bad, _mm_cmpeq_epi32(_mm_and_si128(v, exponent), exponent));
            _mm_stream_si128((__m128i *)(dst + i), v);
        }
        _mm_sfence();
        seen = (uint32_t)_mm_movemask_epi8(bad) != 0;
    }
#endif
    if (dst != NULL) {
        for (; i < n; i++) {
            uint32_t v = src[i];
            dst[i] = v;
            seen |= (v & DM_EXPONENT_BITS) == DM_EXPONENT_BITS;
        }
    } else {
        for (; i < n; i++) seen |= (src[i] & DM_EXPONENT_BITS) == DM_EXPONENT_BITS;
    }
    return seen != 0;
}

#endif
