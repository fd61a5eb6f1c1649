/* Prelude of the Metal compute emulator: the subset of the Metal Shading Language (MSL) that
 * hand-written compute kernels use, as C++17 for g++/clang. metal2cpp.py (beside it) includes
 * it at the top of every rewritten .metal file.
 *
 * Sizes and alignment follow MSL: float3 is 16 bytes (same as float4), half is _Float16,
 * packed_float3 is 12 bytes; the vector types are shared with CUDA's prelude
 * (../msl_types.h), with the swizzles (.xy, .zyx) added here. Functions that need other
 * threads (barriers, simd collectives) call into the runtime (emu_abi.h), which runs the
 * threads of a group as fibers. */
#ifndef DM_METAL_EMU_H
#define DM_METAL_EMU_H

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "emu_abi.h"

typedef _Float16 half;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

namespace emu {

template <class T, int N>
struct vec;

/* A swizzle such as .xy or .zyx: a view of the storage of its vector, living in the vector's
 * union, readable as a vector and assignable when its components are distinct. */
template <class T, int N, int... I>
struct swz {
    T d[N == 3 ? 4 : N];
    static constexpr int M = sizeof...(I);
    using V = vec<T, M>;
    operator V() const { return V(d[I]...); }
    swz &operator=(const V &v) {
        const int idx[] = {I...};
        for (int k = 0; k < M; ++k) d[idx[k]] = v.v[k];
        return *this;
    }
    swz &operator=(const swz &o) { return *this = V(o); }
    T operator[](int k) const {
        const int idx[] = {I...};
        return d[idx[k]];
    }
    template <class B>
    swz &operator+=(const B &b) { return *this = V(*this) + b; }
    template <class B>
    swz &operator-=(const B &b) { return *this = V(*this) - b; }
    template <class B>
    swz &operator*=(const B &b) { return *this = V(*this) * b; }
    template <class B>
    swz &operator/=(const B &b) { return *this = V(*this) / b; }
};

/* The vector types (../msl_types.h), their storage holding the swizzles as views. */
#define MSL_VEC_FN inline
#define MSL_UNROLL
#define MSL_HALF _Float16
#define MSL_HAS_SWIZZLES 1
#define MSL_SWIZZLES_2(T)                                                               \
    swz<T, 2, 0, 0> xx; swz<T, 2, 0, 1> xy; swz<T, 2, 1, 0> yx; swz<T, 2, 1, 1> yy;     \
    swz<T, 2, 0, 0, 0> xxx; swz<T, 2, 0, 0, 1> xxy; swz<T, 2, 0, 1, 0> xyx;             \
    swz<T, 2, 0, 1, 1> xyy; swz<T, 2, 1, 0, 0> yxx; swz<T, 2, 1, 0, 1> yxy;             \
    swz<T, 2, 1, 1, 0> yyx; swz<T, 2, 1, 1, 1> yyy; swz<T, 2, 0, 0, 0, 0> xxxx;         \
    swz<T, 2, 1, 1, 1, 1> yyyy;
#define MSL_SWIZZLES_3(T)                                                               \
    swz<T, 3, 0, 0> xx; swz<T, 3, 0, 1> xy; swz<T, 3, 0, 2> xz; swz<T, 3, 1, 0> yx;     \
    swz<T, 3, 1, 1> yy; swz<T, 3, 1, 2> yz; swz<T, 3, 2, 0> zx; swz<T, 3, 2, 1> zy;     \
    swz<T, 3, 2, 2> zz; swz<T, 3, 0, 0, 0> xxx; swz<T, 3, 0, 0, 1> xxy;                 \
    swz<T, 3, 0, 0, 2> xxz; swz<T, 3, 0, 1, 0> xyx; swz<T, 3, 0, 1, 1> xyy;             \
    swz<T, 3, 0, 1, 2> xyz; swz<T, 3, 0, 2, 0> xzx; swz<T, 3, 0, 2, 1> xzy;             \
    swz<T, 3, 0, 2, 2> xzz; swz<T, 3, 1, 0, 0> yxx; swz<T, 3, 1, 0, 1> yxy;             \
    swz<T, 3, 1, 0, 2> yxz; swz<T, 3, 1, 1, 0> yyx; swz<T, 3, 1, 1, 1> yyy;             \
    swz<T, 3, 1, 1, 2> yyz; swz<T, 3, 1, 2, 0> yzx; swz<T, 3, 1, 2, 1> yzy;             \
    swz<T, 3, 1, 2, 2> yzz; swz<T, 3, 2, 0, 0> zxx; swz<T, 3, 2, 0, 1> zxy;             \
    swz<T, 3, 2, 0, 2> zxz; swz<T, 3, 2, 1, 0> zyx; swz<T, 3, 2, 1, 1> zyy;             \
    swz<T, 3, 2, 1, 2> zyz; swz<T, 3, 2, 2, 0> zzx; swz<T, 3, 2, 2, 1> zzy;             \
    swz<T, 3, 2, 2, 2> zzz; swz<T, 3, 0, 0, 0, 0> xxxx; swz<T, 3, 1, 1, 1, 1> yyyy;     \
    swz<T, 3, 2, 2, 2, 2> zzzz;
#define MSL_SWIZZLES_4(T)                                                               \
    swz<T, 4, 0, 0> xx; swz<T, 4, 0, 1> xy; swz<T, 4, 0, 2> xz; swz<T, 4, 0, 3> xw;     \
    swz<T, 4, 1, 0> yx; swz<T, 4, 1, 1> yy; swz<T, 4, 1, 2> yz; swz<T, 4, 1, 3> yw;     \
    swz<T, 4, 2, 0> zx; swz<T, 4, 2, 1> zy; swz<T, 4, 2, 2> zz; swz<T, 4, 2, 3> zw;     \
    swz<T, 4, 3, 0> wx; swz<T, 4, 3, 1> wy; swz<T, 4, 3, 2> wz; swz<T, 4, 3, 3> ww;     \
    swz<T, 4, 0, 0, 0> xxx; swz<T, 4, 0, 1, 2> xyz; swz<T, 4, 0, 1, 3> xyw;             \
    swz<T, 4, 0, 2, 1> xzy; swz<T, 4, 0, 2, 3> xzw; swz<T, 4, 0, 3, 1> xwy;             \
    swz<T, 4, 0, 3, 2> xwz; swz<T, 4, 1, 0, 2> yxz; swz<T, 4, 1, 0, 3> yxw;             \
    swz<T, 4, 1, 1, 1> yyy; swz<T, 4, 1, 2, 0> yzx; swz<T, 4, 1, 2, 3> yzw;             \
    swz<T, 4, 1, 3, 0> ywx; swz<T, 4, 1, 3, 2> ywz; swz<T, 4, 2, 0, 1> zxy;             \
    swz<T, 4, 2, 0, 3> zxw; swz<T, 4, 2, 1, 0> zyx; swz<T, 4, 2, 1, 3> zyw;             \
    swz<T, 4, 2, 2, 2> zzz; swz<T, 4, 2, 3, 0> zwx; swz<T, 4, 2, 3, 1> zwy;             \
    swz<T, 4, 3, 0, 1> wxy; swz<T, 4, 3, 0, 2> wxz; swz<T, 4, 3, 1, 0> wyx;             \
    swz<T, 4, 3, 1, 2> wyz; swz<T, 4, 3, 2, 0> wzx; swz<T, 4, 3, 2, 1> wzy;             \
    swz<T, 4, 3, 3, 3> www; swz<T, 4, 0, 0, 0, 0> xxxx; swz<T, 4, 0, 1, 2, 3> xyzw;     \
    swz<T, 4, 1, 1, 1, 1> yyyy; swz<T, 4, 2, 2, 2, 2> zzzz;                             \
    swz<T, 4, 3, 2, 1, 0> wzyx; swz<T, 4, 3, 3, 3, 3> wwww;
#include "../msl_types.h"

template <class T, int N, int... I>
struct vtraits<swz<T, N, I...>> {
    static constexpr bool is_vec = true;
    static constexpr int n = sizeof...(I);
    using elem = T;
};

/* A vector stored without padding (packed_float3 is 12 bytes, 4-byte aligned). */
template <class T, int N>
struct packed_vec;

#define EMU_PACKED_BODY(N)                                                             \
    packed_vec() = default;                                                            \
    packed_vec(const vec<T, N> &o) {                                                   \
        for (int i = 0; i < N; ++i) v[i] = o.v[i];                                     \
    }                                                                                  \
    template <class... A, std::enable_if_t<(sizeof...(A) >= 2), int> = 0>              \
    packed_vec(const A &...a) : packed_vec(vec<T, N>(a...)) {}                         \
    operator vec<T, N>() const {                                                       \
        vec<T, N> r;                                                                   \
        for (int i = 0; i < N; ++i) r.v[i] = v[i];                                     \
        return r;                                                                      \
    }                                                                                  \
    T &operator[](int i) { return v[i]; }                                              \
    const T &operator[](int i) const { return v[i]; }

template <class T>
struct packed_vec<T, 2> {
    union {
        T v[2];
        struct {
            T x, y;
        };
    };
    EMU_PACKED_BODY(2)
};
template <class T>
struct packed_vec<T, 3> {
    union {
        T v[3];
        struct {
            T x, y, z;
        };
    };
    EMU_PACKED_BODY(3)
};
template <class T>
struct packed_vec<T, 4> {
    union {
        T v[4];
        struct {
            T x, y, z, w;
        };
    };
    EMU_PACKED_BODY(4)
};
#undef EMU_PACKED_BODY

template <class T, int N>
struct vtraits<packed_vec<T, N>> {
    static constexpr bool is_vec = true;
    static constexpr int n = N;
    using elem = T;
};

}  // namespace emu

