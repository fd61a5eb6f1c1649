/* MSL's vector types, the same for both targets of the .metal translators: the emulator's
 * prelude (emu/metal_emu.h) and CUDA's (cuda/metal_cuda.h) each include it inside their own
 * namespace, with
 *   MSL_VEC_FN      their function qualifiers;
 *   MSL_UNROLL      a pragma that unrolls the loop after it (or nothing);
 *   MSL_HALF        their half type (a scalar, as the arithmetic types are);
 *   MSL_SWIZZLES_2(T), _3(T), _4(T)  the swizzle members of a vector's storage union (.xy,
 *                   .zyx...), views declared before (the emulator's `swz`), or nothing.
 * With swizzles, a vector's copy assignment is written out (the views make the union's own
 * deleted) and `as_vec` reads a view as a vector; the prelude adds `vtraits` for its views.
 * The parameters are undefined at the end. MSL_VECTOR_TYPES(X, HALF) lists the element types
 * and their MSL names, for the prelude's typedefs (float2, half4...) outside the namespace.
 *
 * What it keeps from MSL: sizes and alignment (a 3-vector is padded to 4: float3 is 16
 * bytes, half4 8), component access (.x .. .w, [i]), construction from scalars and from
 * vectors and scalars whose components add up, component-wise arithmetic, comparison
 * (vectors of bool) and bit operators with a scalar broadcast to either side, and `map1..3`,
 * which apply a scalar function component-wise (MSL's vector math is built on them). No
 * include guard on purpose: one translation unit includes one prelude. */

template <class S>
inline constexpr bool is_num =
    std::is_arithmetic_v<S> || std::is_same_v<std::remove_cv_t<S>, MSL_HALF>;

template <class T, int N>
struct vec;

template <class T, int N>
struct vstore;
template <class T>
struct vstore<T, 2> {
    union {
        T v[2];
        struct {
            T x, y;
        };
        MSL_SWIZZLES_2(T)
    };
};
template <class T>
struct vstore<T, 3> {
    union {
        T v[4];
        struct {
            T x, y, z;
        };
        MSL_SWIZZLES_3(T)
    };
};
template <class T>
struct vstore<T, 4> {
    union {
        T v[4];
        struct {
            T x, y, z, w;
        };
        MSL_SWIZZLES_4(T)
    };
};

template <class X>
struct vtraits {
    static constexpr bool is_vec = false;
    static constexpr int n = 1;
    using elem = X;
};
template <class T, int N>
struct vtraits<vec<T, N>> {
    static constexpr bool is_vec = true;
    static constexpr int n = N;
    using elem = T;
};

template <class X>
inline constexpr bool is_vec = vtraits<std::remove_cv_t<std::remove_reference_t<X>>>::is_vec;

/* Number of scalar components X contributes to a vector constructor. */
template <class X>
inline constexpr int ncomp = vtraits<std::remove_cv_t<X>>::n;

template <class T, int N>
struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec : vstore<T, N> {
    using vstore<T, N>::v;
    vec() = default;
    vec(const vec &) = default;
#if MSL_HAS_SWIZZLES
    MSL_VEC_FN vec &operator=(const vec &o) {
        __builtin_memcpy((void *)this, (const void *)&o, sizeof(vec));
        return *this;
    }
#else
    vec &operator=(const vec &) = default;
#endif
    template <class S, std::enable_if_t<is_num<S>, int> = 0>
    MSL_VEC_FN vec(S s) {
        MSL_UNROLL
        for (int i = 0; i < N; ++i) v[i] = T(s);
    }
    template <class U>
    MSL_VEC_FN explicit vec(const vec<U, N> &o) {
        MSL_UNROLL
        for (int i = 0; i < N; ++i) v[i] = T(o.v[i]);
    }
    template <class A, class B, class... R,
              std::enable_if_t<ncomp<A> + ncomp<B> + (0 + ... + ncomp<R>) == N, int> = 0>
    MSL_VEC_FN vec(const A &a, const B &b, const R &...r) {
        int k = 0;
        put(k, a);
        put(k, b);
        (put(k, r), ...);
    }
    MSL_VEC_FN T &operator[](int i) { return v[i]; }
    MSL_VEC_FN const T &operator[](int i) const { return v[i]; }

#define MSL_VEC_ASSIGN_OP(OP)                                                          \
    template <class B>                                                                 \
    MSL_VEC_FN vec &operator OP##=(const B &b) {                                       \
        return *this = *this OP b;                                                     \
    }
    MSL_VEC_ASSIGN_OP(+)
    MSL_VEC_ASSIGN_OP(-)
    MSL_VEC_ASSIGN_OP(*)
    MSL_VEC_ASSIGN_OP(/)
    MSL_VEC_ASSIGN_OP(%)
    MSL_VEC_ASSIGN_OP(&)
    MSL_VEC_ASSIGN_OP(|)
    MSL_VEC_ASSIGN_OP(^)
    MSL_VEC_ASSIGN_OP(<<)
    MSL_VEC_ASSIGN_OP(>>)
