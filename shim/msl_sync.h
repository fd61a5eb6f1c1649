/* MSL's memory flags, memory orders and atomic storage, the same for both targets of the
 * .metal translators: the emulator's prelude (emu/metal_emu.h) and CUDA's (cuda/metal_cuda.h)
 * each include it inside their own namespace with MSL_SYNC_FN set to their function
 * qualifiers, then define the barriers and the atomic operations on this storage their own
 * way. The values are MSL's. No include guard on purpose: one translation unit includes one
 * prelude. */

enum class mem_flags : uint32_t {
    mem_none = 0,
    mem_device = 1,
    mem_threadgroup = 2,
    mem_texture = 4,
    mem_threadgroup_imageblock = 8,
    mem_object_data = 16,
};
MSL_SYNC_FN constexpr mem_flags operator|(mem_flags a, mem_flags b) {
    return mem_flags(uint32_t(a) | uint32_t(b));
}

enum memory_order {
    memory_order_relaxed = 0,
    memory_order_acquire = 2,
    memory_order_release = 3,
    memory_order_acq_rel = 4,
    memory_order_seq_cst = 5,
};

/* An atomic object is its value: the operations take its address. */
template <class T>
struct atomic {
    T value_;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;

#undef MSL_SYNC_FN
