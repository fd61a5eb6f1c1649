/* Prelude of the CUDA build of the Metal kernels: the subset of the Metal Shading Language
 * (MSL) that the kernels use, as CUDA C++ for nvcc. metal2cuda.py (beside it) includes it at
 * the top of every translated .metal file.
 *
 * What it keeps from MSL, and why:
 * - vector types with MSL's sizes and alignment (float3 is 16 bytes, half4 8): the
 *   emulator's (../msl_types.h, without swizzles); CUDA's own float4/uint2... are plain
 *   structs of other sizes, so the MSL names are macros for ours;
 * - half as 16-bit storage whose arithmetic rounds every result to half, as MSL's does;
 * - math: `using namespace metal` is removed by the translator, so scalar calls bind to CUDA's
 *   precise functions (the build uses neither -use_fast_math nor contraction); what only MSL
 *   has (clamp, mix, select, fract, saturate, dot...) is defined here; `metal::` names the
 *   same functions;
 * - threadgroup_barrier is __syncthreads (which also orders device memory, where Apple's
 *   mem_threadgroup barrier does not: see the README of shim/cuda);
 * - simd_* functions are full-warp shuffles over the lanes the simdgroup has, reduced in lane
 *   order so that their results are the emulator's bits;
 * - simdgroup_float8x8: two elements per lane, multiplied with one fused multiply-add chain
 *   per element in k order, so results equal the emulator's (whose lanes hold whole tiles).
 * Nothing here allocates, prints or traps. */
#ifndef DM_METAL_CUDA_H
#define DM_METAL_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <tuple>
#include <type_traits>

#include "dmc_launch.h"

/* ---- names: MSL's vector and half types are ours, not CUDA's ---- */
#define float2 msl_float2
#define float3 msl_float3
#define float4 msl_float4
#define half2 msl_half2
#define half3 msl_half3
#define half4 msl_half4
#define int2 msl_int2
#define int3 msl_int3
#define int4 msl_int4
#define uint2 msl_uint2
#define uint3 msl_uint3
#define uint4 msl_uint4
#define short2 msl_short2
#define short3 msl_short3
#define short4 msl_short4
#define ushort2 msl_ushort2
#define ushort3 msl_ushort3
#define ushort4 msl_ushort4
#define char2 msl_char2
#define char3 msl_char3
#define char4 msl_char4
#define uchar2 msl_uchar2
#define uchar3 msl_uchar3
#define uchar4 msl_uchar4
#define long2 msl_long2
#define long3 msl_long3
#define long4 msl_long4
#define ulong2 msl_ulong2
#define ulong3 msl_ulong3
#define ulong4 msl_ulong4
#define bool2 msl_bool2
#define bool3 msl_bool3
#define bool4 msl_bool4
#define half msl_half

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

#define DMC_FN __host__ __device__ __forceinline__

/* ---- half: storage, converted with round-to-nearest-even, arithmetic rounded to half ---- */

struct msl_half {
    unsigned short bits;
    msl_half() = default;
    DMC_FN explicit msl_half(float f) : bits(from_float(f)) {}
    DMC_FN explicit msl_half(double f) : bits(from_float((float)f)) {}
    DMC_FN explicit msl_half(int i) : bits(from_float((float)i)) {}
    DMC_FN explicit msl_half(unsigned i) : bits(from_float((float)i)) {}
    DMC_FN operator float() const { return to_float(bits); }
    DMC_FN msl_half &operator=(float f) {
        bits = from_float(f);
        return *this;
    }
    DMC_FN static unsigned short from_float(float f) {
#if defined(__CUDA_ARCH__)
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
#else
        (void)f;
        return 0; /* host code never converts: kernels run on the device only */
#endif
    }
    DMC_FN static float to_float(unsigned short h) {
#if defined(__CUDA_ARCH__)
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
#else
        (void)h;
        return 0.0f;
#endif
    }
};