#define EMU_VEC_TYPES(T, NAME)                                                         \
    typedef emu::vec<T, 2> NAME##2;                                                    \
    typedef emu::vec<T, 3> NAME##3;                                                    \
    typedef emu::vec<T, 4> NAME##4;                                                    \
    typedef emu::packed_vec<T, 2> packed_##NAME##2;                                    \
    typedef emu::packed_vec<T, 3> packed_##NAME##3;                                    \
    typedef emu::packed_vec<T, 4> packed_##NAME##4;
MSL_VECTOR_TYPES(EMU_VEC_TYPES, half)
#undef EMU_VEC_TYPES

static_assert(sizeof(packed_float3) == 12 && alignof(packed_float3) == 4, "packed_float3");

#define FLT_MAX 0x1.fffffep127f
#define FLT_MIN 0x1p-126f
#define FLT_EPSILON 0x1p-23f
#define HALF_MAX ((half)65504.0f)
#define MAXFLOAT FLT_MAX
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define HUGE_VALF __builtin_huge_valf()
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_E_F 2.71828182845904523536f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_LOG2E_F 1.44269504088896340736f
#define M_SQRT2_F 1.41421356237309504880f
#define M_1_SQRT2_F 0.707106781186547524401f
#define INT_MAX 2147483647
#define INT_MIN (-2147483647 - 1)
#define UINT_MAX 4294967295u

