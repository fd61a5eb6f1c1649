// Driver over an NVIDIA GPU: the .metal kernels translated to CUDA (shim/cuda) at build time,
// run through the CUDA driver API, loaded with dlopen at run time, so the extension builds
// and imports without CUDA and this driver only reports what is missing.
//
// It is a verification device for the Metal kernels, so it reports Apple's limits rather
// than NVIDIA's (32 KiB of threadgroup memory, at most 1024 threads a group) and refuses what
// a Mac would refuse. Memory: each buffer lives in device memory (cuMemAlloc, never managed
// memory) with a host copy, its `contents`. A command buffer records its dispatches; commit
// uploads the host copies the host changed (and wrapped host memory), launches the kernels on
// one stream and records an event; wait synchronises with that event, turns any CUDA error
// into the shim's error with the kernels' names, and copies wrapped memory back. Other host
// copies are brought up to date when the host reads them (host_access).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <unordered_set>
#include <vector>

#include <dlfcn.h>

#include "../cuda/dmc_launch.h"
#include "../emu/emu.h"
#include "bindings.h"
#include "driver.h"

namespace {

// ---- the part of the CUDA driver API used here (a stable C ABI, resolved at run time) ----

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef unsigned long long CUdeviceptr;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr int CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0;
constexpr int CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1;
constexpr int CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 2;
constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;

struct Api {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetName)(char *, int, CUdevice);
    CUresult (*DeviceTotalMem)(size_t *, CUdevice);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*DevicePrimaryCtxRelease)(CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamDestroy)(CUstream);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*EventCreate)(CUevent *, unsigned);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*EventElapsedTime)(float *, CUevent, CUevent);
    CUresult (*ModuleLoad)(CUmodule *, const char *);
    CUresult (*ModuleUnload)(CUmodule);
    CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*FuncGetAttribute)(int *, int, CUfunction);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemAllocHost)(void **, size_t);
    CUresult (*MemHostRegister)(void *, size_t, unsigned);
    CUresult (*MemHostUnregister)(void *);
    CUresult (*MemFreeHost)(void *);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void **, void **);
    CUresult (*StreamBeginCapture)(CUstream, int);
    CUresult (*StreamEndCapture)(CUstream, CUgraph *);
    CUresult (*GraphInstantiate)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*GraphLaunch)(CUgraphExec, CUstream);
    CUresult (*GraphExecDestroy)(CUgraphExec);
    CUresult (*GraphDestroy)(CUgraph);
    CUresult (*GetErrorName)(CUresult, const char **);
    CUresult (*GetErrorString)(CUresult, const char **);
};

Api api;
std::once_flag api_once;
int api_status = DM_ERR_UNAVAILABLE;
char api_error[512] = "";

template <class F>
bool resolve(void *lib, const char *name, F &slot) {
    slot = reinterpret_cast<F>(dlsym(lib, name));
    if (slot) return true;
    std::snprintf(api_error, sizeof api_error,
                  "the NVIDIA driver library has no %s (a driver for CUDA 12 or later is needed)",
                  name);
    return false;
}

void load_api() {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        std::snprintf(api_error, sizeof api_error,
                      "no NVIDIA driver: libcuda.so.1 could not be loaded (%s)", dlerror());
        return;
    }
    bool ok = resolve(lib, "cuInit", api.Init) &&
              resolve(lib, "cuDeviceGetCount", api.DeviceGetCount) &&
              resolve(lib, "cuDeviceGet", api.DeviceGet) &&
              resolve(lib, "cuDeviceGetName", api.DeviceGetName) &&
              resolve(lib, "cuDeviceTotalMem_v2", api.DeviceTotalMem) &&
              resolve(lib, "cuDevicePrimaryCtxRetain", api.DevicePrimaryCtxRetain) &&
              resolve(lib, "cuDevicePrimaryCtxRelease_v2", api.DevicePrimaryCtxRelease) &&
              resolve(lib, "cuCtxSetCurrent", api.CtxSetCurrent) &&
              resolve(lib, "cuStreamCreate", api.StreamCreate) &&
              resolve(lib, "cuStreamDestroy_v2", api.StreamDestroy) &&
              resolve(lib, "cuStreamSynchronize", api.StreamSynchronize) &&
              resolve(lib, "cuEventCreate", api.EventCreate) &&
              resolve(lib, "cuEventRecord", api.EventRecord) &&
              resolve(lib, "cuEventSynchronize", api.EventSynchronize) &&
              resolve(lib, "cuEventDestroy_v2", api.EventDestroy) &&
              resolve(lib, "cuEventElapsedTime", api.EventElapsedTime) &&
              resolve(lib, "cuModuleLoad", api.ModuleLoad) &&
              resolve(lib, "cuModuleUnload", api.ModuleUnload) &&
              resolve(lib, "cuModuleGetFunction", api.ModuleGetFunction) &&
              resolve(lib, "cuFuncGetAttribute", api.FuncGetAttribute) &&
              resolve(lib, "cuMemAlloc_v2", api.MemAlloc) &&
              resolve(lib, "cuMemFree_v2", api.MemFree) &&
              resolve(lib, "cuMemAllocHost_v2", api.MemAllocHost) &&
              resolve(lib, "cuMemFreeHost", api.MemFreeHost) &&
              resolve(lib, "cuMemHostRegister_v2", api.MemHostRegister) &&
              resolve(lib, "cuMemHostUnregister", api.MemHostUnregister) &&
              resolve(lib, "cuMemcpyHtoDAsync_v2", api.MemcpyHtoDAsync) &&
              resolve(lib, "cuMemcpyDtoHAsync_v2", api.MemcpyDtoHAsync) &&
              resolve(lib, "cuLaunchKernel", api.LaunchKernel) &&
              resolve(lib, "cuStreamBeginCapture_v2", api.StreamBeginCapture) &&
              resolve(lib, "cuStreamEndCapture", api.StreamEndCapture) &&
              resolve(lib, "cuGraphInstantiateWithFlags", api.GraphInstantiate) &&
              resolve(lib, "cuGraphLaunch", api.GraphLaunch) &&
              resolve(lib, "cuGraphExecDestroy", api.GraphExecDestroy) &&
              resolve(lib, "cuGraphDestroy", api.GraphDestroy) &&
              resolve(lib, "cuGetErrorName", api.GetErrorName) &&
              resolve(lib, "cuGetErrorString", api.GetErrorString);
    if (!ok) return;  // the library stays loaded: unloading a driver library is not safe
    CUresult rc = api.Init(0);
    if (rc != CUDA_SUCCESS) {
        const char *name = "?";
        api.GetErrorName(rc, &name);
        std::snprintf(api_error, sizeof api_error, "the NVIDIA driver did not start (cuInit: %s)",
                      name);
        return;
    }
    int count = 0;
    rc = api.DeviceGetCount(&count);
    if (rc != CUDA_SUCCESS || count < 1) {
        std::snprintf(api_error, sizeof api_error, "no NVIDIA GPU is visible to the driver");
        return;
    }
    api_status = DM_OK;
}

/* Which GPU this process uses: DARKNET_METAL_CUDA_DEVICE when set, else, in a process an MPI
 * launcher started, its rank among the processes of this machine (Open MPI's, MPICH's and
 * Slurm's variables) modulo the GPUs visible, so that the ranks of one machine spread over its
 * GPUs; else 0. Sets *ordinal, or returns an error naming a value that is not a GPU. */