#define DMC_HALF_ARITH(OP)                                                             \
    DMC_FN msl_half operator OP(msl_half a, msl_half b) {                              \
        return msl_half(float(a) OP float(b));                                         \
    }                                                                                  \
    DMC_FN msl_half &operator OP##=(msl_half &a, msl_half b) {                         \
        a = msl_half(float(a) OP float(b));                                            \
        return a;                                                                      \
    }
DMC_HALF_ARITH(+)
DMC_HALF_ARITH(-)
DMC_HALF_ARITH(*)
DMC_HALF_ARITH(/)
#undef DMC_HALF_ARITH
DMC_FN msl_half operator-(msl_half a) { return msl_half(-float(a)); }

namespace msl {

/* The vector types (../msl_types.h), without swizzles (the kernels use none). */
#define MSL_VEC_FN DMC_FN
#define MSL_UNROLL _Pragma("unroll")
#define MSL_HALF msl_half
#define MSL_HAS_SWIZZLES 0
#define MSL_SWIZZLES_2(T)
#define MSL_SWIZZLES_3(T)
#define MSL_SWIZZLES_4(T)
#include "../msl_types.h"

}  // namespace msl

#define DMC_VEC_TYPES(T, NAME)                                                         \
    typedef msl::vec<T, 2> msl_##NAME##2;                                              \
    typedef msl::vec<T, 3> msl_##NAME##3;                                              \
    typedef msl::vec<T, 4> msl_##NAME##4;
MSL_VECTOR_TYPES(DMC_VEC_TYPES, msl_half)
#undef DMC_VEC_TYPES

#undef FLT_MAX
#undef FLT_MIN
#undef FLT_EPSILON
#undef MAXFLOAT
#define FLT_MAX 0x1.fffffep127f
#define FLT_MIN 0x1p-126f
#define FLT_EPSILON 0x1p-23f
#define MAXFLOAT FLT_MAX
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_E_F 2.71828182845904523536f
#define M_LN2_F 0.693147180559945309417f
#define M_LOG2E_F 1.44269504088896340736f
#define M_SQRT2_F 1.41421356237309504880f

/* ---- functions MSL has and CUDA's math library does not (or not for these types) ---- */

namespace msl {

template <class To, class From>
DMC_FN To as_type(const From &f) {
    return bit_cast<To>(f);
}

DMC_FN float fract(float x) { return x - floorf(x); }
DMC_FN float saturate(float x) { return fminf(fmaxf(x, 0.0f), 1.0f); }
DMC_FN float sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }
DMC_FN float step(float edge, float x) { return x < edge ? 0.0f : 1.0f; }
DMC_FN float mix(float x, float y, float a) { return x + (y - x) * a; }
DMC_FN float clamp(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }
DMC_FN int clamp(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }
DMC_FN uint clamp(uint x, uint lo, uint hi) { return x < lo ? lo : (x > hi ? hi : x); }
DMC_FN float powr(float x, float y) { return powf(x, y); }
DMC_FN float exp10(float x) { return powf(10.0f, x); }
DMC_FN float divide(float x, float y) { return x / y; }

template <class T, std::enable_if_t<is_num<T>, int> = 0>
DMC_FN T select(T a, T b, bool c) {
    return c ? b : a;
}
template <class A, class B, class C, std::enable_if_t<any_vec3<A, B, C>, int> = 0>
DMC_FN auto select(const A &a, const B &b, const C &c) {
    return map3(a, b, c, [](auto x, auto y, auto z) { return z ? y : x; });
}
template <int N>
DMC_FN bool all(const vec<bool, N> &b) {
    for (int i = 0; i < N; ++i)
        if (!b.v[i]) return false;
    return true;
}
template <int N>
DMC_FN bool any(const vec<bool, N> &b) {
    for (int i = 0; i < N; ++i)
        if (b.v[i]) return true;
    return false;
}

