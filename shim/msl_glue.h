/* Binding glue of the generated kernel entry points, the same for both targets of the .metal
 * translators: the emulator's prelude (emu/metal_emu.h) and CUDA's (cuda/metal_cuda.h) each
 * include it inside their own namespace, after their vector traits (is_vec, vtraits), with
 * MSL_GLUE_FN set to their function qualifiers. No include guard on purpose: one translation
 * unit includes one prelude. */

/* The parameter types of a kernel, to bind each argument as the kernel declared it. */
template <class F>
struct fn_args;
template <class R, class... A>
struct fn_args<R (*)(A...)> {
    template <int I>
    using arg = std::tuple_element_t<I, std::tuple<A...>>;
};

/* A buffer binding as the kernel declared it: pointer, reference, or (rarely) by value. */
template <class P>
MSL_GLUE_FN P bind(void *p) {
    if constexpr (std::is_pointer_v<P>) {
        return reinterpret_cast<P>(p);
    } else if constexpr (std::is_reference_v<P>) {
        return *reinterpret_cast<std::remove_reference_t<P> *>(p);
    } else {
        return *reinterpret_cast<const std::remove_cv_t<P> *>(p);
    }
}

/* A built-in (a scalar, or anything with x, y, z) converted to the type the kernel declared
 * (uint, ushort2, uint3...). */
template <class P, class V>
MSL_GLUE_FN P builtin(const V &v) {
    using Q = std::remove_cv_t<std::remove_reference_t<P>>;
    if constexpr (std::is_arithmetic_v<V>) {
        return Q(v);
    } else if constexpr (is_vec<Q>) {
        using T = typename vtraits<Q>::elem;
        constexpr int N = vtraits<Q>::n;
        Q q;
        q.v[0] = T(v.x);
        if constexpr (N > 1) q.v[1] = T(v.y);
        if constexpr (N > 2) q.v[2] = T(v.z);
        return q;
    } else {
        return Q(v.x);
    }
}
