// Emulator runtime: kernel registry, thread pool, and the per-group scheduler that runs the
// threads of a threadgroup as fibers between barriers and simd collectives.
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "emu.h"
#include "emu_library.h"
#include "fiber.h"

#ifdef EMU_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace {

#ifdef EMU_ASAN
const size_t kStackSize = 512 * 1024;  // instrumented frames are several times larger
#else
const size_t kStackSize = 64 * 1024;
#endif

/* A fault of the kernel being run; caught at the base of the host thread or fiber. */
struct KernelFault {
    std::string message;
};

std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

thread_local std::string t_last_error;

int fail(int code, const std::string &message) {
    t_last_error = message;
    return code;
}

/* ---- registry ---- */

struct Registry {
    std::mutex mutex;
    std::vector<const emu_kernel_info *> kernels;
    std::string duplicate;
};

Registry &registry() {
    static Registry r;
    return r;
}

/* ---- per-group state ---- */

enum ThreadState { RUNNABLE, AT_BARRIER, AT_SIMD, DONE, FAILED };

struct Group;

struct FiberThread {
    emu_thread t;
    emu_fiber fiber;
    ThreadState state;
    const char *wait_file;
    int wait_line;
    const char *wait_op;
    emu_simd_resolve_fn wait_resolve;
    Group *group;
};

struct Worker;

struct Group {
    const emu_kernel_info *kernel;
    emu_launch launch;
    emu_thread base;          // group-level built-ins
    uint32_t n_threads;
    bool fibers;              // fiber mode (barriers / simd) or plain loop
    unsigned char *arena;     // threadgroup memory
    size_t dyn_bytes;         // [[threadgroup(i)]] memory at the start of the arena
    size_t tg_high;           // bytes of the arena filled with NaN so far in this group
    FiberThread *threads;
    emu_simd_group sg[EMU_MAX_GROUP_THREADS / EMU_SIMD_WIDTH];
    emu_fiber scheduler;
    bool failed;
    std::string error;
};

thread_local emu_thread *t_current = nullptr;

std::string where(const Group *g, const emu_thread *t) {
    std::string s = format("kernel '%s' (%s:%d): threadgroup (%u,%u,%u)", g->kernel->name,
                           g->kernel->file, g->kernel->line, g->base.tgpig.x, g->base.tgpig.y,
                           g->base.tgpig.z);
    if (t)
        s += format(", thread (%u,%u,%u) [index %u]", t->tpitg.x, t->tpitg.y, t->tpitg.z,
                    t->tiitg);
    return s;
}

Group *current_group() {
    if (!t_current) throw KernelFault{"emulator entry point called outside a kernel"};
    return static_cast<Group *>(t_current->group);
}

FiberThread *current_fiber_thread(const char *what, const char *file, int line) {
    Group *g = current_group();
    if (!g->fibers)
        throw KernelFault{format("%s at %s:%d in a kernel tabled as free of barriers and simd "
                                 "functions (the rewriter missed a call path)",
                                 what, file, line)};
    return reinterpret_cast<FiberThread *>(t_current);
}

/* ---- per-host-thread resources ---- */

struct Worker {
    unsigned char *arena = nullptr;
    std::vector<FiberThread> threads;
    unsigned char *stacks = nullptr;  // kStackSize + guard page per fiber
    size_t n_stacks = 0;
    size_t page = 4096;
    Group group;  // large (simd lane slots): kept here rather than on the host stack

    ~Worker() {
        free(arena);
        if (stacks) munmap(stacks, n_stacks * (kStackSize + page));
    }

    bool init() {
        page = (size_t)sysconf(_SC_PAGESIZE);
        if (posix_memalign((void **)&arena, 64, EMU_MAX_TG_MEMORY) != 0) return false;
        threads.resize(EMU_MAX_GROUP_THREADS);
        return true;
    }