#undef MSL_VEC_ASSIGN_OP

    MSL_VEC_FN vec operator-() const {
        vec r;
        MSL_UNROLL
        for (int i = 0; i < N; ++i) r.v[i] = T(-v[i]);
        return r;
    }
    MSL_VEC_FN vec operator+() const { return *this; }
    MSL_VEC_FN vec operator~() const {
        vec r;
        MSL_UNROLL
        for (int i = 0; i < N; ++i) r.v[i] = T(~v[i]);
        return r;
    }
    MSL_VEC_FN vec<bool, N> operator!() const {
        vec<bool, N> r;
        MSL_UNROLL
        for (int i = 0; i < N; ++i) r.v[i] = !v[i];
        return r;
    }

  private:
    template <class X>
    MSL_VEC_FN void put(int &k, const X &x) {
        if constexpr (is_vec<X>) {
            constexpr int M = vtraits<X>::n;
            const vec<typename vtraits<X>::elem, M> t = x;
            MSL_UNROLL
            for (int i = 0; i < M; ++i) v[k++] = T(t.v[i]);
        } else {
            v[k++] = T(x);
        }
    }
};

/* A vector for reading components: views become vectors, vectors and scalars stay. */
template <class X>
MSL_VEC_FN decltype(auto) as_vec(const X &x) {
    if constexpr (is_vec<X> && !std::is_same_v<X, vec<typename vtraits<X>::elem,
                                                       vtraits<X>::n>>) {
        return vec<typename vtraits<X>::elem, vtraits<X>::n>(x);
    } else {
        return (x);
    }
}

template <class X>
MSL_VEC_FN auto get(const X &x, int i) {
    if constexpr (is_vec<X>) {
        return x.v[i];
    } else {
        return x;
    }
}

template <class A, class B>
inline constexpr bool bin_ok =
    (is_vec<A> && (is_vec<B> || is_num<B>)) || (is_num<A> && is_vec<B>);

template <class A, class B>
struct bin_info {
    using VA = vtraits<A>;
    using VB = vtraits<B>;
    static_assert(!(VA::is_vec && VB::is_vec) || VA::n == VB::n,
                  "vector operands of different lengths");
    static constexpr int n = VA::is_vec ? VA::n : VB::n;
    using elem = std::conditional_t<VA::is_vec, typename VA::elem, typename VB::elem>;
};

#define MSL_VEC_BINOP(OP)                                                              \
    template <class A, class B, std::enable_if_t<bin_ok<A, B>, int> = 0>               \
    MSL_VEC_FN auto operator OP(const A &a, const B &b) {                              \
        using I = bin_info<A, B>;                                                      \
        using T = typename I::elem;                                                    \
        const auto &x = as_vec(a);                                                     \
        const auto &y = as_vec(b);                                                     \
        vec<T, I::n> r;                                                                \
        MSL_UNROLL                                                                     \
        for (int i = 0; i < I::n; ++i) r.v[i] = T(get(x, i) OP get(y, i));            \
        return r;                                                                      \
    }
MSL_VEC_BINOP(+)
MSL_VEC_BINOP(-)
MSL_VEC_BINOP(*)
MSL_VEC_BINOP(/)
MSL_VEC_BINOP(%)
MSL_VEC_BINOP(&)
MSL_VEC_BINOP(|)
MSL_VEC_BINOP(^)
MSL_VEC_BINOP(<<)
MSL_VEC_BINOP(>>)
#undef MSL_VEC_BINOP