int pick_ordinal(int *ordinal) {
    const char *env = std::getenv("DARKNET_METAL_CUDA_DEVICE");
    int count = 0;
    if (api.DeviceGetCount(&count) != CUDA_SUCCESS || count < 1) count = 1;
    if (env && *env) {
        char *end = nullptr;
        long value = std::strtol(env, &end, 10);
        if (*end != '\0' || value < 0 || value >= count)
            return dm_set_error(DM_ERR_INVALID,
                                "DARKNET_METAL_CUDA_DEVICE=%s is not a GPU of this machine "
                                "(%d visible: 0 to %d)", env, count, count - 1);
        *ordinal = static_cast<int>(value);
        return DM_OK;
    }
    static const char *const local_rank[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                             "PMIX_LOCAL_RANK", "SLURM_LOCALID"};
    *ordinal = 0;
    for (const char *name : local_rank) {
        const char *value = std::getenv(name);
        if (value && *value) {
            char *end = nullptr;
            long rank = std::strtol(value, &end, 10);
            if (*end == '\0' && rank >= 0) {
                *ordinal = static_cast<int>(rank % count);
                break;
            }
        }
    }
    return DM_OK;
}

int api_ready() {
    std::call_once(api_once, load_api);
    if (api_status != DM_OK) return dm_set_error(DM_ERR_UNAVAILABLE, "%s", api_error);
    return DM_OK;
}

/* The shim's error for a failed CUDA call, `what` saying which. */
int cuda_error(int code, CUresult rc, const char *what) {
    const char *name = "?", *text = "";
    api.GetErrorName(rc, &name);
    api.GetErrorString(rc, &text);
    return dm_set_error(code, "%s failed: %s (%s)", what, name, text);
}

// ---- the driver's objects ----

constexpr uint32_t APPLE_MAX_TG_MEMORY = 32768;   // bytes a threadgroup may have on Apple GPUs
constexpr uint32_t APPLE_MAX_GROUP_THREADS = 1024;
constexpr size_t ARG_ALIGN = 16;

/* A buffer, or a wrap of host memory inside memory already wrapped (zero-copy wraps alias, as
 * on Metal): such an alias shares its root's device memory and state. */
struct CudaBuffer {
    CudaBuffer *root = this;
    size_t offset = 0;   // bytes into the root's memory
    int refs = 1;        // live handles whose root this is (itself, while it is one)
    bool live = true;    // the object is a handle the core holds (a root may outlive its own)
    CUdeviceptr memory = 0;
    void *host = nullptr;  // the contents: pinned host copy, or the wrapped host memory
    size_t size = 0;
    bool wrapped = false;
    bool pinned = false;      // allocated page-locked (cuMemAllocHost)
    bool registered = false;  // wrapped memory page-locked for the copies (cuMemHostRegister)
    void *registered_at = nullptr;  // the first page locked
    // Wrapped memory the device keeps in its own copy between uses (dm_buffer_set_resident):
    // uploaded when the host said it wrote it, downloaded when the host asks, as an allocated
    // buffer's; otherwise wrapped memory goes up at every commit and comes back at each wait.
    bool resident = false;
    int in_flight = 0;          // committed command buffers that use it, not yet waited for
    bool host_newer = false;    // the host wrote the contents since the last upload
    bool device_newer = false;  // a kernel may have written it since the last download
    std::vector<CudaBuffer *> aliases;  // a root's other handles
};

struct CudaPipeline {
    CUfunction function = nullptr;
    const emu_kernel_info *kernel = nullptr;  // the translated table: buffers, flags, .metal line
    uint32_t static_tg = 0;
};

struct CudaList;

struct Recorded {
    CudaList *list;  // a whole recorded dispatch list launched as one, or null: one dispatch
    CudaPipeline *pipeline;
    dmc_launch launch;
    CudaBuffer *buffers[DM_MAX_BUFFER_INDEX];
    size_t offsets[DM_MAX_BUFFER_INDEX];
    size_t args_at;  // offset of the argument bytes in the command's arena; SIZE_MAX: none
    uint32_t groups;  // blocks of the launch
    uint32_t blocks[3];  // its grid of blocks: groups x 1 x 1, or the groups' own 3-D grid
    uint32_t block[3];
    uint32_t dynamic_tg;
    bool timed;  // encoded while profiling
};

/* What a dispatch list keeps between encodes (encode_list): its dispatches recorded once in
 * forward order, their argument bytes in device memory of its own (uploaded once), the buffers
 * they use, and the CUDA graph captured from their launches, replayed by one cuGraphLaunch
 * while every buffer's device address stays what it was at the capture (a wrap can move
 * wrapped memory onto a new device copy: the graph is captured again). Held by the dispatch
 * list and by each command that launches it. */
struct CudaList {
    std::vector<Recorded> items;  // args_at: offsets into `args`
    std::vector<unsigned char> args;
    CUdeviceptr args_device = 0;
    std::vector<CudaBuffer *> handles;          // each once
    std::vector<CudaBuffer *> written_handles;  // each once
    std::vector<CUdeviceptr> addresses;         // per handle, at the capture
    CUgraphExec graph = nullptr;
    bool no_graph = false;  // capture failed once: launch the dispatches one by one
    int refs = 1;
};

struct CudaCommand {
    std::vector<Recorded> items;
    std::vector<unsigned char> args;  // argument bytes of every dispatch, 16-byte aligned
    // Handles as encoded; their roots are taken at commit (a wrap may move a handle onto a
    // new root while the command is open).
    std::vector<CudaBuffer *> handles;
    std::unordered_set<CudaBuffer *> handle_set;
    std::unordered_set<CudaBuffer *> written_handles;  // a dispatch may write them
    std::vector<CudaBuffer *> used;            // roots, each once (from commit on)
    std::unordered_set<CudaBuffer *> written;  // roots a dispatch may write
    CUdeviceptr args_device = 0;
    size_t args_capacity = 0;
    CUevent done = nullptr;
    bool committed = false;
    std::string launch_error;  // a launch that failed at commit; reported by wait
    std::vector<CudaList *> lists;  // recorded lists this command launches (a reference each)
};

struct CudaDevice {
    CUdevice device = 0;
    CUcontext context = nullptr;
    CUstream stream = nullptr;
    std::vector<CUmodule> modules;
    std::vector<std::string> module_stems;  // "gemm" for .../gemm.fatbin: the .metal it is from
    int order = DM_ORDER_FORWARD;
    uint64_t seed = 0;
    uint64_t dispatches = 0;
    bool sync_each = false;  // DARKNET_METAL_CUDA_SYNC: wait after each launch, to name it
    std::string lost;        // set once a kernel fault has made the context unusable
    std::vector<std::pair<CUdeviceptr, size_t>> free_arenas;
    std::vector<CudaBuffer *> wrapped_roots;
    CUstream capture_stream = nullptr;  // where dispatch lists' graphs are captured
    // Profiling: a pair of timing events around each timed launch (null: not launched), in
    // launch order, the driver's own copies, and spare events for the next profile.
    bool profiling = false;
    std::vector<std::pair<CUevent, CUevent>> timed;
    std::vector<std::pair<CUevent, CUevent>> upload_times;
    std::vector<CUevent> spare_events;
    dm_profile_copies copies{};
    // Every copy between host and device memory since creation (the counters' totals).
    uint64_t copy_count = 0, copy_bytes = 0;
};

/* Counts a copy between host and device memory, in the totals and in a profile. */
void count_copy(CudaDevice *d, size_t bytes) {
    d->copy_count++;
    d->copy_bytes += bytes;
    if (d->profiling) {
        d->copies.bytes += bytes;
        d->copies.count++;
    }
}