    /* Stacks are reserved once for the largest group seen; pages are committed on use. */
    bool ensure_stacks(size_t n) {
        if (n <= n_stacks) return true;
        if (stacks) munmap(stacks, n_stacks * (kStackSize + page));
        stacks = nullptr;
        n_stacks = 0;
        size_t slot = kStackSize + page;
        void *p = mmap(nullptr, n * slot, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS
#ifdef MAP_NORESERVE
                                                                      | MAP_NORESERVE
#endif
                       , -1, 0);
        if (p == MAP_FAILED) return false;
        stacks = static_cast<unsigned char *>(p);
        n_stacks = n;
        for (size_t i = 0; i < n; ++i) mprotect(stacks + i * slot, page, PROT_NONE);
        return true;
    }

    unsigned char *stack(size_t i) { return stacks + i * (kStackSize + page) + page; }
};

/* ---- fiber scheduling ---- */

void fiber_entry(void *arg) {
    FiberThread *th = static_cast<FiberThread *>(arg);
    Group *g = th->group;
    const void *bottom = nullptr;
    size_t size = 0;
    emu_fiber_entered(&th->fiber, &bottom, &size);
    if (bottom && !g->scheduler.stack) {
        g->scheduler.stack = const_cast<void *>(bottom);
        g->scheduler.size = size;
    }
    try {
        g->kernel->thread(&g->launch, &th->t);
        th->state = DONE;
    } catch (const KernelFault &f) {
        th->state = FAILED;
        if (!g->failed) {
            g->failed = true;
            g->error = where(g, &th->t) + ": " + f.message;
        }
    } catch (...) {
        th->state = FAILED;
        if (!g->failed) {
            g->failed = true;
            g->error = where(g, &th->t) + ": unexpected C++ exception";
        }
    }
    emu_fiber_switch(&th->fiber, &g->scheduler, 1);
}

uint64_t splitmix(uint64_t &s) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void group_fail(Group *g, const emu_thread *t, const std::string &message) {
    if (!g->failed) {
        g->failed = true;
        g->error = where(g, t) + ": " + message;
    }
}

std::string lane_state(const FiberThread &th) {
    switch (th.state) {
    case DONE:
        return "returned";
    case AT_BARRIER:
        return format("waits at threadgroup_barrier (%s:%d)", th.wait_file, th.wait_line);
    case AT_SIMD:
        return format("waits at %s (%s:%d)", th.wait_op, th.wait_file, th.wait_line);
    default:
        return "is running";
    }
}

/* Checks and completes the simd collectives that every lane of a simdgroup has reached.
 * Returns true if some lanes may run again. */
bool resolve_simd(Group *g) {
    bool progress = false;
    const uint32_t n_sg = (g->n_threads + EMU_SIMD_WIDTH - 1) / EMU_SIMD_WIDTH;
    for (uint32_t s = 0; s < n_sg && !g->failed; ++s) {
        FiberThread *lanes = g->threads + s * EMU_SIMD_WIDTH;
        const uint32_t n = g->sg[s].n_lanes;
        int first = -1;
        for (uint32_t i = 0; i < n; ++i)
            if (lanes[i].state == AT_SIMD) {
                first = (int)i;
                break;
            }
        if (first < 0) continue;
        const FiberThread &a = lanes[first];
        for (uint32_t i = 0; i < n; ++i) {
            const FiberThread &b = lanes[i];
            bool same = b.state == AT_SIMD && b.wait_resolve == a.wait_resolve &&
                        b.wait_line == a.wait_line && strcmp(b.wait_file, a.wait_file) == 0;
            if (!same) {
                group_fail(g, &a.t,
                           format("%s (%s:%d) reached by only part of simdgroup %u: lane %u %s",
                                  a.wait_op, a.wait_file, a.wait_line, s, i,
                                  lane_state(b).c_str()));
                return false;
            }
        }
        a.wait_resolve(&g->sg[s]);
        for (uint32_t i = 0; i < n; ++i) lanes[i].state = RUNNABLE;
        progress = true;
    }
    return progress;
}

