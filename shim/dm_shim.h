/* C ABI of the host shim between Python and a compute driver (Metal, the CPU emulator, or
 * CUDA on an NVIDIA GPU for verification).
 *
 * Every function that can fail returns DM_OK (0) or a negative DM_ERR_* code and sets a
 * message for the calling thread, read with dm_last_error(). Nothing aborts the process.
 *
 * Model: a device owns a pool of buffers (by size class), a cache of pipelines (by kernel
 * name) and one command stream. Dispatches are encoded into the current command buffer,
 * which is committed by dm_device_commit (once per pass), automatically every N dispatches
 * (dm_device_set_commit_every) or before a host read. The host waits only when it reads or
 * writes a buffer that committed or pending work uses, or on dm_device_synchronize.
 *
 * A device and everything made from it must be used by one thread at a time. */
#ifndef DM_SHIM_H
#define DM_SHIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DM_OK 0
#define DM_ERR_INVALID (-1)     /* bad argument: sizes, indices, limits, null handles */
#define DM_ERR_NOT_FOUND (-2)   /* no kernel of that name */
#define DM_ERR_UNAVAILABLE (-3) /* no such device or driver on this machine */
#define DM_ERR_UNSUPPORTED (-4) /* the driver cannot do this (e.g. thread order on Metal) */
#define DM_ERR_RESOURCE (-5)    /* out of memory or driver objects */
#define DM_ERR_EXECUTION (-6)   /* a command buffer or kernel failed while running */
#define DM_ERR_COMPILE (-7)     /* shader library or pipeline could not be built */

#define DM_DEVICE_EMU 0
#define DM_DEVICE_METAL 1
#define DM_DEVICE_CUDA 2 /* the same kernels translated to CUDA, on an NVIDIA GPU */

#define DM_DISPATCH_THREADS 0      /* grid counts threads (dispatchThreads) */
#define DM_DISPATCH_THREADGROUPS 1 /* grid counts threadgroups (dispatchThreadgroups) */

#define DM_ORDER_FORWARD 0
#define DM_ORDER_REVERSE 1
#define DM_ORDER_RANDOM 2

#define DM_MAX_BUFFER_INDEX 31 /* buffer indices 0..30, Metal's argument table */
#define DM_MAX_TG_MEMORY_ARGS 8
#define DM_MAX_ARGS_BYTES 4096 /* setBytes limit */

typedef struct dm_device dm_device;
typedef struct dm_buffer dm_buffer;
typedef struct dm_pipeline dm_pipeline;
typedef struct dm_dispatch_list dm_dispatch_list;

/* Where a device finds its kernels. Metal: a precompiled library, else sources compiled at
 * run time (each an MSL translation unit with its includes already inlined). The emulator:
 * the kernel library built from the translated .metal files (emu_library.h), which the CUDA
 * driver loads too, for the kernels' tables. Any field may be NULL / 0. */
typedef struct dm_device_options {
    const char *metallib_path;
    const char *const *sources;
    const char *const *source_names; /* for messages */
    int n_sources;
    int emu_threads; /* emulator host threads; <= 0: number of cores */
    const char *kernel_library; /* emulator and CUDA: path of the emulator kernel library */
    /* CUDA: the kernel modules (fatbins) translated from the .metal sources at build time. */
    const char *const *module_paths;
    int n_modules;
} dm_device_options;

typedef struct dm_device_info {
    char name[128];
    int kind;                          /* DM_DEVICE_* */
    int unified_memory;                /* 1 if host and device share memory */
    uint64_t recommended_working_set;  /* bytes */
    uint32_t max_threads_per_threadgroup;
    uint32_t max_threadgroup_memory;   /* bytes */
    int apple7;                        /* supports MTLGPUFamilyApple7 (M1 and later) */
    int simdgroup_matrix;              /* simdgroup_matrix 8x8 available */
    uint32_t page_size;                /* alignment needed by dm_buffer_wrap */
} dm_device_info;

typedef struct dm_stats {
    uint64_t kernels_dispatched;
    uint64_t command_buffers_committed;
    uint64_t waits;              /* host waits for committed work */
    uint64_t bytes_uploaded;     /* dm_buffer_write */
    uint64_t bytes_downloaded;   /* dm_buffer_read */
    uint64_t pool_hits;
    uint64_t pool_misses;
    uint64_t cpu_fallbacks;      /* counted by the scheduler via dm_device_count_fallback */
    uint64_t pipelines_built;
    uint64_t encode_ns;          /* host time spent in dm_dispatch and dm_dispatch_list_encode */
    uint64_t allocated_bytes;    /* driver memory held: live + pooled buffers (class sizes) */
    uint64_t peak_allocated_bytes;
    uint64_t live_buffers;       /* handed out and not yet released (incl. wrapped), or
                                    released but still held by a dispatch list */
    uint64_t live_bytes;         /* their class sizes */
    uint64_t pooled_buffers;     /* released, kept for reuse */
    uint64_t pooled_bytes;
    uint64_t peak_in_flight;     /* most command buffers committed and not yet waited for at
                                    once (a counter: reset with the others) */
    uint64_t driver_copies;      /* the driver's own copies between host and device memory
                                    (CUDA keeps a device copy of each buffer; 0 where the
                                    device uses host memory in place) */
    uint64_t driver_copy_bytes;  /* their bytes */
} dm_stats;