/* A timing event from the spares, else a new one. */
CUevent timing_event(CudaDevice *d) {
    if (!d->spare_events.empty()) {
        CUevent e = d->spare_events.back();
        d->spare_events.pop_back();
        return e;
    }
    CUevent e = nullptr;
    if (api.EventCreate(&e, 0) != CUDA_SUCCESS) return nullptr;
    return e;
}

/* Host nanoseconds, for the copies the host waits for. */
uint64_t host_ns() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
}

/* Copies device -> host and waits: the host synchronisation a profile reports apart. */
CUresult download(CudaDevice *d, void *host, CUdeviceptr memory, size_t size) {
    uint64_t start = d->profiling ? host_ns() : 0;
    CUresult cr = api.MemcpyDtoHAsync(host, memory, size, d->stream);
    if (cr == CUDA_SUCCESS) cr = api.StreamSynchronize(d->stream);
    count_copy(d, size);
    if (d->profiling) d->copies.ns += host_ns() - start;
    return cr;
}

int make_current(CudaDevice *d) {
    CUresult rc = api.CtxSetCurrent(d->context);
    return rc == CUDA_SUCCESS ? DM_OK : cuda_error(DM_ERR_EXECUTION, rc, "cuCtxSetCurrent");
}

int check_usable(CudaDevice *d) {
    if (!d->lost.empty())
        return dm_set_error(DM_ERR_EXECUTION,
                            "the CUDA context was lost to an earlier kernel fault (%s); close the "
                            "device and create a new process to use the GPU again",
                            d->lost.c_str());
    return make_current(d);
}

int probe() { return api_ready(); }

void device_destroy(void *handle);

int device_create(const dm_device_options *options, void **out, dm_driver_facts *facts) {
    int rc = api_ready();
    if (rc != DM_OK) return rc;
    if (options == nullptr || options->n_modules <= 0 || options->module_paths == nullptr)
        return dm_set_error(DM_ERR_UNAVAILABLE,
                            "no CUDA kernel modules were given (they are compiled on first use "
                            "where nvcc or the nvidia-cuda-nvcc wheel is installed)");
    // The kernels' tables (buffers, flags, .metal lines) come with the emulator's kernels.
    if (options->kernel_library != nullptr && emu_load_library(options->kernel_library) != EMU_OK)
        return dm_set_error(DM_ERR_UNAVAILABLE, "%s", emu_last_error());
    CudaDevice *d = new (std::nothrow) CudaDevice();
    if (!d) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    int ordinal = 0;
    if ((rc = pick_ordinal(&ordinal)) != DM_OK) {
        delete d;
        return rc;
    }
    const char *sync = std::getenv("DARKNET_METAL_CUDA_SYNC");
    d->sync_each = sync && *sync && std::strcmp(sync, "0") != 0;
    CUresult cr = api.DeviceGet(&d->device, ordinal);
    if (cr != CUDA_SUCCESS) {
        delete d;
        return cuda_error(DM_ERR_UNAVAILABLE, cr, "cuDeviceGet (DARKNET_METAL_CUDA_DEVICE)");
    }
    cr = api.DevicePrimaryCtxRetain(&d->context, d->device);
    if (cr != CUDA_SUCCESS) {
        delete d;
        return cuda_error(DM_ERR_UNAVAILABLE, cr, "cuDevicePrimaryCtxRetain");
    }
    if ((rc = make_current(d)) != DM_OK) {
        api.DevicePrimaryCtxRelease(d->device);
        delete d;
        return rc;
    }
    cr = api.StreamCreate(&d->stream, CU_STREAM_NON_BLOCKING);
    if (cr != CUDA_SUCCESS) {
        rc = cuda_error(DM_ERR_RESOURCE, cr, "cuStreamCreate");
        device_destroy(d);
        return rc;
    }
    for (int i = 0; i < options->n_modules; i++) {
        CUmodule module = nullptr;
        cr = api.ModuleLoad(&module, options->module_paths[i]);
        if (cr != CUDA_SUCCESS) {
            const char *name = "?";
            api.GetErrorName(cr, &name);
            rc = dm_set_error(DM_ERR_COMPILE,
                              "the CUDA kernels in %s do not load on this GPU (%s); the build "
                              "has code for sm_80 and sm_90 and PTX for later GPUs",
                              options->module_paths[i], name);
            device_destroy(d);
            return rc;
        }
        d->modules.push_back(module);
        std::string stem = options->module_paths[i];
        size_t slash = stem.find_last_of('/');
        if (slash != std::string::npos) stem = stem.substr(slash + 1);
        size_t dot = stem.find('.');
        if (dot != std::string::npos) stem = stem.substr(0, dot);
        d->module_stems.push_back(stem);
    }
    std::memset(facts, 0, sizeof *facts);
    char name[100] = "NVIDIA GPU";
    api.DeviceGetName(name, sizeof name, d->device);
    std::snprintf(facts->name, sizeof facts->name, "%s (CUDA device %d, Apple limits)", name,
                  ordinal);
    size_t total = 0;
    api.DeviceTotalMem(&total, d->device);
    facts->unified_memory = 0;
    facts->recommended_working_set = total / 4 * 3;
    facts->max_threads_per_threadgroup = APPLE_MAX_GROUP_THREADS;
    facts->max_threadgroup_memory = APPLE_MAX_TG_MEMORY;
    facts->apple7 = 1;
    facts->simdgroup_matrix = 1;
    facts->page_size = 4096;
    *out = d;
    return DM_OK;
}

void device_destroy(void *handle) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    if (!d) return;
    if (api.CtxSetCurrent(d->context) == CUDA_SUCCESS) {
        if (d->stream) api.StreamSynchronize(d->stream);
        for (auto &arena : d->free_arenas) api.MemFree(arena.first);
        for (CUmodule m : d->modules) api.ModuleUnload(m);
        for (CUevent e : d->spare_events) api.EventDestroy(e);
        for (auto *pairs : {&d->timed, &d->upload_times})
            for (auto &pair : *pairs) {
                if (pair.first) api.EventDestroy(pair.first);
                if (pair.second) api.EventDestroy(pair.second);
            }
        if (d->stream) api.StreamDestroy(d->stream);
        if (d->capture_stream) api.StreamDestroy(d->capture_stream);
    }
    api.DevicePrimaryCtxRelease(d->device);
    delete d;
}

int buffer_alloc(void *handle, size_t nbytes, void **out, void **contents) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    int rc = check_usable(d);
    if (rc != DM_OK) return rc;
    CudaBuffer *b = new (std::nothrow) CudaBuffer();
    if (!b) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    size_t size = nbytes ? nbytes : 1;
    CUresult cr = api.MemAlloc(&b->memory, size);
    if (cr != CUDA_SUCCESS) {
        delete b;
        return cuda_error(DM_ERR_RESOURCE, cr, "cuMemAlloc of the buffer");
    }
    if (api.MemAllocHost(&b->host, size) == CUDA_SUCCESS) {
        b->pinned = true;
    } else {
        b->host = std::malloc(size);  // pageable: slower copies, same results
        if (!b->host) {
            api.MemFree(b->memory);
            delete b;
            return dm_set_error(DM_ERR_RESOURCE, "out of host memory allocating %zu bytes",
                                nbytes);
        }
    }
    b->size = size;
    *out = b;
    *contents = b->host;
    return DM_OK;
}

/* Page-locks wrapped memory so that its copies run at the DMA engines' rate rather than
 * through the driver's staging (measured on an H200: 53 against 13 GB/s). Only memory that is
 * whole pages (start and size multiples of 4 KiB): locking the page that holds an array's end
 * would lock whatever else the host keeps there, and another library's copy of that memory
 * would then span locked and unlocked pages, which the driver refuses. Left pageable
 * otherwise, or when the driver refuses: the copies are slower, the results the same. */
