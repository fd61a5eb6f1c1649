/* Buffers: size classes, the pool of released buffers, host reads and writes. */
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "stats.h"

#define DM_MIN_CLASS ((size_t)256)

static int highest_bit(size_t n) {
    int b = 0;
    while (n >>= 1) b++;
    return b;
}

/* Classes are m * 2^k with m in 4..7: at most 25% of a buffer is rounding. */
size_t dm_size_class(size_t nbytes) {
    if (nbytes <= DM_MIN_CLASS) return DM_MIN_CLASS;
    if (nbytes > (SIZE_MAX >> 2)) return 0;
    int b = highest_bit(nbytes);
    size_t step = (size_t)1 << (b - 2);
    return (nbytes + step - 1) / step * step;
}

int dm_size_class_index(size_t class_size) {
    if (class_size < DM_MIN_CLASS) return -1;
    int b = highest_bit(class_size);
    int k = b - 2;
    size_t m = class_size >> k;
    int index = (k - 6) * 4 + (int)(m - 4);
    return (index >= 0 && index < DM_POOL_CLASSES) ? index : -1;
}

static void link_buffer(dm_device *device, dm_buffer *b) {
    b->prev_all = NULL;
    b->next_all = device->all;
    if (device->all) device->all->prev_all = b;
    device->all = b;
}

static void unlink_and_free(dm_device *device, dm_buffer *b) {
    if (b->prev_all) b->prev_all->next_all = b->next_all;
    else device->all = b->next_all;
    if (b->next_all) b->next_all->prev_all = b->prev_all;
    device->driver->buffer_free(device->handle, b->handle);
    free(b);
}

static void free_pooled(dm_device *device) {
    for (int i = 0; i < DM_POOL_CLASSES; i++) {
        dm_buffer *b = device->pool[i];
        while (b) {
            dm_buffer *next = b->next_free;
            dm_stats_account_alloc(device, -(int64_t)b->capacity);
            device->stats.pooled_buffers--;
            device->stats.pooled_bytes -= b->capacity;
            unlink_and_free(device, b);
            b = next;
        }
        device->pool[i] = NULL;
    }
}

int dm_device_empty_cache(dm_device *device) {
    if (device == NULL) return dm_set_error(DM_ERR_INVALID, "dm_device_empty_cache: NULL device");
    uint64_t pending = 0;
    for (int i = 0; i < DM_POOL_CLASSES; i++)
        for (dm_buffer *b = device->pool[i]; b; b = b->next_free)
            if (b->last_use > pending) pending = b->last_use;
    if (pending > device->completed_seq) {
        int rc = dm_stream_wait_for(device, pending);
        if (rc != DM_OK) return rc;
    }
    free_pooled(device);
    return DM_OK;
}

void dm_buffers_free_all(dm_device *device) {
    free_pooled(device);
    while (device->all) unlink_and_free(device, device->all);
}