template <class A, class B, std::enable_if_t<is_vec<A> && is_vec<B>, int> = 0>
DMC_FN auto dot(const A &a, const B &b) {
    using T = typename vtraits<A>::elem;
    T s = T(0);
#pragma unroll
    for (int i = 0; i < vtraits<A>::n; ++i) s += T(a.v[i] * b.v[i]);
    return s;
}
template <class A, std::enable_if_t<is_vec<A>, int> = 0>
DMC_FN auto length(const A &a) {
    return sqrtf(dot(a, a));
}

/* Vector forms of the scalar functions, component-wise. */
#define DMC_VEC_UNARY(NAME, SCALAR)                                                    \
    template <class A, std::enable_if_t<is_vec<A>, int> = 0>                           \
    DMC_FN auto NAME(const A &a) {                                                     \
        return map1(a, [](auto x) { return SCALAR(x); });                              \
    }
#define DMC_VEC_BINARY(NAME, SCALAR)                                                   \
    template <class A, class B, std::enable_if_t<bin_ok<A, B>, int> = 0>               \
    DMC_FN auto NAME(const A &a, const B &b) {                                         \
        return map2(a, b, [](auto x, auto y) { return SCALAR(x, y); });                \
    }
DMC_VEC_UNARY(exp, expf)
DMC_VEC_UNARY(log, logf)
DMC_VEC_UNARY(sqrt, sqrtf)
DMC_VEC_UNARY(floor, floorf)
DMC_VEC_UNARY(ceil, ceilf)
DMC_VEC_UNARY(fabs, fabsf)
DMC_VEC_UNARY(round, roundf)
DMC_VEC_UNARY(tanh, tanhf)
DMC_VEC_BINARY(fmax, fmaxf)
DMC_VEC_BINARY(fmin, fminf)
DMC_VEC_BINARY(pow, powf)
DMC_VEC_BINARY(max, ::max)
DMC_VEC_BINARY(min, ::min)
#undef DMC_VEC_UNARY
#undef DMC_VEC_BINARY

template <class A, class B, class C, std::enable_if_t<any_vec3<A, B, C>, int> = 0>
DMC_FN auto clamp(const A &a, const B &b, const C &c) {
    return map3(a, b, c, [](auto x, auto lo, auto hi) { return clamp(x, lo, hi); });
}
template <class A, class B, class C, std::enable_if_t<any_vec3<A, B, C>, int> = 0>
DMC_FN auto fma(const A &a, const B &b, const C &c) {
    return map3(a, b, c, [](auto x, auto y, auto z) { return fmaf(x, y, z); });
}
template <class A, class B, class C, std::enable_if_t<any_vec3<A, B, C>, int> = 0>
DMC_FN auto mix(const A &a, const B &b, const C &c) {
    return map3(a, b, c, [](auto x, auto y, auto z) { return mix(x, y, z); });
}

/* ---- synchronisation ---- */

#define MSL_SYNC_FN DMC_FN
#include "../msl_sync.h"

__device__ __forceinline__ void threadgroup_barrier(mem_flags) { __syncthreads(); }

/* ---- atomics (relaxed) on int, uint and float ---- */

template <class T>
__device__ __forceinline__ T atomic_load_explicit(const volatile atomic<T> *a, memory_order) {
    return a->value_;
}
template <class T, class U>
__device__ __forceinline__ void atomic_store_explicit(volatile atomic<T> *a, U v, memory_order) {
    a->value_ = T(v);
}
template <class T, class U>
__device__ __forceinline__ T atomic_fetch_add_explicit(volatile atomic<T> *a, U v, memory_order) {
    return atomicAdd((T *)&a->value_, T(v));
}
template <class T, class U>
__device__ __forceinline__ T atomic_fetch_sub_explicit(volatile atomic<T> *a, U v, memory_order) {
    return atomicAdd((T *)&a->value_, T(-T(v)));
}
template <class T, class U>
__device__ __forceinline__ T atomic_fetch_max_explicit(volatile atomic<T> *a, U v, memory_order) {
    return atomicMax((T *)&a->value_, T(v));
}
template <class T, class U>
__device__ __forceinline__ T atomic_fetch_min_explicit(volatile atomic<T> *a, U v, memory_order) {
    return atomicMin((T *)&a->value_, T(v));
}
template <class T, class U>
__device__ __forceinline__ T atomic_exchange_explicit(volatile atomic<T> *a, U v, memory_order) {
    return atomicExch((T *)&a->value_, T(v));
}

}  // namespace msl