void register_host(CudaBuffer *r) {
    constexpr uintptr_t page = 4096;
    uintptr_t begin = reinterpret_cast<uintptr_t>(r->host);
    if (begin % page == 0 && r->size % page == 0 && r->size >= (64u << 10) &&
        api.MemHostRegister(r->host, r->size, 0) == CUDA_SUCCESS) {
        r->registered = true;
        r->registered_at = r->host;
    }
}

/* Host memory the host wrapped is one device copy however it is wrapped: a wrap inside a
 * wrapped range aliases it; a wrap that overlaps wrapped ranges otherwise gets one new copy of
 * their union, and those ranges' handles move onto it (their device contents reach the host
 * first). Refused only while work in flight uses a range that would move. */
int buffer_wrap(void *handle, void *host, size_t nbytes, void **out) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    int rc = check_usable(d);
    if (rc != DM_OK) return rc;
    char *begin = static_cast<char *>(host), *end = begin + nbytes;
    std::vector<CudaBuffer *> overlapping;
    for (CudaBuffer *r : d->wrapped_roots) {
        char *rb = static_cast<char *>(r->host), *re = rb + r->size;
        if (begin >= rb && end <= re) {
            CudaBuffer *b = new (std::nothrow) CudaBuffer();
            if (!b) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
            try {
                r->aliases.push_back(b);
            } catch (const std::bad_alloc &) {
                delete b;
                return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
            }
            b->root = r;
            b->offset = static_cast<size_t>(begin - rb);
            b->host = host;
            b->size = nbytes;
            b->wrapped = true;
            r->refs++;
            *out = b;
            return DM_OK;
        }
        if (begin < re && end > rb) overlapping.push_back(r);
    }
    char *union_begin = begin, *union_end = end;
    for (CudaBuffer *r : overlapping) {
        char *rb = static_cast<char *>(r->host);
        if (r->in_flight > 0)
            return dm_set_error(DM_ERR_UNSUPPORTED,
                                "cannot wrap host memory [%p, %p) on 'cuda' while work in flight "
                                "uses the overlapping wrapped memory [%p, %p)",
                                (void *)begin, (void *)end, (void *)rb, (void *)(rb + r->size));
        union_begin = std::min(union_begin, rb);
        union_end = std::max(union_end, rb + r->size);
    }
    for (CudaBuffer *r : overlapping) {
        if (!r->device_newer) continue;
        CUresult cr = api.MemcpyDtoHAsync(r->host, r->memory, r->size, d->stream);
        if (cr == CUDA_SUCCESS) cr = api.StreamSynchronize(d->stream);
        count_copy(d, r->size);
        if (cr != CUDA_SUCCESS) return cuda_error(DM_ERR_EXECUTION, cr, "copying wrapped memory back");
        r->device_newer = false;
    }
    CudaBuffer *root = new (std::nothrow) CudaBuffer();
    if (!root) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    size_t union_size = static_cast<size_t>(union_end - union_begin);
    CUresult cr = api.MemAlloc(&root->memory, union_size);
    if (cr != CUDA_SUCCESS) {
        delete root;
        return cuda_error(DM_ERR_RESOURCE, cr, "cuMemAlloc of a wrapped buffer");
    }
    root->host = union_begin;
    root->size = union_size;
    root->wrapped = true;
    root->host_newer = true;  // the host memory holds the contents: up before the first use
    for (CudaBuffer *r : overlapping) root->resident = root->resident || r->resident;
    CudaBuffer *mine = root;  // the caller's handle: the root itself when it is its range
    std::vector<CudaBuffer *> moved;  // live handles of the overlapping ranges, and mine
    try {
        if (union_begin != begin || union_end != end) {
            mine = new CudaBuffer();
            mine->host = host;
            mine->size = nbytes;
            mine->wrapped = true;
            moved.push_back(mine);
            root->live = false;
        }
        for (CudaBuffer *r : overlapping) {
            if (r->live) moved.push_back(r);
            moved.insert(moved.end(), r->aliases.begin(), r->aliases.end());
        }
        root->aliases.reserve(moved.size());
        d->wrapped_roots.push_back(root);
    } catch (const std::bad_alloc &) {
        api.MemFree(root->memory);
        if (mine != root) delete mine;
        delete root;
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    }
    for (CudaBuffer *r : overlapping) {
        api.MemFree(r->memory);
        r->memory = 0;
        if (r->registered) api.MemHostUnregister(r->registered_at);
        r->registered = false;
        d->wrapped_roots.erase(std::remove(d->wrapped_roots.begin(), d->wrapped_roots.end(), r),
                               d->wrapped_roots.end());
        r->aliases.clear();
        if (!r->live) delete r;  // a root no handle is any more: its handles moved
    }
    for (CudaBuffer *b : moved) {
        b->root = root;
        b->offset = static_cast<size_t>(static_cast<char *>(b->host) - union_begin);
        root->aliases.push_back(b);  // reserved above: cannot throw
    }
    root->refs = static_cast<int>(moved.size()) + (root->live ? 1 : 0);
    register_host(root);
    *out = mine;
    return DM_OK;
}

void buffer_free(void *handle, void *buffer) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    CudaBuffer *b = static_cast<CudaBuffer *>(buffer);
    if (!b) return;
    CudaBuffer *r = b->root;
    b->live = false;
    if (b != r) {
        r->aliases.erase(std::remove(r->aliases.begin(), r->aliases.end(), b), r->aliases.end());
        delete b;
    }
    if (--r->refs > 0) return;
    if (api.CtxSetCurrent(d->context) == CUDA_SUCCESS) {
        api.MemFree(r->memory);
        if (r->pinned) api.MemFreeHost(r->host);
        if (r->registered) api.MemHostUnregister(r->registered_at);
    }
    if (!r->pinned && !r->wrapped) std::free(r->host);
    if (r->wrapped)
        d->wrapped_roots.erase(std::remove(d->wrapped_roots.begin(), d->wrapped_roots.end(), r),
                               d->wrapped_roots.end());
    delete r;
}

int host_access(void *handle, void *buffer, int will_write) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    CudaBuffer *r = static_cast<CudaBuffer *>(buffer)->root;
    if (r->device_newer) {
        int rc = check_usable(d);
        if (rc != DM_OK) return rc;
        CUresult cr = download(d, r->host, r->memory, r->size);
        if (cr != CUDA_SUCCESS) return cuda_error(DM_ERR_EXECUTION, cr, "copying a buffer to the host");
        r->device_newer = false;
    }
    if (will_write) r->host_newer = true;
    return DM_OK;
}

// A range read or written by the host goes straight between the caller's memory and the
// device's, the range alone: a layer output read from a buffer that holds larger tensors at
// other times does not bring the whole buffer back. The host copy serves when it is current.
int buffer_read(void *handle, void *buffer, size_t offset, void *dst, size_t nbytes) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    CudaBuffer *r = static_cast<CudaBuffer *>(buffer)->root;
    offset += static_cast<CudaBuffer *>(buffer)->offset;
    if (!r->device_newer) {
        std::memcpy(dst, static_cast<char *>(r->host) + offset, nbytes);
        return DM_OK;
    }
    int rc = check_usable(d);
    if (rc != DM_OK) return rc;
    CUresult cr = download(d, dst, r->memory + offset, nbytes);
    return cr == CUDA_SUCCESS ? DM_OK : cuda_error(DM_ERR_EXECUTION, cr, "copying a buffer to the host");
}