/* Releases a barrier that every thread has reached. Returns false when the group is done. */
bool release_barrier(Group *g) {
    const FiberThread *waiting = nullptr, *returned = nullptr;
    for (uint32_t i = 0; i < g->n_threads; ++i) {
        const FiberThread &th = g->threads[i];
        if (th.state == AT_BARRIER && !waiting) waiting = &th;
        if (th.state == DONE && !returned) returned = &th;
        if (th.state == RUNNABLE || th.state == AT_SIMD) return true;  // cannot happen here
    }
    if (!waiting) return false;
    if (returned) {
        group_fail(g, &returned->t,
                   format("thread returned while other threads wait at threadgroup_barrier "
                          "(%s:%d)",
                          waiting->wait_file, waiting->wait_line));
        return false;
    }
    for (uint32_t i = 0; i < g->n_threads; ++i) {
        const FiberThread &th = g->threads[i];
        if (th.wait_line != waiting->wait_line || strcmp(th.wait_file, waiting->wait_file) != 0) {
            group_fail(g, &th.t,
                       format("threads wait at different barriers: %s:%d and %s:%d",
                              th.wait_file, th.wait_line, waiting->wait_file,
                              waiting->wait_line));
            return false;
        }
    }
    for (uint32_t i = 0; i < g->n_threads; ++i) g->threads[i].state = RUNNABLE;
    return true;
}

void run_fibers(Group *g, Worker *w, int order, uint64_t seed) {
    const uint32_t n = g->n_threads;
    g->scheduler.stack = nullptr;
    g->scheduler.size = 0;
    for (uint32_t i = 0; i < n; ++i) {
        FiberThread &th = w->threads[i];
        th.t = g->base;
        emu_thread_set_index(&th.t, i);
        th.t.group = g;
        th.state = RUNNABLE;
        th.group = g;
        th.wait_file = "";
        th.wait_line = 0;
        th.wait_op = "";
        th.wait_resolve = nullptr;
#ifdef EMU_ASAN
        // A fiber abandoned after an error leaves poisoned frames on its stack.
        ASAN_UNPOISON_MEMORY_REGION(w->stack(i), kStackSize);
#endif
        emu_fiber_make(&th.fiber, w->stack(i), kStackSize, fiber_entry, &th);
    }
    const uint32_t n_sg = (n + EMU_SIMD_WIDTH - 1) / EMU_SIMD_WIDTH;
    for (uint32_t s = 0; s < n_sg; ++s)
        g->sg[s].n_lanes = s + 1 == n_sg ? n - s * EMU_SIMD_WIDTH : EMU_SIMD_WIDTH;

    std::vector<uint32_t> perm(n);
    uint64_t rng = seed;
    for (;;) {
        for (uint32_t i = 0; i < n; ++i) perm[i] = order == EMU_ORDER_REVERSE ? n - 1 - i : i;
        if (order == EMU_ORDER_RANDOM)
            for (uint32_t i = n; i > 1; --i) {
                uint32_t j = (uint32_t)(splitmix(rng) % i);
                uint32_t tmp = perm[i - 1];
                perm[i - 1] = perm[j];
                perm[j] = tmp;
            }
        for (uint32_t k = 0; k < n && !g->failed; ++k) {
            FiberThread &th = g->threads[perm[k]];
            if (th.state != RUNNABLE) continue;
            t_current = &th.t;
            emu_fiber_switch(&g->scheduler, &th.fiber, 0);
        }
        if (g->failed) return;
        if (resolve_simd(g)) continue;
        if (g->failed) return;
        if (!release_barrier(g)) return;
    }
}