namespace metal {

using ::half;

template <class T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
    static constexpr float max() { return FLT_MAX; }
    static constexpr float min() { return FLT_MIN; }
    static constexpr float lowest() { return -FLT_MAX; }
    static constexpr float epsilon() { return FLT_EPSILON; }
    static constexpr float infinity() { return __builtin_inff(); }
    static constexpr float quiet_NaN() { return __builtin_nanf(""); }
};
template <>
struct numeric_limits<half> {
    static constexpr half max() { return (half)65504.0f; }
    static constexpr half min() { return (half)0x1p-14f; }
    static constexpr half lowest() { return (half)-65504.0f; }
    static constexpr half epsilon() { return (half)0x1p-10f; }
    static constexpr half infinity() { return (half)__builtin_inff(); }
    static constexpr half quiet_NaN() { return (half)__builtin_nanf(""); }
};
template <>
struct numeric_limits<int> {
    static constexpr int max() { return INT_MAX; }
    static constexpr int min() { return INT_MIN; }
    static constexpr int lowest() { return INT_MIN; }
};
template <>
struct numeric_limits<uint> {
    static constexpr uint max() { return UINT_MAX; }
    static constexpr uint min() { return 0u; }
    static constexpr uint lowest() { return 0u; }
};

template <class To, class From>
inline To as_type(const From &f) {
    return emu::bit_cast<To>(f);
}

/* ---- math: scalar float/half overloads, vectors component-wise ---- */

#define EMU_UNARY(NAME, EXPR)                                                          \
    inline float NAME(float x) { return EXPR; }                                        \
    inline half NAME(half h) { return (half)NAME((float)h); }                          \
    template <class A, std::enable_if_t<emu::is_vec<A>, int> = 0>                      \
    inline auto NAME(const A &a) {                                                     \
        return emu::map1(a, [](auto x) { return NAME(x); });                           \
    }
EMU_UNARY(exp, __builtin_expf(x))
EMU_UNARY(exp2, __builtin_exp2f(x))
EMU_UNARY(exp10, __builtin_powf(10.0f, x))
EMU_UNARY(log, __builtin_logf(x))
EMU_UNARY(log2, __builtin_log2f(x))
EMU_UNARY(log10, __builtin_log10f(x))
EMU_UNARY(sqrt, __builtin_sqrtf(x))
EMU_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
EMU_UNARY(sin, __builtin_sinf(x))
EMU_UNARY(cos, __builtin_cosf(x))
EMU_UNARY(tan, __builtin_tanf(x))
EMU_UNARY(asin, __builtin_asinf(x))
EMU_UNARY(acos, __builtin_acosf(x))
EMU_UNARY(atan, __builtin_atanf(x))
EMU_UNARY(sinh, __builtin_sinhf(x))
EMU_UNARY(cosh, __builtin_coshf(x))
EMU_UNARY(tanh, __builtin_tanhf(x))
EMU_UNARY(asinh, __builtin_asinhf(x))
EMU_UNARY(acosh, __builtin_acoshf(x))
EMU_UNARY(atanh, __builtin_atanhf(x))
EMU_UNARY(floor, __builtin_floorf(x))
EMU_UNARY(ceil, __builtin_ceilf(x))
EMU_UNARY(round, __builtin_roundf(x))
EMU_UNARY(rint, __builtin_rintf(x))
EMU_UNARY(trunc, __builtin_truncf(x))
EMU_UNARY(fabs, __builtin_fabsf(x))
EMU_UNARY(fract, x - __builtin_floorf(x))
EMU_UNARY(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
EMU_UNARY(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? 0.0f : 0.0f)))
#undef EMU_UNARY

#define EMU_BINARY(NAME, EXPR)                                                         \
    inline float NAME(float x, float y) { return EXPR; }                               \
    inline half NAME(half a, half b) { return (half)NAME((float)a, (float)b); }         \
    template <class A, class B, std::enable_if_t<emu::bin_ok<A, B>, int> = 0>          \
    inline auto NAME(const A &a, const B &b) {                                         \
        return emu::map2(a, b, [](auto x, auto y) { return NAME(x, y); });             \
    }
