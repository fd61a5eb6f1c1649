// Driver over the CPU emulator of the Metal compute model (shim/emu).
//
// Buffers are page-aligned host memory. A command buffer is a list of recorded dispatches
// (argument bytes copied, buffer addresses resolved at encode time); it runs, in order, when
// the core waits for it, as the GPU would have finished it by then. Commit only marks it.
// The first kernel error stops the command buffer and is returned by the wait.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include <unistd.h>

#include "../emu/emu.h"
#include "bindings.h"
#include "driver.h"

namespace {

struct EmuDevice {
    emu_device *emu = nullptr;
    int order = EMU_ORDER_FORWARD;
    uint64_t seed = 0;
    uint64_t dispatches = 0; // varies the random schedule between dispatches, reproducibly
    bool profiling = false;
    std::vector<uint64_t> times; // host ns of each dispatch run while profiling
};

struct EmuBuffer {
    void *memory = nullptr;
    bool owned = false;
};

struct Recorded {
    const emu_kernel_info *kernel;
    void *buffers[EMU_MAX_BUFFERS];
    int n_buffers;
    std::vector<std::max_align_t> args; // aligned copy of the argument bytes
    uint32_t tg[EMU_MAX_TG_ARGS];
    uint32_t size[3];
    uint32_t group[3];
    int mode;
    bool timed; // encoded while profiling
};

struct EmuCommand {
    std::vector<Recorded> dispatches;
    bool committed = false;
};

uint32_t page_size() {
    long page = sysconf(_SC_PAGESIZE);
    return page > 0 ? static_cast<uint32_t>(page) : 4096u;
}

int device_create(const dm_device_options *options, void **out, dm_driver_facts *facts) {
    if (options && options->kernel_library && emu_load_library(options->kernel_library) != EMU_OK)
        return dm_set_error(DM_ERR_UNAVAILABLE, "%s", emu_last_error());
    EmuDevice *device = new (std::nothrow) EmuDevice();
    if (!device) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    int threads = options ? options->emu_threads : 0;
    const char *env = std::getenv("DARKNET_METAL_EMU_THREADS");
    if (threads <= 0 && env && *env) threads = std::atoi(env);
    device->emu = emu_device_create(threads);
    if (!device->emu) {
        delete device;
        return dm_set_error(DM_ERR_RESOURCE, "emulator: %s", emu_last_error());
    }
    std::memset(facts, 0, sizeof *facts);
    std::snprintf(facts->name, sizeof facts->name, "Metal emulator (CPU, %d threads)",
                  emu_device_threads(device->emu));
    facts->unified_memory = 1;
    facts->recommended_working_set = 0;
    facts->max_threads_per_threadgroup = EMU_MAX_GROUP_THREADS;
    facts->max_threadgroup_memory = EMU_MAX_TG_MEMORY;
    facts->apple7 = 1;           // the prelude emulates simdgroup_matrix
    facts->simdgroup_matrix = 1;
    facts->page_size = page_size();
    *out = device;
    return DM_OK;
}

void device_destroy(void *handle) {
    EmuDevice *device = static_cast<EmuDevice *>(handle);
    if (!device) return;
    emu_device_destroy(device->emu);
    delete device;
}

int buffer_alloc(void *, size_t nbytes, void **out, void **contents) {
    EmuBuffer *b = new (std::nothrow) EmuBuffer();
    if (!b) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    size_t page = page_size();
    size_t rounded = (nbytes + page - 1) / page * page;
    if (posix_memalign(&b->memory, page, rounded ? rounded : page) != 0) {
        delete b;
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory allocating %zu bytes", nbytes);
    }
    b->owned = true;
    *out = b;
    *contents = b->memory;
    return DM_OK;
}

int buffer_wrap(void *, void *host, size_t, void **out) {
    EmuBuffer *b = new (std::nothrow) EmuBuffer();
    if (!b) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    b->memory = host;
    *out = b;
    return DM_OK;
}

void buffer_free(void *, void *handle) {
    EmuBuffer *b = static_cast<EmuBuffer *>(handle);
    if (!b) return;
    if (b->owned) std::free(b->memory);
    delete b;
}

int pipeline_create(void *, const char *name, void **out, dm_driver_pipeline_facts *facts) {
    const emu_kernel_info *kernel = emu_find_kernel(name);
    if (!kernel)
        return dm_set_error(DM_ERR_NOT_FOUND,
                            "no kernel named '%s' (%d kernels are loaded into the emulator)",
                            name, emu_kernel_count());
    facts->max_total_threads = EMU_MAX_GROUP_THREADS;
    if (kernel->max_threads > 0 && kernel->max_threads < EMU_MAX_GROUP_THREADS)
        facts->max_total_threads = static_cast<uint32_t>(kernel->max_threads);
    facts->execution_width = EMU_SIMD_WIDTH;
    facts->static_tg_memory = kernel->tg_static_bytes > 0 ? kernel->tg_static_bytes : 0;
    *out = const_cast<emu_kernel_info *>(kernel);
    return DM_OK;
}

void pipeline_free(void *, void *) {}

int command_begin(void *, void **out) {
    EmuCommand *c = new (std::nothrow) EmuCommand();
    if (!c) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    *out = c;
    return DM_OK;
}

// Refused when the dispatch is checked, where the host can still be told which call was wrong
// (Metal would run the kernel on whatever is bound).
int check(void *, void *pipeline, const dm_driver_dispatch *d) {
    return dm_check_kernel_bindings(static_cast<const emu_kernel_info *>(pipeline), d);
}

int encode(void *handle, void *command, void *pipeline, const dm_driver_dispatch *d) {
    const emu_kernel_info *kernel = static_cast<const emu_kernel_info *>(pipeline);
    Recorded r;
    r.kernel = kernel;
    r.timed = static_cast<EmuDevice *>(handle)->profiling;
    std::memset(r.buffers, 0, sizeof r.buffers);
    r.n_buffers = d->n_indices;
    try {
        if (d->args_size > 0) {
            size_t words = (d->args_size + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t);
            r.args.resize(words);
            std::memcpy(r.args.data(), d->args, d->args_size);
        }
        for (int i = 0; i < d->n_indices; i++) {
            if (d->args_size > 0 && i == 0) continue;
            EmuBuffer *b = static_cast<EmuBuffer *>(d->buffers[i]);
            r.buffers[i] = b ? static_cast<char *>(b->memory) + d->offsets[i] : nullptr;
        }
        std::memset(r.tg, 0, sizeof r.tg);
        for (int i = 0; i < d->n_tg_memory; i++) r.tg[i] = d->tg_memory[i];
        for (int i = 0; i < 3; i++) {
            r.size[i] = d->grid[i];
            r.group[i] = d->group[i];
        }
        r.mode = d->mode == DM_DISPATCH_THREADGROUPS ? EMU_DISPATCH_THREADGROUPS
                                                     : EMU_DISPATCH_THREADS;
        static_cast<EmuCommand *>(command)->dispatches.push_back(std::move(r));
    } catch (const std::bad_alloc &) {
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory recording a dispatch");
    }
    return DM_OK;
}

int encode_batch(void *device, void *command, const dm_driver_item *items, int n, int *n_done) {
    *n_done = 0;
    try {
        EmuCommand *c = static_cast<EmuCommand *>(command);
        c->dispatches.reserve(c->dispatches.size() + static_cast<size_t>(n));
    } catch (const std::bad_alloc &) {
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory recording dispatches");
    }
    for (int i = 0; i < n; i++) {
        int rc = encode(device, command, items[i].pipeline, &items[i].dispatch);
        if (rc != DM_OK) return rc;
        *n_done = i + 1;
    }
    return DM_OK;
}

int commit(void *, void *command) {
    static_cast<EmuCommand *>(command)->committed = true;
    return DM_OK;
}

int wait(void *handle, void *command) {
    EmuDevice *device = static_cast<EmuDevice *>(handle);
    EmuCommand *c = static_cast<EmuCommand *>(command);
    int rc = DM_OK;
    for (size_t i = 0; i < c->dispatches.size(); i++) {
        Recorded &r = c->dispatches[i];
        if (!r.args.empty()) r.buffers[0] = r.args.data();
        emu_dispatch_desc desc;
        std::memset(&desc, 0, sizeof desc);
        desc.kernel = r.kernel;
        desc.buffers = r.buffers;
        desc.n_buffers = r.n_buffers;
        std::memcpy(desc.tg_arg_bytes, r.tg, sizeof r.tg);
        std::memcpy(desc.size, r.size, sizeof r.size);
        std::memcpy(desc.group, r.group, sizeof r.group);
        desc.mode = r.mode;
        desc.order = device->order;
        desc.seed = device->seed + device->dispatches++;
        auto start = std::chrono::steady_clock::now();
        int e = emu_dispatch(device->emu, &desc);
        if (r.timed) {
            auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - start);
            try {
                device->times.push_back(static_cast<uint64_t>(ns.count()));
            } catch (const std::bad_alloc &) {
                rc = dm_set_error(DM_ERR_RESOURCE, "out of host memory profiling");
                break;
            }
        }
        if (e != EMU_OK) {
            rc = dm_set_error(e == EMU_ERR_INVALID ? DM_ERR_INVALID : DM_ERR_EXECUTION,
                              "command buffer failed at dispatch %zu of %zu: %s", i + 1,
                              c->dispatches.size(), emu_last_error());
            break;
        }
    }
    delete c;
    return rc;
}