void run_group(Group *g, Worker *w, uint32_t gx, uint32_t gy, uint32_t gz,
               const emu_dispatch_desc *d, const uint32_t groups[3]) {
    const uint32_t gpos[3] = {gx, gy, gz};
    emu_thread &b = g->base;
    memset(&b, 0, sizeof b);
    uint32_t tptg[3], tpg[3];
    for (int k = 0; k < 3; ++k) {
        if (d->mode == EMU_DISPATCH_THREADS) {
            tpg[k] = d->size[k];
            uint32_t rest = d->size[k] - gpos[k] * d->group[k];
            tptg[k] = rest < d->group[k] ? rest : d->group[k];
        } else {
            tpg[k] = d->size[k] * d->group[k];
            tptg[k] = d->group[k];
        }
    }
    b.tgpig = {gx, gy, gz};
    b.tptg = {tptg[0], tptg[1], tptg[2]};
    b.dtptg = {d->group[0], d->group[1], d->group[2]};
    b.tpg = {tpg[0], tpg[1], tpg[2]};
    b.tgpg = {groups[0], groups[1], groups[2]};
    b.group = g;
    g->n_threads = tptg[0] * tptg[1] * tptg[2];
    g->failed = false;
    g->error.clear();
    g->threads = w->threads.data();

    // Threadgroup memory holds garbage on a GPU: NaN bytes make reads before writes visible.
    size_t off = 0;
    for (int i = 0; i < EMU_MAX_TG_ARGS; ++i) {
        g->launch.tg_args[i] = nullptr;
        if (d->tg_arg_bytes[i]) {
            g->launch.tg_args[i] = w->arena + off;
            off += (d->tg_arg_bytes[i] + 15) & ~(size_t)15;
        }
    }
    memset(w->arena, 0xFF, off);
    g->dyn_bytes = off;
    g->tg_high = off;

    uint64_t gid = ((uint64_t)gz * groups[1] + gy) * groups[0] + gx;
    uint64_t seed = d->seed ^ (gid * 0xD1B54A32D192ED03ull);
    if (g->fibers) {
        run_fibers(g, w, d->order, seed);
        t_current = nullptr;
        return;
    }
    t_current = &b;
    try {
        g->kernel->group(&g->launch, &b, d->order, seed);
    } catch (const KernelFault &f) {
        group_fail(g, &b, f.message);
    } catch (...) {
        group_fail(g, &b, "unexpected C++ exception");
    }
    t_current = nullptr;
}

/* ---- dispatch ---- */

struct Job {
    const emu_dispatch_desc *desc;
    uint32_t groups[3];
    uint64_t total;
    std::atomic<uint64_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex mutex;
    std::string error;
    int code = EMU_OK;
};

}  // namespace

struct emu_device {
    int n_threads = 1;
    std::vector<std::thread> pool;
    std::vector<Worker *> workers;
    std::mutex mutex;
    std::condition_variable wake, done;
    uint64_t generation = 0;
    int busy = 0;
    bool stop = false;
    Job *job = nullptr;
    std::mutex dispatch_mutex;  // one dispatch at a time per device
};