EMU_BINARY(pow, __builtin_powf(x, y))
EMU_BINARY(powr, __builtin_powf(x, y))
EMU_BINARY(fmod, __builtin_fmodf(x, y))
EMU_BINARY(atan2, __builtin_atan2f(x, y))
EMU_BINARY(fmax, __builtin_fmaxf(x, y))
EMU_BINARY(fmin, __builtin_fminf(x, y))
EMU_BINARY(copysign, __builtin_copysignf(x, y))
EMU_BINARY(step, y < x ? 0.0f : 1.0f)
EMU_BINARY(divide, x / y)
#undef EMU_BINARY

/* max/min/clamp/abs also exist for integers; MSL requires both operands of one type. */
template <class T, std::enable_if_t<emu::is_num<T>, int> = 0>
inline T max(T a, T b) {
    if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, half>) {
        return (T)__builtin_fmaxf((float)a, (float)b);
    } else {
        return a > b ? a : b;
    }
}
template <class T, std::enable_if_t<emu::is_num<T>, int> = 0>
inline T min(T a, T b) {
    if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, half>) {
        return (T)__builtin_fminf((float)a, (float)b);
    } else {
        return a < b ? a : b;
    }
}
template <class A, class B, std::enable_if_t<emu::bin_ok<A, B>, int> = 0>
inline auto max(const A &a, const B &b) {
    return emu::map2(a, b, [](auto x, auto y) { return max(x, y); });
}
template <class A, class B, std::enable_if_t<emu::bin_ok<A, B>, int> = 0>
inline auto min(const A &a, const B &b) {
    return emu::map2(a, b, [](auto x, auto y) { return min(x, y); });
}
template <class T, std::enable_if_t<emu::is_num<T>, int> = 0>
inline T clamp(T x, T lo, T hi) {
    return min(max(x, lo), hi);
}
template <class A, class B, class C, std::enable_if_t<emu::any_vec3<A, B, C>, int> = 0>
inline auto clamp(const A &a, const B &b, const C &c) {
    return emu::map3(a, b, c, [](auto x, auto lo, auto hi) { return clamp(x, lo, hi); });
}
template <class T, std::enable_if_t<emu::is_num<T>, int> = 0>
inline T abs(T x) {
    if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, half>) {
        return (T)__builtin_fabsf((float)x);
    } else {
        return x < 0 ? T(-x) : x;
    }
}
template <class A, std::enable_if_t<emu::is_vec<A>, int> = 0>
inline auto abs(const A &a) {
    return emu::map1(a, [](auto x) { return abs(x); });
}

inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return (half)__builtin_fmaf(a, b, c); }
inline float mix(float x, float y, float a) { return x + (y - x) * a; }
inline half mix(half x, half y, half a) { return (half)mix((float)x, (float)y, (float)a); }
inline float smoothstep(float e0, float e1, float x) {
    float t = clamp((x - e0) / (e1 - e0), 0.0f, 1.0f);
    return t * t * (3.0f - 2.0f * t);
}
#define EMU_TERNARY_VEC(NAME)                                                          \
    template <class A, class B, class C, std::enable_if_t<emu::any_vec3<A, B, C>, int> = 0> \
    inline auto NAME(const A &a, const B &b, const C &c) {                             \
        return emu::map3(a, b, c, [](auto x, auto y, auto z) { return NAME(x, y, z); }); \
    }
EMU_TERNARY_VEC(fma)
EMU_TERNARY_VEC(mix)
EMU_TERNARY_VEC(smoothstep)
#undef EMU_TERNARY_VEC

inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isnan(half x) { return __builtin_isnan((float)x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isinf(half x) { return __builtin_isinf((float)x); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool isfinite(half x) { return __builtin_isfinite((float)x); }
inline bool signbit(float x) { return __builtin_signbit(x); }
inline bool signbit(half x) { return __builtin_signbit((float)x); }
#define EMU_PRED_VEC(NAME)                                                             \
    template <class A, std::enable_if_t<emu::is_vec<A>, int> = 0>                      \
    inline auto NAME(const A &a) {                                                     \
        return emu::map1(a, [](auto x) { return NAME(x); });                           \
    }
EMU_PRED_VEC(isnan)
EMU_PRED_VEC(isinf)
EMU_PRED_VEC(isfinite)
EMU_PRED_VEC(signbit)
#undef EMU_PRED_VEC

/* select(a, b, c): c ? b : a, component-wise for vectors. */
template <class T, std::enable_if_t<emu::is_num<T>, int> = 0>
inline T select(T a, T b, bool c) {
    return c ? b : a;
}
template <class A, class B, class C, std::enable_if_t<emu::any_vec3<A, B, C>, int> = 0>
inline auto select(const A &a, const B &b, const C &c) {
    return emu::map3(a, b, c, [](auto x, auto y, auto z) { return z ? y : x; });
}

template <int N>
inline bool all(const emu::vec<bool, N> &b) {
    for (int i = 0; i < N; ++i)
        if (!b.v[i]) return false;
    return true;
}
template <int N>
inline bool any(const emu::vec<bool, N> &b) {
    for (int i = 0; i < N; ++i)
        if (b.v[i]) return true;
    return false;
}
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }

template <class A, class B, std::enable_if_t<emu::is_vec<A> && emu::is_vec<B>, int> = 0>
inline auto dot(const A &a, const B &b) {
    auto x = emu::as_vec(a);
    auto y = emu::as_vec(b);
    using T = typename emu::vtraits<A>::elem;
    T s = T(0);
    for (int i = 0; i < emu::vtraits<A>::n; ++i) s += T(x.v[i] * y.v[i]);
    return s;
}
template <class A, std::enable_if_t<emu::is_vec<A>, int> = 0>
inline auto length(const A &a) {
    return sqrt(dot(a, a));
}
template <class A, std::enable_if_t<emu::is_vec<A>, int> = 0>
inline auto normalize(const A &a) {
    return emu::as_vec(a) * rsqrt(dot(a, a));
}
template <class A, class B, std::enable_if_t<emu::is_vec<A> && emu::is_vec<B>, int> = 0>
inline auto distance(const A &a, const B &b) {
    return length(emu::as_vec(a) - emu::as_vec(b));
}
template <class T>
inline emu::vec<T, 3> cross(const emu::vec<T, 3> &a, const emu::vec<T, 3> &b) {
    return emu::vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}

inline uint popcount(uint x) { return (uint)__builtin_popcount(x); }
inline uint clz(uint x) { return x ? (uint)__builtin_clz(x) : 32u; }
inline uint ctz(uint x) { return x ? (uint)__builtin_ctz(x) : 32u; }
inline uint mulhi(uint a, uint b) { return (uint)(((uint64_t)a * b) >> 32); }

/* Both namespaces accept the same calls here: precision differences of the GPU's fast math
 * are within what the parity tests tolerate, so one implementation serves both. */
#define EMU_MATH_NAMES(X)                                                              \
    X(exp) X(exp2) X(exp10) X(log) X(log2) X(log10) X(sqrt) X(rsqrt) X(sin) X(cos) X(tan) \
    X(asin) X(acos) X(atan) X(sinh) X(cosh) X(tanh) X(asinh) X(acosh) X(atanh) X(floor)  \
    X(ceil) X(round) X(rint) X(trunc) X(fabs) X(fract) X(saturate) X(sign) X(pow) X(powr) \
    X(fmod) X(atan2) X(fmax) X(fmin) X(copysign) X(step) X(divide) X(max) X(min) X(clamp) \
    X(fma) X(mix) X(smoothstep) X(isnan) X(isinf) X(isfinite) X(abs) X(normalize)       \
    X(length) X(distance) X(dot)
#define EMU_USING(NAME) using metal::NAME;
namespace precise {
EMU_MATH_NAMES(EMU_USING)
}
namespace fast {
EMU_MATH_NAMES(EMU_USING)
}
#undef EMU_USING
#undef EMU_MATH_NAMES

/* ---- synchronisation ---- */

#define MSL_SYNC_FN inline
#include "../msl_sync.h"

inline void threadgroup_barrier(mem_flags, const char *file = __builtin_FILE(),
                                int line = __builtin_LINE()) {
    emu_rt_barrier(file, line);
}

/* ---- atomics (relaxed; device and threadgroup alike) ---- */

inline void atomic_thread_fence(mem_flags, memory_order) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

template <class T>
inline T atomic_load_explicit(const volatile atomic<T> *a, memory_order) {
    T r;
    __atomic_load(&a->value_, &r, __ATOMIC_RELAXED);
    return r;
}
template <class T, class U>
inline void atomic_store_explicit(volatile atomic<T> *a, U v, memory_order) {
    T t = T(v);
    __atomic_store(&a->value_, &t, __ATOMIC_RELAXED);
}
template <class T, class U>
inline T atomic_exchange_explicit(volatile atomic<T> *a, U v, memory_order) {
    T t = T(v), r;
    __atomic_exchange(&a->value_, &t, &r, __ATOMIC_RELAXED);
    return r;
}
template <class T, class U>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T> *a, T *expected, U desired,
                                                  memory_order, memory_order) {
    T d = T(desired);
    return __atomic_compare_exchange(&a->value_, expected, &d, true, __ATOMIC_RELAXED,
                                     __ATOMIC_RELAXED);
}
template <class T, class U>
inline bool atomic_compare_exchange_strong_explicit(volatile atomic<T> *a, T *expected,
                                                    U desired, memory_order, memory_order) {
    T d = T(desired);
    return __atomic_compare_exchange(&a->value_, expected, &d, false, __ATOMIC_RELAXED,
                                     __ATOMIC_RELAXED);
}

namespace detail {
/* Read-modify-write through compare-exchange: floats (and min/max) have no fetch builtin. */
template <class T, class F>
inline T atomic_rmw(volatile atomic<T> *a, F f) {
    T old;
    __atomic_load(&a->value_, &old, __ATOMIC_RELAXED);
    for (;;) {
        T nv = f(old);
        if (__atomic_compare_exchange(&a->value_, &old, &nv, true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED))
            return old;
    }
}
}  // namespace detail

#define EMU_ATOMIC_FETCH(NAME, EXPR)                                                   \
    template <class T, class U>                                                        \
    inline T atomic_fetch_##NAME##_explicit(volatile atomic<T> *a, U v, memory_order) { \
        T w = T(v);                                                                    \
        return detail::atomic_rmw(a, [w](T o) { return T(EXPR); });                   \
    }
