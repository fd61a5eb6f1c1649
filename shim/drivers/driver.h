/* Interface between the portable core and one compute driver (Metal, the emulator or CUDA).
 *
 * The core validates arguments and keeps pools, caches, counters and the command stream;
 * a driver only talks to its device. Handles are opaque `void *` owned by the driver.
 * Functions returning int give DM_OK or a DM_ERR_* code and, on failure, set the message
 * with dm_set_error. Nothing here may abort. */
#ifndef DM_DRIVER_H
#define DM_DRIVER_H

#include <stddef.h>
#include <stdint.h>

#include "../dm_shim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a driver reports about its device when created. */
typedef struct dm_driver_facts {
    char name[128];
    int unified_memory;
    uint64_t recommended_working_set;
    uint32_t max_threads_per_threadgroup;
    uint32_t max_threadgroup_memory;
    int apple7;
    int simdgroup_matrix;
    uint32_t page_size;
} dm_driver_facts;

typedef struct dm_driver_pipeline_facts {
    uint32_t max_total_threads; /* maxTotalThreadsPerThreadgroup */
    uint32_t execution_width;   /* threadExecutionWidth */
    uint32_t static_tg_memory;  /* staticThreadgroupMemoryLength; 0 if unknown */
} dm_driver_pipeline_facts;

/* One validated dispatch, with driver buffer handles. */
typedef struct dm_driver_dispatch {
    const void *args; /* bound at index 0 when args_size > 0 */
    size_t args_size;
    void *buffers[DM_MAX_BUFFER_INDEX]; /* driver handles by index; NULL: unbound */
    size_t offsets[DM_MAX_BUFFER_INDEX];
    int n_indices; /* highest bound index + 1 */
    uint32_t grid[3];
    uint32_t group[3];
    int mode;
    uint32_t tg_memory[DM_MAX_TG_MEMORY_ARGS];
    int n_tg_memory;
} dm_driver_dispatch;

/* One entry of a batch: a pipeline handle and its validated dispatch. */
typedef struct dm_driver_item {
    void *pipeline;
    dm_driver_dispatch dispatch;
} dm_driver_item;

/* Each driver fills its table by field name, never by position, so a field can be added or
 * moved here without silently shifting every entry after it. */
typedef struct dm_driver {
    const char *name;
    int (*device_create)(const dm_device_options *options, void **out, dm_driver_facts *facts);
    void (*device_destroy)(void *device);

    /* `contents` receives the host-visible pointer (shared storage). */
    int (*buffer_alloc)(void *device, size_t nbytes, void **out, void **contents);
    /* Zero-copy over page-aligned host memory; NULL when the driver cannot. */
    int (*buffer_wrap)(void *device, void *host, size_t nbytes, void **out);
    void (*buffer_free)(void *device, void *buffer);

    int (*pipeline_create)(void *device, const char *name, void **out,
                           dm_driver_pipeline_facts *facts);
    void (*pipeline_free)(void *device, void *pipeline);

    /* A command buffer: begun, encoded into, committed once, waited once (which frees it),
     * or discarded if never committed. */
    int (*command_begin)(void *device, void **out);
    /* Driver-specific checks of a dispatch (NULL: none), run by the core with its own before
     * a dispatch is encoded or added to a dispatch list, so a dispatch list never fails half
     * encoded. */
    int (*check)(void *device, void *pipeline, const dm_driver_dispatch *d);
    int (*encode)(void *device, void *command, void *pipeline, const dm_driver_dispatch *d);
    /* Encodes `n` dispatches in order, as `n` calls of `encode` would; on failure the ones
     * before the failing item stay encoded and *n_done says how many. NULL: the core calls
     * `encode` for each. */
    int (*encode_batch)(void *device, void *command, const dm_driver_item *items, int n,
                        int *n_done);
    int (*commit)(void *device, void *command);
    int (*wait)(void *device, void *command);
    void (*discard)(void *device, void *command);

    /* NULL when unsupported. */
    int (*set_thread_order)(void *device, int order, uint64_t seed);

    /* Called by the core after it waited for the work that uses `buffer` and before the host
     * reads (will_write 0) or changes (1) the contents through their pointer: a driver whose
     * device memory is not the host copy makes the contents current, and with will_write
     * uploads them before the next dispatch. NULL: the contents are the device's memory. */
    int (*host_access)(void *device, void *buffer, int will_write);
    /* dm_buffer_set_resident: the device may keep wrapped memory in a copy of its own
     * between uses (NULL: the device uses host memory in place, nothing to do). */
    int (*set_resident)(void *device, void *buffer);
    /* dm_buffer_flush: the host wrote bytes [offset, offset + nbytes) of wrapped memory the
     * device keeps resident; start copying them to the device's copy, ordered before the
     * work committed next (NULL: the device uses host memory in place, nothing to do). */
    int (*buffer_flush)(void *device, void *buffer, size_t offset, size_t nbytes);
    /* dm_buffer_read / dm_buffer_write of a range, after the core waited for the work that
     * uses the buffer, where the driver has memory of its own: copied straight between the
     * caller's memory and the device's, the range alone (NULL: the core copies through the
     * contents after host_access). */
    int (*buffer_read)(void *device, void *buffer, size_t offset, void *dst, size_t nbytes);
    int (*buffer_write)(void *device, void *buffer, size_t offset, const void *src,
                        size_t nbytes);
    /* Encodes a whole dispatch list (items 0..n-1), as encode_batch would, keeping in *cache
     * what it prepares once for the list (a recorded replay); the core passes the same
     * *cache until the list changes, then frees it with list_free. On failure *n_done says
     * how many stayed encoded, as encode_batch's. NULL: the core uses encode_batch. */
    int (*encode_list)(void *device, void *command, const dm_driver_item *items, int n,
                       void **cache, int *n_done);
    void (*list_free)(void *device, void *cache);
    /* Dispatch timing (dm_profile_begin/end). profile_start: time every dispatch encoded
     * from now on. profile_stop, called once all encoded work completed: the device time of
     * each timed dispatch in encode order into ns[0..*n) (*n must come out as the number of
     * dispatches encoded since profile_start, at most `capacity`), the driver's own host
     * copies in the window into *copies; timing stops. NULL: the driver cannot time. */
    int (*profile_start)(void *device);
    int (*profile_stop)(void *device, uint64_t *ns, size_t capacity, size_t *n,
                        dm_profile_copies *copies);
    /* Running totals of the driver's own copies between host and device memory since the
     * device was created (not dm_buffer_write/read's, which the core counts). NULL: none. */
    void (*copy_counters)(void *device, uint64_t *count, uint64_t *bytes);
    /* DM_OK when a device can be created on this machine, else an error saying what is
     * missing. NULL: always (the driver is compiled in). */
    int (*probe)(void);
} dm_driver;

/* Sets the calling thread's message (printf format) and returns `code`. */
int dm_set_error(int code, const char *format, ...) __attribute__((format(printf, 2, 3)));

const dm_driver *dm_emu_driver(void);
const dm_driver *dm_cuda_driver(void);
#if defined(DM_HAVE_METAL)
const dm_driver *dm_metal_driver(void);
#endif

#ifdef __cplusplus
}
#endif
#endif