namespace {

void work(Job *job, Worker *w) {
    const emu_dispatch_desc *d = job->desc;
    Group &g = w->group;
    g.kernel = d->kernel;
    g.launch.buffers = d->buffers;
    g.launch.n_buffers = d->n_buffers;
    g.fibers = (d->kernel->flags & (EMU_KERNEL_BARRIER | EMU_KERNEL_SIMD)) != 0;
    g.arena = w->arena;
    const uint32_t *n = job->groups;
    for (;;) {
        if (job->failed.load(std::memory_order_relaxed)) return;
        uint64_t i = job->next.fetch_add(1, std::memory_order_relaxed);
        if (i >= job->total) return;
        uint32_t gx = (uint32_t)(i % n[0]);
        uint32_t gy = (uint32_t)((i / n[0]) % n[1]);
        uint32_t gz = (uint32_t)(i / ((uint64_t)n[0] * n[1]));
        run_group(&g, w, gx, gy, gz, d, n);
        if (g.failed) {
            std::lock_guard<std::mutex> lock(job->mutex);
            if (!job->failed.exchange(true)) {
                job->error = g.error;
                job->code = EMU_ERR_KERNEL;
            }
            return;
        }
    }
}

void pool_main(emu_device *dev, int index) {
    uint64_t seen = 0;
    for (;;) {
        Job *job;
        {
            std::unique_lock<std::mutex> lock(dev->mutex);
            dev->wake.wait(lock, [&] { return dev->stop || dev->generation != seen; });
            if (dev->stop) return;
            seen = dev->generation;
            job = dev->job;
        }
        work(job, dev->workers[index]);
        {
            std::lock_guard<std::mutex> lock(dev->mutex);
            if (--dev->busy == 0) dev->done.notify_all();
        }
    }
}

int validate(const emu_dispatch_desc *d, uint32_t groups[3]) {
    if (!d || !d->kernel) return fail(EMU_ERR_INVALID, "dispatch without a kernel");
    const emu_kernel_info *k = d->kernel;
    std::string name = format("kernel '%s'", k->name);
    if (d->mode != EMU_DISPATCH_THREADS && d->mode != EMU_DISPATCH_THREADGROUPS)
        return fail(EMU_ERR_INVALID, name + format(": unknown dispatch mode %d", d->mode));
    if (d->order < EMU_ORDER_FORWARD || d->order > EMU_ORDER_RANDOM)
        return fail(EMU_ERR_INVALID, name + format(": unknown thread order %d", d->order));
    for (int i = 0; i < 3; ++i) {
        if (d->size[i] == 0)
            return fail(EMU_ERR_INVALID,
                        name + format(": zero-size grid (%u,%u,%u)", d->size[0], d->size[1],
                                      d->size[2]));
        if (d->group[i] == 0)
            return fail(EMU_ERR_INVALID,
                        name + format(": zero-size threadgroup (%u,%u,%u)", d->group[0],
                                      d->group[1], d->group[2]));
    }
    uint64_t per_group = (uint64_t)d->group[0] * d->group[1] * d->group[2];
    if (per_group > EMU_MAX_GROUP_THREADS)
        return fail(EMU_ERR_INVALID,
                    name + format(": %llu threads per threadgroup (%u,%u,%u) exceed the limit of "
                                  "%d",
                                  (unsigned long long)per_group, d->group[0], d->group[1],
                                  d->group[2], EMU_MAX_GROUP_THREADS));
    if (k->max_threads > 0 && per_group > (uint64_t)k->max_threads)
        return fail(EMU_ERR_INVALID,
                    name + format(": %llu threads per threadgroup exceed the kernel's "
                                  "max_total_threads_per_threadgroup(%d)",
                                  (unsigned long long)per_group, k->max_threads));
    for (int i = 0; i < EMU_MAX_BUFFERS; ++i) {
        if (!(k->buffer_mask >> i & 1u)) continue;
        if (i >= d->n_buffers || !d->buffers || !d->buffers[i])
            return fail(EMU_ERR_INVALID, name + format(": buffer(%d) is not bound", i));
    }
    uint64_t tg_bytes = 0;
    for (int i = 0; i < EMU_MAX_TG_ARGS; ++i) {
        if ((k->tg_arg_mask >> i & 1u) && d->tg_arg_bytes[i] == 0)
            return fail(EMU_ERR_INVALID,
                        name + format(": threadgroup(%d) memory length is not set", i));
        tg_bytes += (d->tg_arg_bytes[i] + 15u) & ~15u;
    }
    if (k->tg_static_bytes > 0) tg_bytes += (uint64_t)k->tg_static_bytes;
    if (tg_bytes > EMU_MAX_TG_MEMORY)
        return fail(EMU_ERR_INVALID,
                    name + format(": %llu bytes of threadgroup memory exceed the limit of %d",
                                  (unsigned long long)tg_bytes, EMU_MAX_TG_MEMORY));
    for (int i = 0; i < 3; ++i)
        groups[i] = d->mode == EMU_DISPATCH_THREADS ? (d->size[i] + d->group[i] - 1) / d->group[i]
                                                    : d->size[i];
    return EMU_OK;
}

}  // namespace