EMU_ATOMIC_FETCH(max, o > w ? o : w)
EMU_ATOMIC_FETCH(min, o < w ? o : w)
EMU_ATOMIC_FETCH(and, o &w)
EMU_ATOMIC_FETCH(or, o | w)
EMU_ATOMIC_FETCH(xor, o ^ w)

/* Integers use the hardware fetch-add; floats go through compare-exchange. */
template <class T, class U>
inline T atomic_fetch_add_explicit(volatile atomic<T> *a, U v, memory_order) {
    if constexpr (std::is_integral_v<T>) {
        return __atomic_fetch_add(&a->value_, T(v), __ATOMIC_RELAXED);
    } else {
        T w = T(v);
        return detail::atomic_rmw(a, [w](T o) { return T(o + w); });
    }
}
template <class T, class U>
inline T atomic_fetch_sub_explicit(volatile atomic<T> *a, U v, memory_order) {
    if constexpr (std::is_integral_v<T>) {
        return __atomic_fetch_sub(&a->value_, T(v), __ATOMIC_RELAXED);
    } else {
        T w = T(v);
        return detail::atomic_rmw(a, [w](T o) { return T(o - w); });
    }
}
#undef EMU_ATOMIC_FETCH

}  // namespace metal

/* ---- simd-group functions ---- */

namespace emu {

template <class T>
inline T lane_in(const emu_simd_group *g, uint32_t i) {
    T t;
    __builtin_memcpy((void *)&t, (const void *)g->lane[i].in, sizeof(T));
    return t;
}
template <class T>
inline void lane_out(emu_simd_group *g, uint32_t i, const T &t) {
    __builtin_memcpy((void *)g->lane[i].out, (const void *)&t, sizeof(T));
}

enum simd_op_kind {
    SIMD_SUM, SIMD_PRODUCT, SIMD_MAX, SIMD_MIN, SIMD_AND, SIMD_OR, SIMD_XOR,
    SIMD_PREFIX_EXCL_SUM, SIMD_PREFIX_INCL_SUM, SIMD_PREFIX_EXCL_PRODUCT,
    SIMD_PREFIX_INCL_PRODUCT, SIMD_SHUFFLE, SIMD_SHUFFLE_DOWN, SIMD_SHUFFLE_UP,
    SIMD_SHUFFLE_XOR, SIMD_BROADCAST_FIRST, SIMD_ALL, SIMD_ANY, SIMD_BARRIER,
};

template <class T, int OP>
inline T simd_combine(const T &a, const T &b) {
    if constexpr (OP == SIMD_SUM || OP == SIMD_PREFIX_EXCL_SUM || OP == SIMD_PREFIX_INCL_SUM) {
        return T(a + b);
    } else if constexpr (OP == SIMD_PRODUCT || OP == SIMD_PREFIX_EXCL_PRODUCT ||
                         OP == SIMD_PREFIX_INCL_PRODUCT) {
        return T(a * b);
    } else if constexpr (OP == SIMD_MAX) {
        return T(metal::max(a, b));
    } else if constexpr (OP == SIMD_MIN) {
        return T(metal::min(a, b));
    } else if constexpr (OP == SIMD_AND || OP == SIMD_ALL) {
        return T(a & b);
    } else if constexpr (OP == SIMD_OR || OP == SIMD_ANY) {
        return T(a | b);
    } else {
        return T(a ^ b);
    }
}

/* Computes every lane's result once all lanes of the simdgroup have posted their input.
 * Lanes that would read from a lane outside the simdgroup keep their own value. */
template <class T, int OP>
void simd_resolve(emu_simd_group *g) {
    const uint32_t n = g->n_lanes;
    if constexpr (OP == SIMD_BARRIER) {
        return;
    } else if constexpr (OP == SIMD_SHUFFLE || OP == SIMD_SHUFFLE_DOWN || OP == SIMD_SHUFFLE_UP ||
                         OP == SIMD_SHUFFLE_XOR || OP == SIMD_BROADCAST_FIRST) {
        for (uint32_t i = 0; i < n; ++i) {
            uint32_t p = g->lane[i].param, j;
            if constexpr (OP == SIMD_SHUFFLE) j = p;
            else if constexpr (OP == SIMD_SHUFFLE_DOWN) j = i + p;
            else if constexpr (OP == SIMD_SHUFFLE_UP) j = p <= i ? i - p : n;
            else if constexpr (OP == SIMD_SHUFFLE_XOR) j = i ^ p;
            else j = 0;
            lane_out<T>(g, i, lane_in<T>(g, j < n ? j : i));
        }
    } else if constexpr (OP == SIMD_PREFIX_EXCL_SUM || OP == SIMD_PREFIX_INCL_SUM ||
                         OP == SIMD_PREFIX_EXCL_PRODUCT || OP == SIMD_PREFIX_INCL_PRODUCT) {
        constexpr bool excl = OP == SIMD_PREFIX_EXCL_SUM || OP == SIMD_PREFIX_EXCL_PRODUCT;
        constexpr bool sum = OP == SIMD_PREFIX_EXCL_SUM || OP == SIMD_PREFIX_INCL_SUM;
        T acc = T(sum ? 0 : 1);
        for (uint32_t i = 0; i < n; ++i) {
            T v = lane_in<T>(g, i);
            if (!excl) acc = simd_combine<T, OP>(acc, v);
            lane_out<T>(g, i, acc);
            if (excl) acc = simd_combine<T, OP>(acc, v);
        }
    } else {
        T acc = lane_in<T>(g, 0);
        for (uint32_t i = 1; i < n; ++i) acc = simd_combine<T, OP>(acc, lane_in<T>(g, i));
        for (uint32_t i = 0; i < n; ++i) lane_out<T>(g, i, acc);
    }
}

template <class T, int OP>
inline T simd_collective(const T &v, uint32_t param, const char *name, const char *file,
                         int line) {
    static_assert(sizeof(T) <= EMU_SIMD_PAYLOAD, "simd value too large");
    emu_simd_lane *me = emu_rt_simd_lane(name, file, line);
    __builtin_memcpy((void *)me->in, (const void *)&v, sizeof(T));
    me->param = param;
    emu_rt_simd_wait(&simd_resolve<T, OP>, name, file, line);
    T r;
    __builtin_memcpy((void *)&r, (const void *)me->out, sizeof(T));
    return r;
}

}  // namespace emu