int buffer_write(void *handle, void *buffer, size_t offset, const void *src, size_t nbytes) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    CudaBuffer *r = static_cast<CudaBuffer *>(buffer)->root;
    offset += static_cast<CudaBuffer *>(buffer)->offset;
    if (r->host_newer) {  // the host copy goes up whole before the next dispatch
        std::memcpy(static_cast<char *>(r->host) + offset, src, nbytes);
        return DM_OK;
    }
    int rc = check_usable(d);
    if (rc != DM_OK) return rc;
    // On the stream, so every later dispatch sees it; a pageable source is staged before the
    // call returns, so the caller may reuse it at once.
    CUresult cr = api.MemcpyHtoDAsync(r->memory + offset, src, nbytes, d->stream);
    if (cr != CUDA_SUCCESS) return cuda_error(DM_ERR_EXECUTION, cr, "copying to a buffer on the GPU");
    count_copy(d, nbytes);
    r->device_newer = true;  // the host copy lacks the range now
    return DM_OK;
}

// A range the host wrote into resident wrapped memory goes up now, from that memory (page-locked
// when it is whole pages: the copy runs while the host writes the next range). Memory that is
// not resident goes up whole at the next commit anyway, as does a root the host marked newer.
int buffer_flush(void *handle, void *buffer, size_t offset, size_t nbytes) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    CudaBuffer *r = static_cast<CudaBuffer *>(buffer)->root;
    offset += static_cast<CudaBuffer *>(buffer)->offset;
    if (!r->resident || r->host_newer) return DM_OK;
    int rc = check_usable(d);
    if (rc != DM_OK) return rc;
    CUresult cr = api.MemcpyHtoDAsync(r->memory + offset, static_cast<char *>(r->host) + offset,
                                      nbytes, d->stream);
    if (cr != CUDA_SUCCESS) return cuda_error(DM_ERR_EXECUTION, cr, "copying a range to the GPU");
    count_copy(d, nbytes);
    return DM_OK;
}

int pipeline_create(void *handle, const char *name, void **out, dm_driver_pipeline_facts *facts) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    int rc = check_usable(d);
    if (rc != DM_OK) return rc;
    const emu_kernel_info *kernel = emu_find_kernel(name);
    if (!kernel)
        return dm_set_error(DM_ERR_NOT_FOUND, "no kernel named '%s' (%d kernels are built)", name,
                            emu_kernel_count());
    // The module translated from the kernel's .metal file: asking the others would be a
    // failing API call for every kernel (which memcheck reports).
    std::string symbol = std::string("dmk_") + name, source = kernel->file;
    size_t slash = source.find_last_of('/');
    if (slash != std::string::npos) source = source.substr(slash + 1);
    source = source.substr(0, source.find('.'));
    CUfunction function = nullptr;
    for (size_t i = 0; i < d->modules.size(); i++) {
        if (d->module_stems[i] != source) continue;
        if (api.ModuleGetFunction(&function, d->modules[i], symbol.c_str()) != CUDA_SUCCESS)
            function = nullptr;
        break;
    }
    if (!function)
        return dm_set_error(DM_ERR_NOT_FOUND,
                            "kernel '%s' (%s:%d) is not in the CUDA build (no %s in %s.fatbin)",
                            name, kernel->file, kernel->line, symbol.c_str(), source.c_str());
    CudaPipeline *p = new (std::nothrow) CudaPipeline();
    if (!p) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    int max_threads = 0, static_tg = 0, local = 0;
    api.FuncGetAttribute(&max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, function);
    api.FuncGetAttribute(&static_tg, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function);
    api.FuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, function);
    p->function = function;
    p->kernel = kernel;
    p->static_tg = static_cast<uint32_t>(static_tg);
    uint32_t limit = APPLE_MAX_GROUP_THREADS;
    if (max_threads > 0 && static_cast<uint32_t>(max_threads) < limit)
        limit = static_cast<uint32_t>(max_threads);
    if (kernel->max_threads > 0 && static_cast<uint32_t>(kernel->max_threads) < limit)
        limit = static_cast<uint32_t>(kernel->max_threads);
    facts->max_total_threads = limit;
    facts->execution_width = 32;
    facts->static_tg_memory = p->static_tg;
    *out = p;
    return DM_OK;
}

void pipeline_free(void *, void *pipeline) { delete static_cast<CudaPipeline *>(pipeline); }

int command_begin(void *, void **out) {
    CudaCommand *c = new (std::nothrow) CudaCommand();
    if (!c) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    *out = c;
    return DM_OK;
}

bool synchronises(const emu_kernel_info *kernel) {
    return (kernel->flags & (EMU_KERNEL_BARRIER | EMU_KERNEL_SIMD)) != 0;
}

// What Metal allows but this device cannot run faithfully, refused where the host can still
// be told which call it was.
int check(void *, void *pipeline, const dm_driver_dispatch *d) {
    const CudaPipeline *p = static_cast<const CudaPipeline *>(pipeline);
    const emu_kernel_info *k = p->kernel;
    int rc = dm_check_kernel_bindings(k, d);
    if (rc != DM_OK) return rc;
    uint64_t groups = 1;
    for (int i = 0; i < 3; i++) {
        uint64_t n = d->mode == DM_DISPATCH_THREADS
                         ? (uint64_t(d->grid[i]) + d->group[i] - 1) / d->group[i]
                         : d->grid[i];
        groups *= n;
        // CUDA starts whole blocks; a thread outside the grid cannot leave a kernel that
        // waits at a barrier or exchanges values with its simdgroup.
        if (d->mode == DM_DISPATCH_THREADS && synchronises(k) && d->grid[i] % d->group[i] != 0)
            return dm_set_error(DM_ERR_INVALID,
                                "kernel '%s' (%s:%d) uses barriers or simd functions, so on "
                                "'cuda' its grid must be whole threadgroups: %u threads in "
                                "dimension %d are not a multiple of %u",
                                k->name, k->file, k->line, d->grid[i], i, d->group[i]);
    }
    if (groups > 0x7fffffffull)
        return dm_set_error(DM_ERR_INVALID, "kernel '%s': %llu threadgroups, more than CUDA's %u",
                            k->name, (unsigned long long)groups, 0x7fffffffu);
    if (d->mode == DM_DISPATCH_THREADGROUPS) {
        for (int i = 0; i < 3; i++)
            if (uint64_t(d->grid[i]) * d->group[i] > 0xffffffffull)
                return dm_set_error(DM_ERR_INVALID, "kernel '%s': more than 2^32 threads in "
                                    "dimension %d", k->name, i);
    }
    return DM_OK;
}

