/* Data shared by the emulator runtime and the C++ generated from .metal files.
 *
 * The generated code (metal2cpp output + metal_emu.h) only sees these plain structs and the
 * emu_rt_* entry points; everything else about scheduling stays private to the runtime. */
#ifndef DM_EMU_ABI_H
#define DM_EMU_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EMU_SIMD_WIDTH 32
#define EMU_MAX_BUFFERS 31         /* Metal's argument-table limit for buffers */
#define EMU_MAX_TG_ARGS 8          /* [[threadgroup(i)]] parameters */
#define EMU_MAX_TG_MEMORY 32768    /* bytes of threadgroup memory per group (Apple GPUs) */
#define EMU_MAX_GROUP_THREADS 1024 /* threads per threadgroup */
#define EMU_SIMD_PAYLOAD 64        /* largest value a simd collective moves (float4x4 fits) */

/* Flags of a kernel, set by the rewriter from what the kernel (transitively) calls. */
#define EMU_KERNEL_BARRIER 1u /* threadgroup_barrier: needs fibers */
#define EMU_KERNEL_SIMD 2u    /* simd collectives / simdgroup_barrier: needs fibers */
#define EMU_KERNEL_TGMEM 4u   /* declares threadgroup memory */

typedef struct emu_uint3 {
    uint32_t x, y, z;
} emu_uint3;

struct emu_launch;
struct emu_thread;

/* Built-in values of one thread, named after the MSL attributes they feed. */
typedef struct emu_thread {
    emu_uint3 tpig;  /* thread_position_in_grid */
    emu_uint3 tpitg; /* thread_position_in_threadgroup */
    emu_uint3 tgpig; /* threadgroup_position_in_grid */
    emu_uint3 tptg;  /* threads_per_threadgroup (edge groups are smaller) */
    emu_uint3 dtptg; /* dispatch_threads_per_threadgroup (the requested size) */
    emu_uint3 tpg;   /* threads_per_grid */
    emu_uint3 tgpg;  /* threadgroups_per_grid */
    uint32_t tiitg;  /* thread_index_in_threadgroup */
    uint32_t tiisg;  /* thread_index_in_simdgroup */
    uint32_t sgitg;  /* simdgroup_index_in_threadgroup */
    uint32_t sgptg;  /* simdgroups_per_threadgroup */
    uint32_t tpsg;   /* threads_per_simdgroup (the last simdgroup may be partial) */
    size_t tg_cursor; /* next free byte of threadgroup memory for this thread's declarations */
    void *group;      /* runtime-private group state */
} emu_thread;

/* Arguments of one dispatch, as bound by the host. */
typedef struct emu_launch {
    void *const *buffers; /* indexed by [[buffer(i)]] */
    int n_buffers;
    void *tg_args[EMU_MAX_TG_ARGS]; /* [[threadgroup(i)]] storage of the current group */
} emu_launch;

typedef void (*emu_thread_fn)(const emu_launch *launch, const emu_thread *thread);
typedef void (*emu_group_fn)(const emu_launch *launch, emu_thread *thread, int order,
                             uint64_t seed);

/* One kernel (or one [[host_name]] template instantiation), as tabled by the rewriter. */
typedef struct emu_kernel_info {
    const char *name;      /* the Metal function name (host_name for instantiations) */
    emu_thread_fn thread;  /* runs one thread (fiber mode) */
    emu_group_fn group;    /* runs a whole group as a loop (kernels without barriers/simd) */
    uint32_t flags;        /* EMU_KERNEL_* */
    uint32_t buffer_mask;  /* bit i set: the kernel reads [[buffer(i)]] */
    uint32_t written_mask; /* bit i set: [[buffer(i)]] is device memory it may write */
    uint32_t tg_arg_mask;  /* bit i set: the kernel takes [[threadgroup(i)]] */
    int32_t tg_static_bytes; /* static threadgroup memory if the rewriter could size it, else -1 */
    int32_t max_threads;   /* [[max_total_threads_per_threadgroup(n)]], 0 if absent */
    const char *file;      /* .metal source */
    int line;              /* line of the kernel's signature */
} emu_kernel_info;

/* One lane's slot in a simd collective. */
typedef struct emu_simd_lane {
    unsigned char in[EMU_SIMD_PAYLOAD];
    unsigned char out[EMU_SIMD_PAYLOAD];
    uint32_t param; /* lane index, delta or mask of shuffles */
} emu_simd_lane;

typedef struct emu_simd_group {
    emu_simd_lane lane[EMU_SIMD_WIDTH];
    uint32_t n_lanes; /* threads in this simdgroup */
} emu_simd_group;

typedef void (*emu_simd_resolve_fn)(emu_simd_group *group);

/* Entry points the generated code calls. Errors are raised as C++ exceptions inside the
 * runtime and caught at the base of the thread or fiber, so these never return on failure. */
emu_thread *emu_rt_current(void);
void *emu_rt_tg_alloc(size_t bytes, size_t align, const char *file, int line);
void emu_rt_barrier(const char *file, int line);
emu_simd_lane *emu_rt_simd_lane(const char *op, const char *file, int line);
void emu_rt_simd_wait(emu_simd_resolve_fn resolve, const char *op, const char *file, int line);
void emu_rt_fail(const char *file, int line, const char *message);

/* Registers the kernels of one generated file; called from its static initializer. */
int emu_register_kernels(const emu_kernel_info *table, int count);

/* Fills the per-thread built-ins for local linear index `index` of the group in *t, whose
 * group-level fields (tgpig, tptg, dtptg, tpg, tgpg) are already set. */
static inline void emu_thread_set_index(emu_thread *t, uint32_t index) {
    uint32_t nx = t->tptg.x, ny = t->tptg.y;
    uint32_t n = nx * ny * t->tptg.z;
    t->tiitg = index;
    t->tpitg.x = index % nx;
    t->tpitg.y = (index / nx) % ny;
    t->tpitg.z = index / (nx * ny);
    t->tpig.x = t->tgpig.x * t->dtptg.x + t->tpitg.x;
    t->tpig.y = t->tgpig.y * t->dtptg.y + t->tpitg.y;
    t->tpig.z = t->tgpig.z * t->dtptg.z + t->tpitg.z;
    t->sgitg = index / EMU_SIMD_WIDTH;
    t->tiisg = index % EMU_SIMD_WIDTH;
    t->sgptg = (n + EMU_SIMD_WIDTH - 1) / EMU_SIMD_WIDTH;
    t->tpsg = (t->sgitg + 1 == t->sgptg) ? n - t->sgitg * EMU_SIMD_WIDTH : EMU_SIMD_WIDTH;
    t->tg_cursor = 0;
}

#ifdef __cplusplus
}
#endif
#endif