void discard(void *, void *command) { delete static_cast<EmuCommand *>(command); }

int set_thread_order(void *handle, int order, uint64_t seed) {
    EmuDevice *device = static_cast<EmuDevice *>(handle);
    device->order = order == DM_ORDER_REVERSE  ? EMU_ORDER_REVERSE
                    : order == DM_ORDER_RANDOM ? EMU_ORDER_RANDOM
                                               : EMU_ORDER_FORWARD;
    device->seed = seed;
    device->dispatches = 0;
    return DM_OK;
}

int profile_start(void *handle) {
    EmuDevice *device = static_cast<EmuDevice *>(handle);
    device->times.clear();
    device->profiling = true;
    return DM_OK;
}

// Host time: the emulator runs each dispatch on the CPU when the command buffer is waited for.
int profile_stop(void *handle, uint64_t *ns, size_t capacity, size_t *n, dm_profile_copies *copies) {
    EmuDevice *device = static_cast<EmuDevice *>(handle);
    device->profiling = false;
    std::memset(copies, 0, sizeof *copies);
    size_t got = std::min(capacity, device->times.size());
    if (got) std::memcpy(ns, device->times.data(), got * sizeof *ns);
    *n = device->times.size();
    device->times.clear();
    return DM_OK;
}

// Fields assigned by name, as designated initialisers would (they need C++20; the build is
// C++17): a field added to dm_driver, or moved, cannot shift the others. constexpr keeps the
// table constant-initialised, so it is complete before any code of the module runs.
constexpr dm_driver make_emu_driver() {
    dm_driver d{};
    d.name = "emulator";
    d.device_create = device_create;
    d.device_destroy = device_destroy;
    d.buffer_alloc = buffer_alloc;
    d.buffer_wrap = buffer_wrap;
    d.buffer_free = buffer_free;
    d.pipeline_create = pipeline_create;
    d.pipeline_free = pipeline_free;
    d.command_begin = command_begin;
    d.check = check;
    d.encode = encode;
    d.encode_batch = encode_batch;
    d.commit = commit;
    d.wait = wait;
    d.discard = discard;
    d.set_thread_order = set_thread_order;
    d.profile_start = profile_start;
    d.profile_stop = profile_stop;
    return d;
}

constexpr dm_driver emu_driver = make_emu_driver();

} // namespace

extern "C" const dm_driver *dm_emu_driver(void) { return &emu_driver; }