#define MSL_VEC_CMPOP(OP)                                                              \
    template <class A, class B, std::enable_if_t<bin_ok<A, B>, int> = 0>               \
    MSL_VEC_FN auto operator OP(const A &a, const B &b) {                              \
        using I = bin_info<A, B>;                                                      \
        const auto &x = as_vec(a);                                                     \
        const auto &y = as_vec(b);                                                     \
        vec<bool, I::n> r;                                                             \
        MSL_UNROLL                                                                     \
        for (int i = 0; i < I::n; ++i) r.v[i] = get(x, i) OP get(y, i);               \
        return r;                                                                      \
    }
MSL_VEC_CMPOP(==)
MSL_VEC_CMPOP(!=)
MSL_VEC_CMPOP(<)
MSL_VEC_CMPOP(<=)
MSL_VEC_CMPOP(>)
MSL_VEC_CMPOP(>=)
MSL_VEC_CMPOP(&&)
MSL_VEC_CMPOP(||)
#undef MSL_VEC_CMPOP

/* Component-wise application of a scalar function to one, two or three operands, any of
 * which may be a scalar that is broadcast (MSL allows e.g. max(float4, float)). */
template <class A, class F>
MSL_VEC_FN auto map1(const A &a, F f) {
    constexpr int N = vtraits<A>::n;
    using T = typename vtraits<A>::elem;
    const auto &x = as_vec(a);
    vec<decltype(f(T())), N> r;
    MSL_UNROLL
    for (int i = 0; i < N; ++i) r.v[i] = f(x.v[i]);
    return r;
}

template <class A, class B, class F>
MSL_VEC_FN auto map2(const A &a, const B &b, F f) {
    using I = bin_info<A, B>;
    using T = typename I::elem;
    const auto &x = as_vec(a);
    const auto &y = as_vec(b);
    vec<decltype(f(T(), T())), I::n> r;
    MSL_UNROLL
    for (int i = 0; i < I::n; ++i) r.v[i] = f(T(get(x, i)), T(get(y, i)));
    return r;
}

template <class A, class B, class C, class F>
MSL_VEC_FN auto map3(const A &a, const B &b, const C &c, F f) {
    constexpr int N = is_vec<A> ? vtraits<A>::n : (is_vec<B> ? vtraits<B>::n : vtraits<C>::n);
    using T = std::conditional_t<is_vec<A>, typename vtraits<A>::elem,
                                 std::conditional_t<is_vec<B>, typename vtraits<B>::elem,
                                                    typename vtraits<C>::elem>>;
    const auto &x = as_vec(a);
    const auto &y = as_vec(b);
    const auto &z = as_vec(c);
    vec<decltype(f(T(), T(), T())), N> r;
    MSL_UNROLL
    for (int i = 0; i < N; ++i) r.v[i] = f(T(get(x, i)), T(get(y, i)), T(get(z, i)));
    return r;
}

template <class A, class B, class C>
inline constexpr bool any_vec3 = is_vec<A> || is_vec<B> || is_vec<C>;

/* The bits of ``f`` as a ``To`` of the same size (MSL's as_type). */
template <class To, class From>
MSL_VEC_FN To bit_cast(const From &f) {
    static_assert(sizeof(To) == sizeof(From), "as_type needs types of the same size");
    To t;
    __builtin_memcpy((void *)&t, (const void *)&f, sizeof(To));
    return t;
}

static_assert(sizeof(vec<float, 2>) == 8 && alignof(vec<float, 2>) == 8, "float2 layout");
static_assert(sizeof(vec<float, 3>) == 16 && alignof(vec<float, 3>) == 16, "float3 layout");
static_assert(sizeof(vec<float, 4>) == 16 && alignof(vec<float, 4>) == 16, "float4 layout");
static_assert(sizeof(MSL_HALF) == 2 && sizeof(vec<MSL_HALF, 3>) == 8 &&
              sizeof(vec<MSL_HALF, 4>) == 8, "half layout");
static_assert(sizeof(vec<int, 3>) == 16 && sizeof(vec<uint, 2>) == 8, "int vector layout");

#ifndef MSL_VECTOR_TYPES
#define MSL_VECTOR_TYPES(X, HALF)                                                      \
    X(float, float) X(HALF, half) X(int, int) X(uint, uint) X(short, short)            \
    X(ushort, ushort) X(char, char) X(uchar, uchar) X(long, long) X(ulong, ulong)      \
    X(bool, bool)
#endif

#undef MSL_VEC_FN
#undef MSL_UNROLL
#undef MSL_HALF
#undef MSL_HAS_SWIZZLES
#undef MSL_SWIZZLES_2
#undef MSL_SWIZZLES_3
#undef MSL_SWIZZLES_4
