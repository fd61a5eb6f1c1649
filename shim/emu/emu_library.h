/* A shared library of emulator kernels, loaded at run time.
 *
 * The kernels translated from the .metal files are compiled into their own shared library on
 * first use (darknet_metal.metal.kernel_build) instead of being linked into the shim. The
 * library is opened with its symbols kept local, so it cannot see the runtime's emu_rt_*
 * functions by name: emu_library.cpp, compiled into it, defines them as calls through the
 * table below, which the runtime hands over when it loads the library. The generated files
 * register their tables from static initializers, before that hand-over; emu_library.cpp
 * keeps them until the runtime asks for them. */
#ifndef DM_EMU_LIBRARY_H
#define DM_EMU_LIBRARY_H

#include "emu_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Raised whenever emu_abi.h changes in a way a compiled library would notice. */
#define EMU_LIBRARY_ABI 1
/* The one symbol a kernel library exports. */
#define EMU_LIBRARY_ENTRY "emu_library_attach"

typedef struct emu_runtime_api {
    uint32_t abi;              /* EMU_LIBRARY_ABI */
    uint32_t thread_size;      /* sizeof(emu_thread) */
    uint32_t kernel_info_size; /* sizeof(emu_kernel_info) */
    emu_thread *(*current)(void);
    void *(*tg_alloc)(size_t bytes, size_t align, const char *file, int line);
    void (*barrier)(const char *file, int line);
    emu_simd_lane *(*simd_lane)(const char *op, const char *file, int line);
    void (*simd_wait)(emu_simd_resolve_fn resolve, const char *op, const char *file, int line);
    void (*fail)(const char *file, int line, const char *message);
} emu_runtime_api;

typedef int (*emu_register_fn)(const emu_kernel_info *table, int count);

/* Takes the runtime's table and registers every kernel of the library through `add`.
 * Returns the number of kernels, or -1 when the library was built against another ABI. */
typedef int (*emu_library_attach_fn)(const emu_runtime_api *api, emu_register_fn add);

#ifdef __cplusplus
}
#endif
#endif