extern "C" {

emu_thread *emu_rt_current(void) { return t_current; }

void *emu_rt_tg_alloc(size_t bytes, size_t align, const char *file, int line) {
    Group *g = current_group();
    if (align < 1) align = 1;
    size_t off = (g->dyn_bytes + t_current->tg_cursor + align - 1) & ~(align - 1);
    size_t end = off + bytes;
    if (end > EMU_MAX_TG_MEMORY)
        throw KernelFault{format("threadgroup memory of %zu bytes (declaration at %s:%d) exceeds "
                                 "the limit of %d bytes",
                                 end, file, line, EMU_MAX_TG_MEMORY)};
    if (end > g->tg_high) {
        memset(g->arena + g->tg_high, 0xFF, end - g->tg_high);
        g->tg_high = end;
    }
    t_current->tg_cursor = end - g->dyn_bytes;
    return g->arena + off;
}

void emu_rt_barrier(const char *file, int line) {
    FiberThread *th = current_fiber_thread("threadgroup_barrier", file, line);
    th->state = AT_BARRIER;
    th->wait_file = file;
    th->wait_line = line;
    th->wait_op = "threadgroup_barrier";
    emu_fiber_switch(&th->fiber, &th->group->scheduler, 0);
}

emu_simd_lane *emu_rt_simd_lane(const char *op, const char *file, int line) {
    FiberThread *th = current_fiber_thread(op, file, line);
    return &th->group->sg[th->t.sgitg].lane[th->t.tiisg];
}

void emu_rt_simd_wait(emu_simd_resolve_fn resolve, const char *op, const char *file, int line) {
    FiberThread *th = current_fiber_thread(op, file, line);
    th->state = AT_SIMD;
    th->wait_file = file;
    th->wait_line = line;
    th->wait_op = op;
    th->wait_resolve = resolve;
    emu_fiber_switch(&th->fiber, &th->group->scheduler, 0);
}

void emu_rt_fail(const char *file, int line, const char *message) {
    throw KernelFault{format("%s:%d: %s", file, line, message)};
}

int emu_register_kernels(const emu_kernel_info *table, int count) {
    Registry &r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (int i = 0; i < count; ++i) {
        for (const emu_kernel_info *k : r.kernels)
            if (strcmp(k->name, table[i].name) == 0 && r.duplicate.empty())
                r.duplicate = format("kernel '%s' defined twice (%s:%d and %s:%d)", k->name,
                                     k->file, k->line, table[i].file, table[i].line);
        r.kernels.push_back(&table[i]);
    }
    return count;
}

const emu_kernel_info *emu_find_kernel(const char *name) {
    Registry &r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (!r.duplicate.empty()) {
        fail(EMU_ERR_INVALID, r.duplicate);
        return nullptr;
    }
    for (const emu_kernel_info *k : r.kernels)
        if (strcmp(k->name, name) == 0) return k;
    fail(EMU_ERR_NOT_FOUND, format("no kernel named '%s'", name));
    return nullptr;
}

int emu_kernel_count(void) {
    Registry &r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    return (int)r.kernels.size();
}

const emu_kernel_info *emu_kernel_at(int index) {
    Registry &r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (index < 0 || index >= (int)r.kernels.size()) return nullptr;
    return r.kernels[index];
}

int emu_load_library(const char *path) {
    if (path == nullptr || *path == '\0') return fail(EMU_ERR_INVALID, "no kernel library named");
    static std::mutex mutex;
    static std::vector<void *> loaded;  // never closed: their kernels stay registered
    std::lock_guard<std::mutex> lock(mutex);
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
        const char *why = dlerror();
        return fail(EMU_ERR_NOT_FOUND,
                    format("cannot load the emulator's kernels from %s: %s (delete that file "
                           "to compile them again on next use)",
                           path, why ? why : "unknown error"));
    }
    for (void *h : loaded)
        if (h == handle) {
            dlclose(handle);  // drops the reference this call added
            return EMU_OK;
        }
    void *entry = dlsym(handle, EMU_LIBRARY_ENTRY);
    if (entry == nullptr) {
        dlclose(handle);
        return fail(EMU_ERR_INVALID,
                    format("%s is not an emulator kernel library (no %s)", path, EMU_LIBRARY_ENTRY));
    }
    static const emu_runtime_api api = {
        EMU_LIBRARY_ABI,  (uint32_t)sizeof(emu_thread), (uint32_t)sizeof(emu_kernel_info),
        emu_rt_current,   emu_rt_tg_alloc,              emu_rt_barrier,
        emu_rt_simd_lane, emu_rt_simd_wait,             emu_rt_fail,
    };
    emu_library_attach_fn attach;
    memcpy(&attach, &entry, sizeof attach);
    int count = attach(&api, emu_register_kernels);
    if (count < 0) {
        dlclose(handle);
        return fail(EMU_ERR_INVALID,
                    format("%s was built for another emulator runtime (ABI %d expected); "
                           "rebuild it with `darknet-metal build-kernels --device emu`",
                           path, EMU_LIBRARY_ABI));
    }
    loaded.push_back(handle);
    return EMU_OK;
}

