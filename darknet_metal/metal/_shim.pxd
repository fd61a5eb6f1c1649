# C API of the host shim (shim/dm_shim.h) and the Python classes over it.
from libc.stdint cimport uint32_t, uint64_t


cdef extern from "dm_shim.h" nogil:
    int DM_OK
    int DM_ERR_INVALID
    int DM_ERR_NOT_FOUND
    int DM_ERR_UNAVAILABLE
    int DM_ERR_UNSUPPORTED
    int DM_ERR_RESOURCE
    int DM_ERR_EXECUTION
    int DM_ERR_COMPILE
    int DM_DEVICE_EMU
    int DM_DEVICE_METAL
    int DM_DEVICE_CUDA
    int DM_DISPATCH_THREADS
    int DM_DISPATCH_THREADGROUPS
    int DM_ORDER_FORWARD
    int DM_ORDER_REVERSE
    int DM_ORDER_RANDOM
    int DM_MAX_BUFFER_INDEX
    int DM_MAX_TG_MEMORY_ARGS
    int DM_MAX_ARGS_BYTES

    ctypedef struct dm_device:
        pass
    ctypedef struct dm_buffer:
        pass
    ctypedef struct dm_pipeline:
        pass
    ctypedef struct dm_dispatch_list:
        pass

    ctypedef struct dm_device_options:
        const char *metallib_path
        const char *const *sources
        const char *const *source_names
        int n_sources
        int emu_threads
        const char *kernel_library
        const char *const *module_paths
        int n_modules

    ctypedef struct dm_device_info:
        char name[128]
        int kind
        int unified_memory
        uint64_t recommended_working_set
        uint32_t max_threads_per_threadgroup
        uint32_t max_threadgroup_memory
        int apple7
        int simdgroup_matrix
        uint32_t page_size

    ctypedef struct dm_stats:
        uint64_t kernels_dispatched
        uint64_t command_buffers_committed
        uint64_t waits
        uint64_t bytes_uploaded
        uint64_t bytes_downloaded
        uint64_t pool_hits
        uint64_t pool_misses
        uint64_t cpu_fallbacks
        uint64_t pipelines_built
        uint64_t encode_ns
        uint64_t allocated_bytes
        uint64_t peak_allocated_bytes
        uint64_t live_buffers
        uint64_t live_bytes
        uint64_t pooled_buffers
        uint64_t pooled_bytes
        uint64_t peak_in_flight
        uint64_t driver_copies
        uint64_t driver_copy_bytes

    ctypedef struct dm_dispatch_desc:
        const void *args
        size_t args_size
        dm_buffer *const *buffers
        const size_t *offsets
        int n_buffers
        int first_buffer_index
        uint32_t grid[3]
        uint32_t group[3]
        int mode
        uint32_t tg_memory[8]
        int n_tg_memory
        uint64_t tag

    ctypedef struct dm_profile_record:
        const char *kernel
        uint64_t tag
        uint64_t device_ns

    ctypedef struct dm_profile_copies:
        uint64_t bytes
        uint64_t ns
        uint64_t count

    int dm_profile_begin(dm_device *device)
    int dm_profile_end(dm_device *device, const dm_profile_record **records, size_t *n,
                       dm_profile_copies *copies)
    int dm_profile_active(const dm_device *device)

    const char *dm_last_error()
    int dm_device_available(int kind)
    int dm_device_create(int kind, const dm_device_options *options, dm_device **out)
    void dm_device_destroy(dm_device *device)
    int dm_device_get_info(dm_device *device, dm_device_info *out)
    int dm_device_get_stats(dm_device *device, dm_stats *out)
    int dm_device_reset_peak(dm_device *device)
    int dm_device_reset_counters(dm_device *device)
    int dm_device_empty_cache(dm_device *device)
    int dm_device_count_fallback(dm_device *device, uint64_t n)
    int dm_device_set_commit_every(dm_device *device, uint32_t n)
    int dm_device_set_thread_order(dm_device *device, int order, uint64_t seed)
    int dm_device_get_thread_order(dm_device *device, int *order, uint64_t *seed)
    int dm_device_commit(dm_device *device)
    int dm_device_synchronize(dm_device *device)
    size_t dm_size_class(size_t nbytes)
    int dm_buffer_create(dm_device *device, size_t nbytes, dm_buffer **out)
    int dm_buffer_wrap(dm_device *device, void *host, size_t nbytes, dm_buffer **out)
    void dm_buffer_release(dm_buffer *buffer)
    size_t dm_buffer_size(const dm_buffer *buffer)
    size_t dm_buffer_capacity(const dm_buffer *buffer)
    int dm_buffer_is_wrapped(const dm_buffer *buffer)
    void *dm_buffer_contents(dm_buffer *buffer)
    int dm_buffer_write(dm_buffer *buffer, size_t offset, const void *src, size_t nbytes)
    int dm_buffer_read(dm_buffer *buffer, size_t offset, void *dst, size_t nbytes)
    int dm_buffer_sync(dm_buffer *buffer)
    int dm_buffer_sync_write(dm_buffer *buffer)
    int dm_buffer_set_resident(dm_buffer *buffer)
    int dm_buffer_flush(dm_buffer *buffer, size_t offset, size_t nbytes)
    int dm_pipeline_get(dm_device *device, const char *name, dm_pipeline **out)
    uint32_t dm_pipeline_max_threads(const dm_pipeline *pipeline)
    uint32_t dm_pipeline_execution_width(const dm_pipeline *pipeline)
    uint32_t dm_pipeline_static_tg_memory(const dm_pipeline *pipeline)
    const char *dm_pipeline_name(const dm_pipeline *pipeline)
    int dm_dispatch(dm_device *device, dm_pipeline *pipeline, const dm_dispatch_desc *desc)
    int dm_dispatch_list_create(dm_device *device, int capacity, dm_dispatch_list **out)
    int dm_dispatch_list_add(dm_dispatch_list *list, dm_pipeline *pipeline,
                             const dm_dispatch_desc *desc)
    int dm_dispatch_list_encode(dm_device *device, dm_dispatch_list *list)
    int dm_dispatch_list_size(const dm_dispatch_list *list)
    void dm_dispatch_list_destroy(dm_dispatch_list *list)


cdef class Device:
    cdef dm_device *_ptr
    cdef readonly str kind
    cdef object __weakref__

    cdef int _check(self) except -1


cdef class Buffer:
    cdef dm_buffer *_ptr
    cdef readonly Device device
    cdef object _host  # the wrapped array, kept alive while the buffer exists

    cdef int _ok(self) except -1


cdef class DispatchList:
    cdef dm_dispatch_list *_ptr
    cdef readonly Device device
    cdef list _buffers  # every Buffer the dispatch list binds, kept alive while it exists
    cdef set _buffer_ids

    cdef int _ok(self) except -1