/* ---- the launch: built-ins of one thread, from the block and the dispatch ---- */

#define DMC_SIMD_WIDTH 32

struct dmc_thread {
    uint3 tpig, tpitg, tgpig, tptg, dtptg, tpg, tgpg;
    uint32_t tiitg, tiisg, sgitg, sgptg, tpsg;
};

extern __shared__ __align__(16) unsigned char dmc_tg_dynamic[];

/* Built-ins of this thread; false when it lies outside the grid (Metal starts no such
 * thread; only kernels without barriers or simd functions are launched with them). */
__device__ __forceinline__ bool dmc_enter(const dmc_launch &L, dmc_thread &t) {
    t.tgpg = uint3(L.tgpg[0], L.tgpg[1], L.tgpg[2]);
    if (L.order == DMC_ORDER_GRID) {
        t.tgpig = uint3(blockIdx.x, blockIdx.y, blockIdx.z);
    } else {
        const uint32_t n_groups = L.tgpg[0] * L.tgpg[1] * L.tgpg[2];
        uint32_t g = blockIdx.x;
        if (L.order == 1) g = n_groups - 1u - g;
        else if (L.order == 2) g = (uint32_t)((L.offset + (uint64_t)L.stride * g) % n_groups);
        t.tgpig = uint3(g % L.tgpg[0], (g / L.tgpg[0]) % L.tgpg[1], g / (L.tgpg[0] * L.tgpg[1]));
    }
    t.dtptg = uint3(L.dtptg[0], L.dtptg[1], L.dtptg[2]);
    t.tpg = uint3(L.tpg[0], L.tpg[1], L.tpg[2]);
    t.tpitg = uint3(threadIdx.x, threadIdx.y, threadIdx.z);
    t.tpig = t.tgpig * t.dtptg + t.tpitg;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
        uint32_t left = t.tpg.v[i] - t.tgpig.v[i] * t.dtptg.v[i];
        t.tptg.v[i] = left < t.dtptg.v[i] ? left : t.dtptg.v[i];
        if (t.tpitg.v[i] >= t.tptg.v[i]) return false;
    }
    const uint32_t n = t.tptg.x * t.tptg.y * t.tptg.z;
    t.tiitg = t.tpitg.x + t.tptg.x * (t.tpitg.y + t.tptg.y * t.tpitg.z);
    t.sgitg = t.tiitg / DMC_SIMD_WIDTH;
    t.tiisg = t.tiitg % DMC_SIMD_WIDTH;
    t.sgptg = (n + DMC_SIMD_WIDTH - 1) / DMC_SIMD_WIDTH;
    t.tpsg = t.sgitg + 1 == t.sgptg ? n - t.sgitg * DMC_SIMD_WIDTH : DMC_SIMD_WIDTH;
    return true;
}