const char *emu_last_error(void) { return t_last_error.c_str(); }

emu_device *emu_device_create(int n_threads) {
    if (n_threads <= 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = cores > 0 ? (int)cores : 1;
    }
    emu_device *dev = new (std::nothrow) emu_device;
    if (!dev) {
        fail(EMU_ERR_RESOURCE, "out of memory");
        return nullptr;
    }
    dev->n_threads = n_threads;
    for (int i = 0; i < n_threads; ++i) {
        Worker *w = new (std::nothrow) Worker;
        if (!w || !w->init()) {
            delete w;
            emu_device_destroy(dev);
            fail(EMU_ERR_RESOURCE, "out of memory for threadgroup memory");
            return nullptr;
        }
        dev->workers.push_back(w);
    }
    try {
        for (int i = 1; i < n_threads; ++i) dev->pool.emplace_back(pool_main, dev, i);
    } catch (...) {
        emu_device_destroy(dev);
        fail(EMU_ERR_RESOURCE, "cannot start host threads");
        return nullptr;
    }
    return dev;
}

void emu_device_destroy(emu_device *dev) {
    if (!dev) return;
    {
        std::lock_guard<std::mutex> lock(dev->mutex);
        dev->stop = true;
    }
    dev->wake.notify_all();
    for (std::thread &t : dev->pool) t.join();
    for (Worker *w : dev->workers) delete w;
    delete dev;
}

int emu_device_threads(const emu_device *dev) { return dev ? dev->n_threads : 0; }

int emu_dispatch(emu_device *dev, const emu_dispatch_desc *desc) {
    if (!dev) return fail(EMU_ERR_INVALID, "dispatch on a null device");
    Job job;
    int rc = validate(desc, job.groups);
    if (rc != EMU_OK) return rc;
    job.desc = desc;
    job.total = (uint64_t)job.groups[0] * job.groups[1] * job.groups[2];
    bool fibers = (desc->kernel->flags & (EMU_KERNEL_BARRIER | EMU_KERNEL_SIMD)) != 0;
    uint64_t per_group = (uint64_t)desc->group[0] * desc->group[1] * desc->group[2];

    std::lock_guard<std::mutex> serial(dev->dispatch_mutex);
    // Every pool thread wakes for a job, so each needs its resources even if it finds no work.
    int helpers = job.total > 1 ? (int)dev->pool.size() : 0;
    if (fibers) {
        for (int i = 0; i <= helpers; ++i)
            if (!dev->workers[i]->ensure_stacks(per_group))
                return fail(EMU_ERR_RESOURCE, "cannot map fiber stacks");
    }
    if (helpers > 0) {
        std::lock_guard<std::mutex> lock(dev->mutex);
        dev->job = &job;
        dev->busy = (int)dev->pool.size();
        ++dev->generation;
    }
    if (helpers > 0) dev->wake.notify_all();
    work(&job, dev->workers[0]);
    if (helpers > 0) {
        std::unique_lock<std::mutex> lock(dev->mutex);
        dev->done.wait(lock, [&] { return dev->busy == 0; });
        dev->job = nullptr;
    }
    if (job.failed.load()) return fail(job.code, job.error);
    t_last_error.clear();
    return EMU_OK;
}

}  // extern "C"