/* One dispatch. `args` (if args_size > 0) is bound at buffer index 0 by value (setBytes);
 * buffers[i] (with offsets[i] bytes, offsets may be NULL) at index first_buffer_index + i;
 * a NULL entry leaves that index unbound. */
typedef struct dm_dispatch_desc {
    const void *args;
    size_t args_size;
    dm_buffer *const *buffers;
    const size_t *offsets;
    int n_buffers;
    int first_buffer_index;
    uint32_t grid[3];  /* threads or threadgroups, per mode */
    uint32_t group[3]; /* threads per threadgroup */
    int mode;          /* DM_DISPATCH_* */
    uint32_t tg_memory[DM_MAX_TG_MEMORY_ARGS]; /* [[threadgroup(i)]] lengths in bytes */
    int n_tg_memory;
    uint64_t tag; /* the caller's label of the dispatch, given back by profile records */
} dm_dispatch_desc;

/* Message of the last failure on this thread ("" if none). */
const char *dm_last_error(void);

/* 1 if a device of `kind` can be created on this machine (driver compiled in and, for CUDA,
 * the driver library and a GPU present); when 0, dm_last_error() says what is missing. */
int dm_device_available(int kind);
int dm_device_create(int kind, const dm_device_options *options, dm_device **out);
/* Waits for committed work, then frees every buffer, pipeline and driver object. */
void dm_device_destroy(dm_device *device);
int dm_device_get_info(dm_device *device, dm_device_info *out);
int dm_device_get_stats(dm_device *device, dm_stats *out);
/* Peak allocated bytes restart from the current value. */
int dm_device_reset_peak(dm_device *device);
/* Counters (dispatches, commits, waits, bytes, hits/misses, fallbacks, encode time) to 0. */
int dm_device_reset_counters(dm_device *device);
/* Frees pooled (released) buffers; live buffers are untouched. */
int dm_device_empty_cache(dm_device *device);
int dm_device_count_fallback(dm_device *device, uint64_t n);
/* Commit automatically after every `n` dispatches in one command buffer (0: never). */
int dm_device_set_commit_every(dm_device *device, uint32_t n);
/* Emulator only: thread order inside threadgroups (DM_ORDER_*) and seed for RANDOM. */
int dm_device_set_thread_order(dm_device *device, int order, uint64_t seed);
int dm_device_get_thread_order(dm_device *device, int *order, uint64_t *seed);
/* Commits the current command buffer if it holds work (end of a pass); does not wait. */
int dm_device_commit(dm_device *device);
/* Commits, then waits for all committed work. */
int dm_device_synchronize(dm_device *device);

/* Size class a request of `nbytes` is rounded up to (4 classes per power of two, >= 256). */
size_t dm_size_class(size_t nbytes);

/* A device buffer of at least `nbytes`, from the pool when a released one of the same
 * class exists. Contents are undefined. */
int dm_buffer_create(dm_device *device, size_t nbytes, dm_buffer **out);
/* Zero-copy buffer over host memory; `host` must be aligned to the page size and stay
 * valid until the buffer is released. DM_ERR_INVALID if not aligned. */
int dm_buffer_wrap(dm_device *device, void *host, size_t nbytes, dm_buffer **out);
/* The device may keep the contents of wrapped memory (`buffer` or any wrap sharing its memory)
 * in memory of its own between uses, as it keeps an allocated buffer's: the host sees the
 * device's changes after dm_buffer_sync and the device sees the host's after
 * dm_buffer_sync_write, and nothing is copied otherwise. Where the device uses host memory in
 * place (Metal's shared storage, the emulator) nothing changes. Without it, a driver with
 * memory of its own copies wrapped memory up at every commit and back at each wait. */
int dm_buffer_set_resident(dm_buffer *buffer);
/* The host wrote bytes [offset, offset + nbytes) of a resident wrapped buffer's memory (at a
 * time no work used it: after dm_buffer_sync): a device with memory of its own starts copying
 * them to its copy now, ordered before the work committed next, so that the copy of one part
 * overlaps the host writing the next; the rest of its copy is kept. Nothing to do where the
 * device uses host memory in place. DM_ERR_INVALID for a buffer that is not wrapped. */