namespace msl {

/* ---- simd-group functions over the lanes the simdgroup has ---- */

__device__ __forceinline__ unsigned simd_mask() {
    const unsigned n = blockDim.x * blockDim.y * blockDim.z;
    const unsigned linear = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned first = linear / 32u * 32u;
    const unsigned lanes = n - first < 32u ? n - first : 32u;
    return lanes == 32u ? 0xffffffffu : (1u << lanes) - 1u;
}
__device__ __forceinline__ unsigned simd_lanes() { return __popc(simd_mask()); }

/* Any value, moved word by word (the shuffles move 32 bits). */
template <class T>
__device__ __forceinline__ T shuffle_any(unsigned mask, const T &v, int lane) {
    constexpr int W = (sizeof(T) + 3) / 4;
    uint32_t in[W] = {}, out[W];
    memcpy(in, &v, sizeof(T));
#pragma unroll
    for (int w = 0; w < W; ++w) out[w] = __shfl_sync(mask, in[w], lane);
    T r;
    memcpy(&r, out, sizeof(T));
    return r;
}

/* Reductions fold lanes 0, 1, 2... in order, as the emulator does, so bits agree. */
template <class T, class F>
__device__ __forceinline__ T simd_fold(T v, F f) {
    const unsigned mask = simd_mask(), n = __popc(mask);
    T acc = shuffle_any(mask, v, 0);
    for (unsigned i = 1; i < n; ++i) acc = f(acc, shuffle_any(mask, v, (int)i));
    return acc;
}
template <class T>
__device__ __forceinline__ T simd_sum(T v) {
    return simd_fold(v, [](T a, T b) { return T(a + b); });
}
template <class T>
__device__ __forceinline__ T simd_product(T v) {
    return simd_fold(v, [](T a, T b) { return T(a * b); });
}
template <class T>
__device__ __forceinline__ T simd_max(T v) {
    return simd_fold(v, [](T a, T b) { return T(a > b ? a : b); });
}
template <class T>
__device__ __forceinline__ T simd_min(T v) {
    return simd_fold(v, [](T a, T b) { return T(a < b ? a : b); });
}
template <class T>
__device__ __forceinline__ T simd_and(T v) {
    return simd_fold(v, [](T a, T b) { return T(a & b); });
}
template <class T>
__device__ __forceinline__ T simd_or(T v) {
    return simd_fold(v, [](T a, T b) { return T(a | b); });
}
template <class T>
__device__ __forceinline__ T simd_xor(T v) {
    return simd_fold(v, [](T a, T b) { return T(a ^ b); });
}
template <class T, bool Inclusive, bool Sum>
__device__ __forceinline__ T simd_prefix(T v) {
    const unsigned mask = simd_mask(), n = __popc(mask);
    const unsigned me = (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32u;
    T acc = T(Sum ? 0 : 1);
    for (unsigned i = 0; i < n; ++i) {
        T x = shuffle_any(mask, v, (int)i);
        if (i < me || (Inclusive && i == me)) acc = Sum ? T(acc + x) : T(acc * x);
    }
    return acc;
}
template <class T>
__device__ __forceinline__ T simd_prefix_exclusive_sum(T v) { return simd_prefix<T, false, true>(v); }
template <class T>
__device__ __forceinline__ T simd_prefix_inclusive_sum(T v) { return simd_prefix<T, true, true>(v); }
template <class T>
__device__ __forceinline__ T simd_prefix_exclusive_product(T v) { return simd_prefix<T, false, false>(v); }
template <class T>
__device__ __forceinline__ T simd_prefix_inclusive_product(T v) { return simd_prefix<T, true, false>(v); }

/* Shuffles: a lane that would read outside the simdgroup keeps its own value. */
__device__ __forceinline__ unsigned simd_lane_id() {
    return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32u;
}
template <class T>
__device__ __forceinline__ T simd_pick(const T &v, unsigned from) {
    const unsigned mask = simd_mask(), n = __popc(mask);
    return shuffle_any(mask, v, (int)(from < n ? from : simd_lane_id()));
}
template <class T>
__device__ __forceinline__ T simd_shuffle(T v, ushort lane) { return simd_pick(v, lane); }
template <class T>
__device__ __forceinline__ T simd_broadcast(T v, ushort lane) { return simd_pick(v, lane); }
template <class T>
__device__ __forceinline__ T simd_broadcast_first(T v) { return simd_pick(v, 0u); }
template <class T>
__device__ __forceinline__ T simd_shuffle_down(T v, ushort delta) {
    return simd_pick(v, simd_lane_id() + delta);
}
template <class T>
__device__ __forceinline__ T simd_shuffle_up(T v, ushort delta) {
    const unsigned me = simd_lane_id();
    return simd_pick(v, delta <= me ? me - delta : 64u);
}
template <class T>
__device__ __forceinline__ T simd_shuffle_xor(T v, ushort m) { return simd_pick(v, simd_lane_id() ^ m); }
__device__ __forceinline__ bool simd_all(bool b) { return __all_sync(simd_mask(), b); }
__device__ __forceinline__ bool simd_any(bool b) { return __any_sync(simd_mask(), b); }
__device__ __forceinline__ void simdgroup_barrier(mem_flags) { __syncwarp(simd_mask()); }
__device__ __forceinline__ bool simd_is_first() { return simd_lane_id() == 0u; }

/* ---- simdgroup matrices: 8x8, lane l holds elements 2l and 2l+1 of the row-major tile ----
 * A product reads its row of A and its two columns of B from the other lanes by shuffles and
 * computes each element as one fused multiply-add chain over k in order, from C's element:
 * the emulator's arithmetic (where every lane holds the whole tile), so the bits agree. All
 * 32 lanes of the simdgroup take part, as on Apple GPUs. */

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
    static_assert(Cols == 8 && Rows == 8, "only 8x8 simdgroup matrices");
    T e[2];
    simdgroup_matrix() = default;
    /* MSL: a diagonal matrix with d on the diagonal. */
    __device__ explicit simdgroup_matrix(T d) {
        const unsigned first = 2u * simd_lane_id();
#pragma unroll
        for (int j = 0; j < 2; ++j) e[j] = (first + j) / 8u == (first + j) % 8u ? d : T(0);
    }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<msl_half, 8, 8> simdgroup_half8x8;

template <class T, int Cols, int Rows>
__device__ __forceinline__ simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
    simdgroup_matrix<T, Cols, Rows> m;
    m.e[0] = value;
    m.e[1] = value;
    return m;
}
/* Element (r, c) comes from src[(origin.y + r) * elements_per_row + origin.x + c]; with
 * transpose the tile read is the transpose of that. */
template <class T, int Cols, int Rows, class U>
__device__ __forceinline__ void simdgroup_load(simdgroup_matrix<T, Cols, Rows> &d, const U *src,
                                               ulong elements_per_row = Cols,
                                               ulong2 matrix_origin = ulong2(0),
                                               bool transpose_matrix = false) {
    const U *base = src + matrix_origin.y * elements_per_row + matrix_origin.x;
    const unsigned first = 2u * simd_lane_id();
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const ulong r = (first + j) / 8u, c = (first + j) % 8u;
        d.e[j] = T(transpose_matrix ? base[c * elements_per_row + r] : base[r * elements_per_row + c]);
    }
}
template <class T, int Cols, int Rows, class U>
__device__ __forceinline__ void simdgroup_store(const simdgroup_matrix<T, Cols, Rows> &a, U *dst,
                                                ulong elements_per_row = Cols,
                                                ulong2 matrix_origin = ulong2(0),
                                                bool transpose_matrix = false) {
    U *base = dst + matrix_origin.y * elements_per_row + matrix_origin.x;
    const unsigned first = 2u * simd_lane_id();
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const ulong r = (first + j) / 8u, c = (first + j) % 8u;
        if (transpose_matrix) base[c * elements_per_row + r] = U(a.e[j]);
        else base[r * elements_per_row + c] = U(a.e[j]);
    }
}
template <class T, int K, int M, int N>
__device__ __forceinline__ void simdgroup_multiply_accumulate(simdgroup_matrix<T, N, M> &d,
                                                              const simdgroup_matrix<T, K, M> &a,
                                                              const simdgroup_matrix<T, N, K> &b,
                                                              const simdgroup_matrix<T, N, M> &c) {
    const unsigned lane = simd_lane_id(), row = lane / 4u, pair = lane % 4u;
    float acc0 = float(c.e[0]), acc1 = float(c.e[1]);
#pragma unroll
    for (unsigned k = 0; k < 8u; ++k) {
        /* A(row, k) lives in lane (8 row + k) / 2, slot k % 2; B(k, 2 pair + j) in lane
         * 4 k + pair, slot j. The slots are the same on every lane, as shuffles need. */
        const float ak = __shfl_sync(0xffffffffu, float(a.e[k % 2u]), (int)((8u * row + k) / 2u));
        const float b0 = __shfl_sync(0xffffffffu, float(b.e[0]), (int)(4u * k + pair));
        const float b1 = __shfl_sync(0xffffffffu, float(b.e[1]), (int)(4u * k + pair));
        acc0 = fmaf(ak, b0, acc0);
        acc1 = fmaf(ak, b1, acc1);
    }
    d.e[0] = T(acc0);
    d.e[1] = T(acc1);
}
template <class T, int K, int M, int N>
__device__ __forceinline__ void simdgroup_multiply(simdgroup_matrix<T, N, M> &d,
                                                   const simdgroup_matrix<T, K, M> &a,
                                                   const simdgroup_matrix<T, N, K> &b) {
    simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, N, M>(T(0)));
}