uint64_t gcd(uint64_t a, uint64_t b) {
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* One dispatch as a launch: its configuration for the device's thread order, and its argument
 * bytes appended to `args` (16-byte aligned; r.args_at is their offset). May throw bad_alloc. */
void record(CudaDevice *dev, CudaPipeline *p, const dm_driver_dispatch *d, Recorded &r,
            std::vector<unsigned char> &args) {
    std::memset(&r, 0, sizeof r);
    r.pipeline = p;
    r.timed = dev->profiling;
    r.args_at = SIZE_MAX;
    if (d->args_size > 0) {
        size_t at = (args.size() + ARG_ALIGN - 1) / ARG_ALIGN * ARG_ALIGN;
        args.resize(at + d->args_size);
        std::memcpy(args.data() + at, d->args, d->args_size);
        r.args_at = at;
    }
    for (int i = 0; i < d->n_indices; i++) {
        if (d->args_size > 0 && i == 0) continue;
        r.buffers[i] = static_cast<CudaBuffer *>(d->buffers[i]);
        r.offsets[i] = d->offsets[i];
    }
    uint32_t tg_at = 0;
    for (int i = 0; i < d->n_tg_memory; i++) {
        r.launch.tg_offset[i] = tg_at;
        tg_at += d->tg_memory[i];  // multiples of 16 (checked by the core)
    }
    r.dynamic_tg = tg_at;
    uint64_t groups = 1;
    for (int i = 0; i < 3; i++) {
        uint32_t n = d->mode == DM_DISPATCH_THREADS
                         ? (d->grid[i] + d->group[i] - 1) / d->group[i]
                         : d->grid[i];
        r.launch.tgpg[i] = n;
        r.launch.dtptg[i] = d->group[i];
        r.launch.tpg[i] = d->mode == DM_DISPATCH_THREADS ? d->grid[i] : n * d->group[i];
        r.block[i] = d->group[i];
        groups *= n;
    }
    r.groups = static_cast<uint32_t>(groups);
    r.launch.order = static_cast<uint32_t>(dev->order);
    r.blocks[0] = r.groups;
    r.blocks[1] = r.blocks[2] = 1;
    // In forward order a group's position is its block's: no division a thread (which
    // costs a memory-bound kernel a third of its bandwidth). CUDA caps grid y and z.
    if (dev->order == DM_ORDER_FORWARD && r.launch.tgpg[1] <= 65535u &&
        r.launch.tgpg[2] <= 65535u) {
        r.launch.order = DMC_ORDER_GRID;
        for (int i = 0; i < 3; i++) r.blocks[i] = r.launch.tgpg[i];
    }
    if (dev->order == DM_ORDER_RANDOM && groups > 1) {
        uint64_t seed = dev->seed + dev->dispatches;
        uint64_t stride = (seed * 0x9E3779B97F4A7C15ull >> 33) % groups;
        while (stride == 0 || gcd(stride, groups) != 1) stride = (stride + 1) % groups;
        r.launch.stride = static_cast<uint32_t>(stride);
        r.launch.offset = static_cast<uint32_t>((seed >> 7) % groups);
    } else {
        r.launch.stride = 1;
    }
    dev->dispatches++;
}

int encode(void *handle, void *command, void *pipeline, const dm_driver_dispatch *d) {
    CudaDevice *dev = static_cast<CudaDevice *>(handle);
    CudaCommand *c = static_cast<CudaCommand *>(command);
    CudaPipeline *p = static_cast<CudaPipeline *>(pipeline);
    try {
        Recorded r;
        record(dev, p, d, r, c->args);
        for (int i = 0; i < DM_MAX_BUFFER_INDEX; i++) {
            CudaBuffer *b = r.buffers[i];
            if (!b) continue;
            if (c->handle_set.insert(b).second) c->handles.push_back(b);
            if (p->kernel->written_mask >> i & 1u) c->written_handles.insert(b);
        }
        c->items.push_back(r);
    } catch (const std::bad_alloc &) {
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory recording a dispatch");
    }
    return DM_OK;
}

int encode_batch(void *device, void *command, const dm_driver_item *items, int n, int *n_done) {
    *n_done = 0;
    for (int i = 0; i < n; i++) {
        int rc = encode(device, command, items[i].pipeline, &items[i].dispatch);
        if (rc != DM_OK) return rc;
        *n_done = i + 1;
    }
    return DM_OK;
}

void release_list(CudaList *l) {
    if (--l->refs > 0) return;
    if (l->graph) api.GraphExecDestroy(l->graph);
    if (l->args_device) api.MemFree(l->args_device);
    delete l;
}

void list_free(void *handle, void *cache) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    if (api.CtxSetCurrent(d->context) != CUDA_SUCCESS && d->lost.empty())
        d->lost = "cuCtxSetCurrent failed";
    release_list(static_cast<CudaList *>(cache));
}

/* Whether a list's recorded launches stand for what encoding it now would launch: forward
 * order (a recorded launch keeps its order), no profile (each dispatch is timed on its own
 * there), no wait after each launch. */
bool replayable(const CudaDevice *d) {
    return d->order == DM_ORDER_FORWARD && !d->profiling && !d->sync_each;
}

/* The list's dispatches recorded once: launches, argument bytes in device memory of its own,
 * the buffers used and written (each once). */
int make_list(CudaDevice *d, const dm_driver_item *items, int n, CudaList **out) {
    CudaList *l = new (std::nothrow) CudaList();
    if (!l) return dm_set_error(DM_ERR_RESOURCE, "out of host memory recording a dispatch list");
    try {
        l->items.resize(static_cast<size_t>(n));
        std::unordered_set<CudaBuffer *> seen, seen_written;
        for (int i = 0; i < n; i++) {
            CudaPipeline *p = static_cast<CudaPipeline *>(items[i].pipeline);
            Recorded &r = l->items[static_cast<size_t>(i)];
            record(d, p, &items[i].dispatch, r, l->args);
            r.timed = false;
            for (int k = 0; k < DM_MAX_BUFFER_INDEX; k++) {
                CudaBuffer *b = r.buffers[k];
                if (!b) continue;
                if (seen.insert(b).second) l->handles.push_back(b);
                if ((p->kernel->written_mask >> k & 1u) && seen_written.insert(b).second)
                    l->written_handles.push_back(b);
            }
        }
    } catch (const std::bad_alloc &) {
        delete l;
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory recording a dispatch list");
    }
    if (!l->args.empty()) {
        CUresult cr = api.MemAlloc(&l->args_device, l->args.size());
        if (cr == CUDA_SUCCESS)
            cr = api.MemcpyHtoDAsync(l->args_device, l->args.data(), l->args.size(), d->stream);
        if (cr != CUDA_SUCCESS) {
            release_list(l);
            return cuda_error(DM_ERR_RESOURCE, cr, "keeping a dispatch list's argument bytes");
        }
        count_copy(d, l->args.size());
    }
    *out = l;
    return DM_OK;
}

int encode_list(void *handle, void *command, const dm_driver_item *items, int n, void **cache,
                int *n_done) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    CudaCommand *c = static_cast<CudaCommand *>(command);
    if (!replayable(d)) return encode_batch(handle, command, items, n, n_done);
    *n_done = 0;
    CudaList *l = static_cast<CudaList *>(*cache);
    if (!l) {
        int rc = check_usable(d);
        if (rc == DM_OK) rc = make_list(d, items, n, &l);
        if (rc != DM_OK) return rc;
        *cache = l;
    } else {
        d->dispatches += static_cast<uint64_t>(n);
    }
    try {
        c->lists.reserve(c->lists.size() + 1);
        Recorded r;
        std::memset(&r, 0, sizeof r);
        r.list = l;
        for (CudaBuffer *b : l->handles)
            if (c->handle_set.insert(b).second) c->handles.push_back(b);
        for (CudaBuffer *b : l->written_handles) c->written_handles.insert(b);
        c->items.push_back(r);
    } catch (const std::bad_alloc &) {
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory encoding a dispatch list");
    }
    l->refs++;
    c->lists.push_back(l);  // reserved above
    *n_done = n;
    return DM_OK;
}

/* Launches a dispatch (the command's or a list's) on `stream`, its buffers at their roots'
 * memory now. */