int dm_buffer_flush(dm_buffer *buffer, size_t offset, size_t nbytes);
/* Returns the buffer to the pool (wrapped buffers are freed). Safe with pending work. */
void dm_buffer_release(dm_buffer *buffer);
size_t dm_buffer_size(const dm_buffer *buffer);
size_t dm_buffer_capacity(const dm_buffer *buffer);
int dm_buffer_is_wrapped(const dm_buffer *buffer);
/* Host pointer to the contents (unified memory); no synchronisation. */
void *dm_buffer_contents(dm_buffer *buffer);
/* Copy host -> buffer at `offset`; waits first if committed or pending work uses it. */
int dm_buffer_write(dm_buffer *buffer, size_t offset, const void *src, size_t nbytes);
/* Copy buffer -> host; commits pending work that uses the buffer and waits for it. */
int dm_buffer_read(dm_buffer *buffer, size_t offset, void *dst, size_t nbytes);
/* Makes the contents current for the host (as dm_buffer_read without copying). */
int dm_buffer_sync(dm_buffer *buffer);
/* As dm_buffer_sync, and the host may then change the contents through their pointer: the
 * device sees the changes from its next dispatch that uses the buffer (write them before it). */
int dm_buffer_sync_write(dm_buffer *buffer);

/* The pipeline of kernel `name`, built on first use and cached. Owned by the device. */
int dm_pipeline_get(dm_device *device, const char *name, dm_pipeline **out);
uint32_t dm_pipeline_max_threads(const dm_pipeline *pipeline);
uint32_t dm_pipeline_execution_width(const dm_pipeline *pipeline);
uint32_t dm_pipeline_static_tg_memory(const dm_pipeline *pipeline);
const char *dm_pipeline_name(const dm_pipeline *pipeline);

/* Checks the dispatch (threadgroup size against the pipeline's max total threads, indices,
 * sizes) and encodes it into the current command buffer. */
int dm_dispatch(dm_device *device, dm_pipeline *pipeline, const dm_dispatch_desc *desc);

/* Profiling: the device time of every dispatch.
 *
 * dm_profile_begin waits for the work already committed, then has the driver time each
 * dispatch encoded from then on (emulator: host time of its execution; CUDA: events around
 * its launch; Metal: timestamps sampled at its own compute encoder's boundaries, so a
 * profiled pass has one encoder per dispatch). dm_profile_end commits and waits, stops
 * timing, and gives one record per dispatch since dm_profile_begin in encode order, and the
 * driver's own copies between host copies and device memory in the window (CUDA's host
 * synchronisation; 0 elsewhere). The records belong to the device and stay valid until the
 * next dm_profile_begin or the device's destruction. DM_ERR_UNSUPPORTED when the driver
 * cannot time dispatches (a Mac GPU without stage-boundary counter sampling). */
typedef struct dm_profile_record {
    const char *kernel; /* the pipeline's name */
    uint64_t tag;       /* the dispatch's dm_dispatch_desc.tag */
    uint64_t device_ns;
} dm_profile_record;

typedef struct dm_profile_copies {
    uint64_t bytes; /* host -> device and device -> host, by the driver */
    uint64_t ns;    /* their time (device time of uploads, host time of downloads) */
    uint64_t count;
} dm_profile_copies;

int dm_profile_begin(dm_device *device);
int dm_profile_end(dm_device *device, const dm_profile_record **records, size_t *n,
                   dm_profile_copies *copies);
/* 1 while a profile is being taken. */
int dm_profile_active(const dm_device *device);

/* Prepared dispatch lists: dispatches checked and copied once, then encoded together as often
 * as needed (a forward pass replays the same list every time).
 *
 * dm_dispatch_list_add applies dm_dispatch's checks and copies the argument bytes, buffer
 * handles and offsets: the caller's descriptor and argument memory may be reused at once. A
 * dispatch list holds the buffers it names: one released while the list exists stays
 * allocated (counted live) until the list is destroyed, is never handed out by the pool
 * meanwhile, and makes dm_dispatch_list_encode fail without encoding anything.
 * dm_dispatch_list_encode encodes every dispatch in order into the current command buffer,
 * exactly as that many dm_dispatch calls would (counters, commit_every, buffer tracking), its
 * host time counted in encode_ns. A driver may record a list the first time it is encoded
 * whole and replay the recording after (CUDA: a graph launched at once, while the thread
 * order is forward and no profile is taken); adding to the list drops the recording. A
 * dispatch list whose device was destroyed can only be destroyed. */
int dm_dispatch_list_create(dm_device *device, int capacity, dm_dispatch_list **out);
int dm_dispatch_list_add(dm_dispatch_list *list, dm_pipeline *pipeline,
                         const dm_dispatch_desc *desc);
int dm_dispatch_list_encode(dm_device *device, dm_dispatch_list *list);
/* Number of dispatches in the dispatch list (0 for NULL). */
int dm_dispatch_list_size(const dm_dispatch_list *list);
/* Frees the dispatch list; buffers released while it held them go back to the pool. */
void dm_dispatch_list_destroy(dm_dispatch_list *list);

#ifdef __cplusplus
}
#endif
#endif
