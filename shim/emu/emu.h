/* C API of the Metal compute emulator: run kernels rewritten from .metal files on the CPU.
 *
 * Every function returns EMU_OK (0) or a negative EMU_ERR_* code; on failure
 * emu_last_error() gives a message for the calling thread. Nothing aborts the process. */
#ifndef DM_EMU_H
#define DM_EMU_H

#include "emu_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EMU_OK 0
#define EMU_ERR_INVALID (-1)   /* bad arguments: sizes, limits, unbound buffers */
#define EMU_ERR_KERNEL (-2)    /* the kernel misbehaved: barrier/simd misuse, too much memory */
#define EMU_ERR_NOT_FOUND (-3) /* no kernel of that name */
#define EMU_ERR_RESOURCE (-4)  /* out of memory or threads */

/* How `size` of a dispatch is counted (Metal's dispatchThreads / dispatchThreadgroups). */
#define EMU_DISPATCH_THREADS 0
#define EMU_DISPATCH_THREADGROUPS 1

/* Order in which the threads of a group run between two synchronisation points. */
#define EMU_ORDER_FORWARD 0
#define EMU_ORDER_REVERSE 1
#define EMU_ORDER_RANDOM 2

typedef struct emu_device emu_device;

typedef struct emu_dispatch_desc {
    const emu_kernel_info *kernel;
    void *const *buffers;    /* buffers[i] binds [[buffer(i)]] */
    int n_buffers;
    uint32_t tg_arg_bytes[EMU_MAX_TG_ARGS]; /* lengths of [[threadgroup(i)]] memory */
    uint32_t size[3];        /* threads (EMU_DISPATCH_THREADS) or threadgroups in x, y, z */
    uint32_t group[3];       /* threads per threadgroup in x, y, z */
    int mode;                /* EMU_DISPATCH_THREADS or EMU_DISPATCH_THREADGROUPS */
    int order;               /* EMU_ORDER_* */
    uint64_t seed;           /* for EMU_ORDER_RANDOM; the same seed gives the same schedule */
} emu_dispatch_desc;

/* A pool of `n_threads` host threads (the caller counts as one; <= 0: number of cores). */
emu_device *emu_device_create(int n_threads);
void emu_device_destroy(emu_device *device);
int emu_device_threads(const emu_device *device);

/* Runs one dispatch to completion. Threadgroups run in parallel; the call returns when all
 * have finished or the first error stopped the rest. */
int emu_dispatch(emu_device *device, const emu_dispatch_desc *desc);

/* Loads a kernel library built from the generated files (emu_library.h) and registers its
 * kernels; loading the same library again does nothing. EMU_ERR_NOT_FOUND when it cannot be
 * opened, EMU_ERR_INVALID when it is not a kernel library of this runtime. */
int emu_load_library(const char *path);

/* Kernels registered by the generated files loaded into (or linked into) the process. */
const emu_kernel_info *emu_find_kernel(const char *name);
int emu_kernel_count(void);
const emu_kernel_info *emu_kernel_at(int index);

/* Message of the last failure on this thread ("" if none). */
const char *emu_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