CUresult launch(Recorded &r, CUdeviceptr args_device, CUstream stream) {
    if (r.groups == 0) return CUDA_SUCCESS;
    if (r.args_at != SIZE_MAX) r.launch.buffers[0] = reinterpret_cast<void *>(args_device + r.args_at);
    for (int k = 0; k < DM_MAX_BUFFER_INDEX; k++) {
        const CudaBuffer *b = r.buffers[k];
        if (b)
            r.launch.buffers[k] =
                reinterpret_cast<void *>(b->root->memory + b->offset + r.offsets[k]);
    }
    void *params[] = {&r.launch};
    return api.LaunchKernel(r.pipeline->function, r.blocks[0], r.blocks[1], r.blocks[2],
                            r.block[0], r.block[1], r.block[2], r.dynamic_tg, stream, params,
                            nullptr);
}

/* The message of a launch that failed. */
std::string launch_failure(const Recorded &r, size_t i, size_t n, CUresult cr) {
    const char *name = "?", *text = "";
    api.GetErrorName(cr, &name);
    api.GetErrorString(cr, &text);
    const emu_kernel_info *k = r.pipeline->kernel;
    char message[768];
    std::snprintf(message, sizeof message,
                  "kernel '%s' (%s:%d), dispatch %zu of %zu, failed on the GPU: %s (%s)", k->name,
                  k->file, k->line, i + 1, n, name, text);
    return message;
}

CUresult launch_items(CudaList *l, CUstream stream, std::string *error) {
    for (size_t i = 0; i < l->items.size(); i++) {
        CUresult cr = launch(l->items[i], l->args_device, stream);
        if (cr != CUDA_SUCCESS) {
            if (error) {
                try {
                    *error = launch_failure(l->items[i], i, l->items.size(), cr);
                } catch (const std::bad_alloc &) {
                }
            }
            return cr;
        }
    }
    return CUDA_SUCCESS;
}

bool addresses_unchanged(const CudaList *l) {
    if (l->addresses.size() != l->handles.size()) return false;
    for (size_t i = 0; i < l->handles.size(); i++)
        if (l->addresses[i] != l->handles[i]->root->memory + l->handles[i]->offset) return false;
    return true;
}

/* Captures the list's launches as a graph (on a stream of its own, so that nothing else is
 * captured); on any failure the list is launched dispatch by dispatch from then on. */
void capture(CudaDevice *d, CudaList *l) {
    if (l->graph) {
        api.GraphExecDestroy(l->graph);
        l->graph = nullptr;
    }
    if (!d->capture_stream && api.StreamCreate(&d->capture_stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
        d->capture_stream = nullptr;
        l->no_graph = true;
        return;
    }
    CUgraph graph = nullptr;
    CUresult cr = api.StreamBeginCapture(d->capture_stream, CU_STREAM_CAPTURE_MODE_RELAXED);
    if (cr == CUDA_SUCCESS) {
        CUresult launched = launch_items(l, d->capture_stream, nullptr);
        cr = api.StreamEndCapture(d->capture_stream, &graph);
        if (launched != CUDA_SUCCESS) cr = launched;
    }
    if (cr == CUDA_SUCCESS && graph) cr = api.GraphInstantiate(&l->graph, graph, 0);
    if (graph) api.GraphDestroy(graph);
    if (cr != CUDA_SUCCESS || !l->graph) {
        l->graph = nullptr;
        l->no_graph = true;
        return;
    }
    try {
        l->addresses.clear();
        for (const CudaBuffer *b : l->handles) l->addresses.push_back(b->root->memory + b->offset);
    } catch (const std::bad_alloc &) {
        api.GraphExecDestroy(l->graph);
        l->graph = nullptr;
        l->no_graph = true;
        return;
    }
}

/* Launches a recorded list on the device's stream: its graph when the buffers are where they
 * were at the capture (captured first when they are not), else dispatch by dispatch. */
CUresult launch_list(CudaDevice *d, CudaList *l, std::string *error) {
    if (!l->no_graph && !(l->graph && addresses_unchanged(l))) capture(d, l);
    if (l->graph) {
        CUresult cr = api.GraphLaunch(l->graph, d->stream);
        if (cr == CUDA_SUCCESS) return cr;
        const char *name = "?";
        api.GetErrorName(cr, &name);
        char message[256];
        std::snprintf(message, sizeof message,
                      "launching a recorded dispatch list of %zu dispatches failed on the GPU: "
                      "%s", l->items.size(), name);
        try {
            *error = message;
        } catch (const std::bad_alloc &) {
        }
        return cr;
    }
    return launch_items(l, d->stream, error);
}

/* A device arena for the command's argument bytes, reused across command buffers. */
int take_arena(CudaDevice *d, CudaCommand *c) {
    size_t need = c->args.size();
    if (need == 0) return DM_OK;
    for (size_t i = 0; i < d->free_arenas.size(); i++) {
        if (d->free_arenas[i].second >= need) {
            c->args_device = d->free_arenas[i].first;
            c->args_capacity = d->free_arenas[i].second;
            d->free_arenas.erase(d->free_arenas.begin() + static_cast<long>(i));
            return DM_OK;
        }
    }
    size_t capacity = 4096;
    while (capacity < need) capacity *= 2;
    CUresult cr = api.MemAlloc(&c->args_device, capacity);
    if (cr != CUDA_SUCCESS) return cuda_error(DM_ERR_RESOURCE, cr, "cuMemAlloc of argument bytes");
    c->args_capacity = capacity;
    return DM_OK;
}

void give_arena(CudaDevice *d, CudaCommand *c) {
    if (!c->args_device) return;
    try {
        d->free_arenas.emplace_back(c->args_device, c->args_capacity);
    } catch (const std::bad_alloc &) {
        api.MemFree(c->args_device);
    }
    c->args_device = 0;
}

std::string kernel_names(const CudaCommand *c) {
    std::string names;
    std::unordered_set<std::string> seen;
    auto add = [&](const Recorded &r) {
        if (names.size() > 400 || !seen.insert(r.pipeline->kernel->name).second) return;
        if (!names.empty()) names += ", ";
        names += r.pipeline->kernel->name;
        if (names.size() > 400) names += ", ...";
    };
    for (const Recorded &r : c->items) {
        if (r.list)
            for (const Recorded &item : r.list->items) add(item);
        else
            add(r);
    }
    return names;
}

int commit(void *handle, void *command) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    CudaCommand *c = static_cast<CudaCommand *>(command);
    int rc = check_usable(d);
    if (rc != DM_OK) return rc;
    try {
        std::unordered_set<CudaBuffer *> seen;
        for (CudaBuffer *h : c->handles)
            if (seen.insert(h->root).second) c->used.push_back(h->root);
        for (CudaBuffer *h : c->written_handles) c->written.insert(h->root);
    } catch (const std::bad_alloc &) {
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory committing");
    }
    CUevent upload_start = nullptr;
    for (CudaBuffer *b : c->used) {
        // A buffer that earlier committed work still uses is newer on the device: the core
        // waits for that work before the host may write it. Wrapped memory may have been
        // written by the host at any time it was not in use.
        if (((b->wrapped && !b->resident) || b->host_newer) && b->in_flight == 0) {
            if (d->profiling && !upload_start && (upload_start = timing_event(d)))
                api.EventRecord(upload_start, d->stream);
            CUresult cr = api.MemcpyHtoDAsync(b->memory, b->host, b->size, d->stream);
            if (cr != CUDA_SUCCESS) return cuda_error(DM_ERR_EXECUTION, cr, "copying a buffer to the GPU");
            b->host_newer = false;
            count_copy(d, b->size);
        }
    }
    if (upload_start) {
        CUevent upload_end = timing_event(d);
        if (upload_end) api.EventRecord(upload_end, d->stream);
        try {
            d->upload_times.emplace_back(upload_start, upload_end);
        } catch (const std::bad_alloc &) {
            return dm_set_error(DM_ERR_RESOURCE, "out of host memory profiling");
        }
    }
    if ((rc = take_arena(d, c)) != DM_OK) return rc;
    if (!c->args.empty()) {
        CUresult cr = api.MemcpyHtoDAsync(c->args_device, c->args.data(), c->args.size(), d->stream);
        if (cr != CUDA_SUCCESS) return cuda_error(DM_ERR_EXECUTION, cr, "copying argument bytes");
        count_copy(d, c->args.size());
    }
    CUresult cr = api.EventCreate(&c->done, CU_EVENT_DISABLE_TIMING);
    if (cr != CUDA_SUCCESS) return cuda_error(DM_ERR_RESOURCE, cr, "cuEventCreate");
    for (CudaBuffer *b : c->used) {
        b->in_flight++;
        if (c->written.count(b)) b->device_newer = true;
    }
    c->committed = true;
    try {
        size_t timed = 0;
        for (const Recorded &r : c->items) timed += r.timed;
        d->timed.reserve(d->timed.size() + timed);
    } catch (const std::bad_alloc &) {
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory profiling");
    }
    for (size_t i = 0; i < c->items.size(); i++) {
        Recorded &r = c->items[i];
        if (r.list) {
            std::string error;
            if (launch_list(d, r.list, &error) != CUDA_SUCCESS) {
                c->launch_error.swap(error);
                if (c->launch_error.empty()) c->launch_error.assign("a recorded list failed");
                break;
            }
            continue;
        }
        CUevent start = nullptr, end = nullptr;
        if (r.timed && r.groups > 0 && (start = timing_event(d)) && (end = timing_event(d)))
            api.EventRecord(start, d->stream);
        if (r.timed) d->timed.emplace_back(start, end);  // reserved above
        if (r.groups == 0) continue;
        cr = launch(r, c->args_device, d->stream);
        if (end) api.EventRecord(end, d->stream);
        if (cr == CUDA_SUCCESS && d->sync_each) cr = api.StreamSynchronize(d->stream);
        if (cr != CUDA_SUCCESS) {
            try {
                c->launch_error = launch_failure(r, i, c->items.size(), cr);
            } catch (const std::bad_alloc &) {
                c->launch_error = "a kernel failed on the GPU";
            }
            break;
        }
    }
    api.EventRecord(c->done, d->stream);
    return DM_OK;
}