int dm_buffer_create(dm_device *device, size_t nbytes, dm_buffer **out) {
    if (device == NULL || out == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_buffer_create: NULL argument");
    *out = NULL;
    size_t capacity = dm_size_class(nbytes);
    int index = dm_size_class_index(capacity);
    if (capacity == 0 || index < 0)
        return dm_set_error(DM_ERR_INVALID, "buffer of %zu bytes is too large", nbytes);
    dm_stats *s = &device->stats;
    dm_buffer *b = device->pool[index];
    if (b != NULL) {
        device->pool[index] = b->next_free;
        b->next_free = NULL;
        s->pool_hits++;
        s->pooled_buffers--;
        s->pooled_bytes -= capacity;
    } else {
        b = calloc(1, sizeof *b);
        if (b == NULL) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
        int rc = device->driver->buffer_alloc(device->handle, capacity, &b->handle, &b->contents);
        if (rc != DM_OK && (s->pooled_buffers > 0)) {
            /* Memory held by the pool may be what is missing. */
            if (dm_device_empty_cache(device) == DM_OK)
                rc = device->driver->buffer_alloc(device->handle, capacity, &b->handle,
                                                  &b->contents);
        }
        if (rc != DM_OK) {
            free(b);
            return rc;
        }
        b->device = device;
        b->capacity = capacity;
        link_buffer(device, b);
        s->pool_misses++;
        dm_stats_account_alloc(device, (int64_t)capacity);
    }
    b->size = nbytes;
    b->live = 1;
    s->live_buffers++;
    s->live_bytes += capacity;
    *out = b;
    return DM_OK;
}

int dm_buffer_wrap(dm_device *device, void *host, size_t nbytes, dm_buffer **out) {
    if (device == NULL || out == NULL || host == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_buffer_wrap: NULL argument");
    *out = NULL;
    uint32_t page = device->facts.page_size ? device->facts.page_size : 4096;
    if (((uintptr_t)host % page) != 0)
        return dm_set_error(DM_ERR_INVALID,
                            "cannot wrap host memory at %p without a copy: it is not aligned "
                            "to the %u-byte page size",
                            host, page);
    if (nbytes == 0) return dm_set_error(DM_ERR_INVALID, "cannot wrap 0 bytes");
    if (device->driver->buffer_wrap == NULL)
        return dm_set_error(DM_ERR_UNSUPPORTED, "the %s driver cannot wrap host memory",
                            device->driver->name);
    dm_buffer *b = calloc(1, sizeof *b);
    if (b == NULL) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    int rc = device->driver->buffer_wrap(device->handle, host, nbytes, &b->handle);
    if (rc != DM_OK) {
        free(b);
        return rc;
    }
    b->device = device;
    b->contents = host;
    b->size = b->capacity = nbytes;
    b->wrapped = 1;
    b->live = 1;
    link_buffer(device, b);
    device->stats.live_buffers++;
    *out = b;
    return DM_OK;
}

void dm_buffer_release(dm_buffer *b) {
    if (b == NULL || !b->live) return;
    dm_device *device = b->device;
    b->live = 0;
    if (b->wrapped && b->last_use > device->completed_seq) {
        /* The host memory may be freed as soon as this returns: finish the work using it.
         * A failure here belongs to that work and is reported to whoever reads its results. */
        (void)dm_stream_wait_for(device, b->last_use);
    }
    /* A dispatch list still holds its handle: handing it out again would let the list write
     * into someone else's buffer. The list's destruction finishes the release. */
    if (b->dispatch_list_refs == 0) dm_buffer_finish_release(b);
}

void dm_buffer_finish_release(dm_buffer *b) {
    dm_device *device = b->device;
    dm_stats *s = &device->stats;
    s->live_buffers--;
    if (b->wrapped) {
        unlink_and_free(device, b);
        return;
    }
    /* Pending work may still use it; the next host write or read through the pool waits. */
    int index = dm_size_class_index(b->capacity);
    s->live_bytes -= b->capacity;
    b->next_free = device->pool[index];
    device->pool[index] = b;
    s->pooled_buffers++;
    s->pooled_bytes += b->capacity;
}

size_t dm_buffer_size(const dm_buffer *b) { return b ? b->size : 0; }
size_t dm_buffer_capacity(const dm_buffer *b) { return b ? b->capacity : 0; }
int dm_buffer_is_wrapped(const dm_buffer *b) { return b ? b->wrapped : 0; }
void *dm_buffer_contents(dm_buffer *b) { return b ? b->contents : NULL; }

static int check_range(const dm_buffer *b, size_t offset, size_t nbytes, const char *what) {
    if (b == NULL) return dm_set_error(DM_ERR_INVALID, "%s: NULL buffer", what);
    if (!b->live) return dm_set_error(DM_ERR_INVALID, "%s: the buffer was released", what);
    if (offset > b->size || nbytes > b->size - offset)
        return dm_set_error(DM_ERR_INVALID,
                            "%s: bytes [%zu, %zu) are outside the buffer of %zu bytes", what,
                            offset, offset + nbytes, b->size);
    return DM_OK;
}

/* The driver's part of a host read or write of the contents (after the core's wait). */
static int host_access(dm_buffer *b, int will_write) {
    const dm_driver *driver = b->device->driver;
    if (driver->host_access == NULL) return DM_OK;
    return driver->host_access(b->device->handle, b->handle, will_write);
}

/* Waits for the work that uses the buffer, then the driver's host_access. */
static int sync_for_host(dm_buffer *b, int will_write, const char *what) {
    int rc = check_range(b, 0, 0, what);
    if (rc != DM_OK) return rc;
    if (b->last_use > b->device->completed_seq) {
        rc = dm_stream_wait_for(b->device, b->last_use);
        if (rc != DM_OK) return rc;
    }
    return host_access(b, will_write);
}

int dm_buffer_sync(dm_buffer *b) { return sync_for_host(b, 0, "dm_buffer_sync"); }

int dm_buffer_sync_write(dm_buffer *b) { return sync_for_host(b, 1, "dm_buffer_sync_write"); }

int dm_buffer_set_resident(dm_buffer *b) {
    int rc = check_range(b, 0, 0, "dm_buffer_set_resident");
    if (rc != DM_OK) return rc;
    if (!b->wrapped)
        return dm_set_error(DM_ERR_INVALID,
                            "dm_buffer_set_resident: the buffer does not wrap host memory");
    const dm_driver *driver = b->device->driver;
    return driver->set_resident ? driver->set_resident(b->device->handle, b->handle) : DM_OK;
}

int dm_buffer_flush(dm_buffer *b, size_t offset, size_t nbytes) {
    int rc = check_range(b, offset, nbytes, "dm_buffer_flush");
    if (rc != DM_OK) return rc;
    if (!b->wrapped)
        return dm_set_error(DM_ERR_INVALID, "dm_buffer_flush: the buffer does not wrap host memory");
    if (b->last_use > b->device->completed_seq) {
        rc = dm_stream_wait_for(b->device, b->last_use);
        if (rc != DM_OK) return rc;
    }
    const dm_driver *driver = b->device->driver;
    /* The driver's own copy: counted with its copies (driver_copy_bytes), as the uploads of
     * wrapped memory at a commit are, not as a dm_buffer_write. */
    if (driver->buffer_flush == NULL || nbytes == 0) return DM_OK;
    return driver->buffer_flush(b->device->handle, b->handle, offset, nbytes);
}

int dm_buffer_write(dm_buffer *b, size_t offset, const void *src, size_t nbytes) {
    int rc = check_range(b, offset, nbytes, "dm_buffer_write");
    if (rc != DM_OK) return rc;
    if (nbytes && src == NULL) return dm_set_error(DM_ERR_INVALID, "dm_buffer_write: NULL source");
    /* Overwriting what queued kernels still read would change their results. */
    if (b->last_use > b->device->completed_seq) {
        rc = dm_stream_wait_for(b->device, b->last_use);
        if (rc != DM_OK) return rc;
    }
    const dm_driver *driver = b->device->driver;
    if (driver->buffer_write && !b->wrapped) {
        if (nbytes) rc = driver->buffer_write(b->device->handle, b->handle, offset, src, nbytes);
        if (rc != DM_OK) return rc;
    } else {
        rc = host_access(b, 1);
        if (rc != DM_OK) return rc;
        if (nbytes) memcpy((char *)b->contents + offset, src, nbytes);
    }
    b->device->stats.bytes_uploaded += nbytes;
    return DM_OK;
}

int dm_buffer_read(dm_buffer *b, size_t offset, void *dst, size_t nbytes) {
    int rc = check_range(b, offset, nbytes, "dm_buffer_read");
    if (rc != DM_OK) return rc;
    if (nbytes && dst == NULL) return dm_set_error(DM_ERR_INVALID, "dm_buffer_read: NULL target");
    if (b->last_use > b->device->completed_seq) {
        rc = dm_stream_wait_for(b->device, b->last_use);
        if (rc != DM_OK) return rc;
    }
    const dm_driver *driver = b->device->driver;
    if (driver->buffer_read && !b->wrapped) {
        if (nbytes) rc = driver->buffer_read(b->device->handle, b->handle, offset, dst, nbytes);
        if (rc != DM_OK) return rc;
    } else {
        rc = host_access(b, 0);
        if (rc != DM_OK) return rc;
        if (nbytes) memcpy(dst, (const char *)b->contents + offset, nbytes);
    }
    b->device->stats.bytes_downloaded += nbytes;
    return DM_OK;
}