/* ---- glue of the generated entry points ---- */

#define MSL_GLUE_FN __device__ __forceinline__
#include "../msl_glue.h"
#undef MSL_GLUE_FN

}  // namespace msl

/* MSL spells these without a namespace once `using namespace metal` is gone; CUDA's scalar
 * functions keep precedence for scalars because theirs are exact matches. */
using msl::as_type;
using msl::clamp;
using msl::dot;
using msl::fract;
using msl::length;
using msl::mem_flags;
using msl::mix;
using msl::saturate;
using msl::select;
using msl::sign;
using msl::step;
using msl::threadgroup_barrier;
using msl::simdgroup_barrier;
using msl::simd_sum;
using msl::simd_product;
using msl::simd_max;
using msl::simd_min;
using msl::simd_and;
using msl::simd_or;
using msl::simd_xor;
using msl::simd_prefix_exclusive_sum;
using msl::simd_prefix_inclusive_sum;
using msl::simd_prefix_exclusive_product;
using msl::simd_prefix_inclusive_product;
using msl::simd_shuffle;
using msl::simd_broadcast;
using msl::simd_broadcast_first;
using msl::simd_shuffle_down;
using msl::simd_shuffle_up;
using msl::simd_shuffle_xor;
using msl::simd_all;
using msl::simd_any;
using msl::simd_is_first;
using msl::simdgroup_matrix;
using msl::simdgroup_float8x8;
using msl::simdgroup_half8x8;
using msl::make_filled_simdgroup_matrix;
using msl::simdgroup_load;
using msl::simdgroup_store;
using msl::simdgroup_multiply_accumulate;
using msl::simdgroup_multiply;
using msl::atomic_int;
using msl::atomic_uint;
using msl::atomic_float;
using msl::memory_order_relaxed;
using msl::atomic_load_explicit;
using msl::atomic_store_explicit;
using msl::atomic_fetch_add_explicit;
using msl::atomic_fetch_sub_explicit;
using msl::atomic_fetch_max_explicit;
using msl::atomic_fetch_min_explicit;
using msl::atomic_exchange_explicit;

/* `metal::name` and `metal::precise::name`: the same functions. */
namespace metal {
using ::exp; using ::exp2; using ::log; using ::log2; using ::log10; using ::pow; using ::sqrt;
using ::sin; using ::cos; using ::tan; using ::tanh; using ::floor; using ::ceil; using ::round;
using ::rint; using ::trunc; using ::fabs; using ::fmax; using ::fmin; using ::fma; using ::fmod;
using ::max; using ::min; using ::abs; using ::isnan; using ::isinf; using ::isfinite;
using ::atan2; using ::copysign;
using msl::clamp; using msl::mix; using msl::select; using msl::dot; using msl::fract;
using msl::saturate; using ::rsqrt; using msl::sign; using msl::step; using msl::as_type;
using msl::powr; using msl::exp10; using msl::divide; using msl::length;
namespace precise {
using namespace ::metal;
}
namespace fast {
using namespace ::metal;
}
}  // namespace metal

#endif