namespace metal {

#define EMU_SIMD_REDUCE(NAME, OP)                                                      \
    template <class T>                                                                 \
    inline T NAME(T v, const char *file = __builtin_FILE(), int line = __builtin_LINE()) { \
        return emu::simd_collective<T, emu::OP>(v, 0, #NAME, file, line);              \
    }
EMU_SIMD_REDUCE(simd_sum, SIMD_SUM)
EMU_SIMD_REDUCE(simd_product, SIMD_PRODUCT)
EMU_SIMD_REDUCE(simd_max, SIMD_MAX)
EMU_SIMD_REDUCE(simd_min, SIMD_MIN)
EMU_SIMD_REDUCE(simd_and, SIMD_AND)
EMU_SIMD_REDUCE(simd_or, SIMD_OR)
EMU_SIMD_REDUCE(simd_xor, SIMD_XOR)
EMU_SIMD_REDUCE(simd_prefix_exclusive_sum, SIMD_PREFIX_EXCL_SUM)
EMU_SIMD_REDUCE(simd_prefix_inclusive_sum, SIMD_PREFIX_INCL_SUM)
EMU_SIMD_REDUCE(simd_prefix_exclusive_product, SIMD_PREFIX_EXCL_PRODUCT)
EMU_SIMD_REDUCE(simd_prefix_inclusive_product, SIMD_PREFIX_INCL_PRODUCT)
EMU_SIMD_REDUCE(simd_broadcast_first, SIMD_BROADCAST_FIRST)
#undef EMU_SIMD_REDUCE

#define EMU_SIMD_SHUFFLE(NAME, OP)                                                     \
    template <class T>                                                                 \
    inline T NAME(T v, ushort p, const char *file = __builtin_FILE(),                  \
                  int line = __builtin_LINE()) {                                       \
        return emu::simd_collective<T, emu::OP>(v, p, #NAME, file, line);              \
    }
EMU_SIMD_SHUFFLE(simd_shuffle, SIMD_SHUFFLE)
EMU_SIMD_SHUFFLE(simd_broadcast, SIMD_SHUFFLE)
EMU_SIMD_SHUFFLE(simd_shuffle_down, SIMD_SHUFFLE_DOWN)
EMU_SIMD_SHUFFLE(simd_shuffle_up, SIMD_SHUFFLE_UP)
EMU_SIMD_SHUFFLE(simd_shuffle_xor, SIMD_SHUFFLE_XOR)
#undef EMU_SIMD_SHUFFLE

inline bool simd_all(bool b, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return emu::simd_collective<bool, emu::SIMD_ALL>(b, 0, "simd_all", file, line);
}
inline bool simd_any(bool b, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return emu::simd_collective<bool, emu::SIMD_ANY>(b, 0, "simd_any", file, line);
}
inline void simdgroup_barrier(mem_flags, const char *file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
    emu::simd_collective<char, emu::SIMD_BARRIER>(0, 0, "simdgroup_barrier", file, line);
}
inline bool simd_is_first() { return emu_rt_current()->tiisg == 0; }

/* ---- simdgroup matrices: every lane holds the whole tile, so no lane exchange is needed ---- */

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
    T e[Rows][Cols];
    simdgroup_matrix() = default;
    /* MSL: a diagonal matrix with d on the diagonal. */
    explicit simdgroup_matrix(T d) {
        for (int r = 0; r < Rows; ++r)
            for (int c = 0; c < Cols; ++c) e[r][c] = r == c ? d : T(0);
    }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;

template <class T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
    simdgroup_matrix<T, Cols, Rows> m;
    for (int r = 0; r < Rows; ++r)
        for (int c = 0; c < Cols; ++c) m.e[r][c] = value;
    return m;
}

/* Element (r, c) comes from src[(origin.y + r) * elements_per_row + origin.x + c]; with
 * transpose the tile read is the transpose of that. */
template <class T, int Cols, int Rows, class U>
inline void simdgroup_load(simdgroup_matrix<T, Cols, Rows> &d, const U *src,
                           ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0),
                           bool transpose_matrix = false) {
    const U *base = src + matrix_origin.y * elements_per_row + matrix_origin.x;
    for (int r = 0; r < Rows; ++r)
        for (int c = 0; c < Cols; ++c)
            d.e[r][c] = T(transpose_matrix ? base[c * elements_per_row + r]
                                           : base[r * elements_per_row + c]);
}
template <class T, int Cols, int Rows, class U>
inline void simdgroup_store(const simdgroup_matrix<T, Cols, Rows> &a, U *dst,
                            ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0),
                            bool transpose_matrix = false) {
    U *base = dst + matrix_origin.y * elements_per_row + matrix_origin.x;
    for (int r = 0; r < Rows; ++r)
        for (int c = 0; c < Cols; ++c) {
            if (transpose_matrix) base[c * elements_per_row + r] = U(a.e[r][c]);
            else base[r * elements_per_row + c] = U(a.e[r][c]);
        }
}
template <class T, int K, int M, int N>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, N, M> &d,
                                          const simdgroup_matrix<T, K, M> &a,
                                          const simdgroup_matrix<T, N, K> &b,
                                          const simdgroup_matrix<T, N, M> &c) {
    simdgroup_matrix<T, N, M> r;
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            float acc = (float)c.e[i][j];
            for (int k = 0; k < K; ++k) acc = __builtin_fmaf((float)a.e[i][k], (float)b.e[k][j], acc);
            r.e[i][j] = T(acc);
        }
    d = r;
}
template <class T, int K, int M, int N>
inline void simdgroup_multiply(simdgroup_matrix<T, N, M> &d, const simdgroup_matrix<T, K, M> &a,
                               const simdgroup_matrix<T, N, K> &b) {
    simdgroup_multiply_accumulate(d, a, b, simdgroup_matrix<T, N, M>(T(0)));
}

}  // namespace metal

