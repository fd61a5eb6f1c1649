// The runtime side of a kernel library (see emu_library.h): compiled into the library with
// -fvisibility=hidden, so the generated code's emu_rt_* calls bind here and nowhere else.
#include "emu_library.h"

namespace {

const emu_runtime_api *g_api = nullptr;

struct Table {
    const emu_kernel_info *kernels;
    int count;
};
// One table per generated file; the static initializers run before the runtime attaches.
const int kMaxTables = 256;
Table g_tables[kMaxTables];
int g_n_tables = 0;
bool g_overflow = false;

}  // namespace

extern "C" {

int emu_register_kernels(const emu_kernel_info *table, int count) {
    if (g_n_tables == kMaxTables) {
        g_overflow = true;
        return 0;
    }
    g_tables[g_n_tables++] = Table{table, count};
    return count;
}

emu_thread *emu_rt_current(void) { return g_api->current(); }

void *emu_rt_tg_alloc(size_t bytes, size_t align, const char *file, int line) {
    return g_api->tg_alloc(bytes, align, file, line);
}

void emu_rt_barrier(const char *file, int line) { g_api->barrier(file, line); }

emu_simd_lane *emu_rt_simd_lane(const char *op, const char *file, int line) {
    return g_api->simd_lane(op, file, line);
}

void emu_rt_simd_wait(emu_simd_resolve_fn resolve, const char *op, const char *file, int line) {
    g_api->simd_wait(resolve, op, file, line);
}

void emu_rt_fail(const char *file, int line, const char *message) {
    g_api->fail(file, line, message);
}

__attribute__((visibility("default"))) int emu_library_attach(const emu_runtime_api *api,
                                                              emu_register_fn add) {
    if (api == nullptr || add == nullptr || api->abi != EMU_LIBRARY_ABI ||
        api->thread_size != sizeof(emu_thread) ||
        api->kernel_info_size != sizeof(emu_kernel_info) || g_overflow)
        return -1;
    g_api = api;
    int total = 0;
    for (int i = 0; i < g_n_tables; ++i) total += add(g_tables[i].kernels, g_tables[i].count);
    return total;
}

}  // extern "C"