int wait(void *handle, void *command) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    CudaCommand *c = static_cast<CudaCommand *>(command);
    int rc = DM_OK;
    if (api.CtxSetCurrent(d->context) != CUDA_SUCCESS && d->lost.empty())
        d->lost = "cuCtxSetCurrent failed";
    CUresult cr = c->done ? api.EventSynchronize(c->done) : CUDA_SUCCESS;
    if (!c->launch_error.empty()) {
        rc = dm_set_error(DM_ERR_EXECUTION, "%s", c->launch_error.c_str());
        if (d->lost.empty()) d->lost = c->launch_error;
    } else if (cr != CUDA_SUCCESS) {
        const char *name = "?", *text = "";
        api.GetErrorName(cr, &name);
        api.GetErrorString(cr, &text);
        std::string names = kernel_names(c);
        rc = dm_set_error(DM_ERR_EXECUTION,
                          "a command buffer of %zu dispatches failed on the GPU: %s (%s) in one "
                          "of its kernels: %s (set DARKNET_METAL_CUDA_SYNC=1 to name the one)",
                          c->items.size(), name, text, names.c_str());
        if (d->lost.empty()) d->lost = std::string(name) + " in " + names;
    }
    for (CudaBuffer *b : c->used) {
        b->in_flight--;
        if (rc == DM_OK && b->wrapped && !b->resident && b->device_newer && b->in_flight == 0) {
            // Wrapped memory is read by the host directly once the work is done.
            cr = download(d, b->host, b->memory, b->size);
            if (cr != CUDA_SUCCESS) rc = cuda_error(DM_ERR_EXECUTION, cr, "copying wrapped memory back");
            b->device_newer = false;
        }
    }
    if (c->done) api.EventDestroy(c->done);
    give_arena(d, c);
    for (CudaList *l : c->lists) release_list(l);
    delete c;
    return rc;
}

void discard(void *handle, void *command) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    CudaCommand *c = static_cast<CudaCommand *>(command);
    if (c->committed) {
        (void)wait(handle, command);  // launched work must finish before its arena is reused
        return;
    }
    give_arena(d, c);
    for (CudaList *l : c->lists) release_list(l);
    delete c;
}

// The GPU schedules threadgroups itself; the order maps onto which group each block runs.
int set_thread_order(void *handle, int order, uint64_t seed) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    d->order = order;
    d->seed = seed;
    d->dispatches = 0;
    return DM_OK;
}

/* Milliseconds between two recorded events as nanoseconds (0 when either is missing). */
uint64_t elapsed_ns(CUevent start, CUevent end) {
    float ms = 0.0f;
    if (!start || !end || api.EventElapsedTime(&ms, start, end) != CUDA_SUCCESS) return 0;
    return static_cast<uint64_t>(static_cast<double>(ms) * 1e6 + 0.5);
}

void spare(CudaDevice *d, CUevent e) {
    if (!e) return;
    try {
        d->spare_events.push_back(e);
    } catch (const std::bad_alloc &) {
        api.EventDestroy(e);
    }
}

int profile_start(void *handle) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    int rc = check_usable(d);
    if (rc != DM_OK) return rc;
    d->timed.clear();
    d->upload_times.clear();
    d->copies = dm_profile_copies{};
    d->profiling = true;
    return DM_OK;
}

// Called after every timed launch completed (the core waited), so every event has fired.
int profile_stop(void *handle, uint64_t *ns, size_t capacity, size_t *n, dm_profile_copies *copies) {
    CudaDevice *d = static_cast<CudaDevice *>(handle);
    d->profiling = false;
    for (auto &pair : d->upload_times) {
        d->copies.ns += elapsed_ns(pair.first, pair.second);
        spare(d, pair.first);
        spare(d, pair.second);
    }
    *copies = d->copies;
    *n = d->timed.size();
    for (size_t i = 0; i < d->timed.size(); i++) {
        if (i < capacity) ns[i] = elapsed_ns(d->timed[i].first, d->timed[i].second);
        spare(d, d->timed[i].first);
        spare(d, d->timed[i].second);
    }
    d->timed.clear();
    d->upload_times.clear();
    return DM_OK;
}

int set_resident(void *, void *buffer) {
    static_cast<CudaBuffer *>(buffer)->root->resident = true;
    return DM_OK;
}

void copy_counters(void *handle, uint64_t *count, uint64_t *bytes) {
    const CudaDevice *d = static_cast<const CudaDevice *>(handle);
    *count = d->copy_count;
    *bytes = d->copy_bytes;
}

constexpr dm_driver make_cuda_driver() {
    dm_driver d{};
    d.name = "cuda";
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
    d.host_access = host_access;
    d.probe = probe;
    d.profile_start = profile_start;
    d.profile_stop = profile_stop;
    d.copy_counters = copy_counters;
    d.buffer_read = buffer_read;
    d.set_resident = set_resident;
    d.buffer_write = buffer_write;
    d.buffer_flush = buffer_flush;
    d.encode_list = encode_list;
    d.list_free = list_free;
    return d;
}

constexpr dm_driver cuda_driver = make_cuda_driver();

}  // namespace

extern "C" const dm_driver *dm_cuda_driver(void) { return &cuda_driver; }