/* ---- glue used by the generated launchers ---- */

namespace emu {

#define MSL_GLUE_FN inline
#include "../msl_glue.h"
#undef MSL_GLUE_FN

/* Storage of a `threadgroup T x[N];` declaration: the same bytes for every thread of the
 * group, because each thread's declarations run in the same order. */
template <class X>
inline X *tg_decl(const char *file, int line) {
    return static_cast<X *>(emu_rt_tg_alloc(sizeof(X), alignof(X), file, line));
}

inline uint64_t gcd(uint64_t a, uint64_t b) {
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* Runs every thread of one group in a loop, for kernels that never wait on another thread.
 * Orders: 0 forward, 1 reverse, 2 a seeded permutation. */
template <void (*K)(const emu_launch *, const emu_thread *)>
void run_group(const emu_launch *launch, emu_thread *t, int order, uint64_t seed) {
    const uint32_t n = t->tptg.x * t->tptg.y * t->tptg.z;
    if (order == 0) {
        const uint32_t sgptg = (n + EMU_SIMD_WIDTH - 1) / EMU_SIMD_WIDTH;
        uint32_t index = 0;
        t->sgptg = sgptg;
        for (uint32_t z = 0; z < t->tptg.z; ++z) {
            t->tpitg.z = z;
            t->tpig.z = t->tgpig.z * t->dtptg.z + z;
            for (uint32_t y = 0; y < t->tptg.y; ++y) {
                t->tpitg.y = y;
                t->tpig.y = t->tgpig.y * t->dtptg.y + y;
                for (uint32_t x = 0; x < t->tptg.x; ++x, ++index) {
                    t->tpitg.x = x;
                    t->tpig.x = t->tgpig.x * t->dtptg.x + x;
                    t->tiitg = index;
                    t->sgitg = index / EMU_SIMD_WIDTH;
                    t->tiisg = index % EMU_SIMD_WIDTH;
                    t->tpsg = t->sgitg + 1 == sgptg ? n - t->sgitg * EMU_SIMD_WIDTH
                                                    : EMU_SIMD_WIDTH;
                    t->tg_cursor = 0;
                    K(launch, t);
                }
            }
        }
        return;
    }
    /* A stride coprime with n visits every index once: a cheap seeded permutation. */
    uint64_t stride = 1, offset = 0;
    if (order == 2 && n > 1) {
        stride = (seed * 0x9E3779B97F4A7C15ull >> 33) % n;
        while (stride == 0 || gcd(stride, n) != 1) stride = (stride + 1) % n;
        offset = (seed >> 7) % n;
    }
    for (uint32_t k = 0; k < n; ++k) {
        uint32_t i = order == 1 ? n - 1 - k : (uint32_t)((offset + stride * k) % n);
        emu_thread_set_index(t, i);
        K(launch, t);
    }
}

}  // namespace emu

#endif
