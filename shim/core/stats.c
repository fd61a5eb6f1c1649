/* Device statistics: the counters callers read and reset, and the allocation accounting the
 * buffer pool reports into. */
#include "core.h"
#include "stats.h"

void dm_stats_account_alloc(dm_device *device, int64_t delta_bytes) {
    dm_stats *s = &device->stats;
    s->allocated_bytes = (uint64_t)((int64_t)s->allocated_bytes + delta_bytes);
    if (s->allocated_bytes > s->peak_allocated_bytes) s->peak_allocated_bytes = s->allocated_bytes;
}

int dm_device_get_stats(dm_device *device, dm_stats *out) {
    if (device == NULL || out == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_device_get_stats: NULL argument");
    *out = device->stats;
    if (device->driver->copy_counters) {
        uint64_t count = 0, bytes = 0;
        device->driver->copy_counters(device->handle, &count, &bytes);
        out->driver_copies = count - device->copies_base;
        out->driver_copy_bytes = bytes - device->copy_bytes_base;
    }
    return DM_OK;
}

int dm_device_reset_peak(dm_device *device) {
    if (device == NULL) return dm_set_error(DM_ERR_INVALID, "dm_device_reset_peak: NULL device");
    device->stats.peak_allocated_bytes = device->stats.allocated_bytes;
    return DM_OK;
}

/* Allocation figures describe memory still held, so they are not counters and stay. */
int dm_device_reset_counters(dm_device *device) {
    if (device == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_device_reset_counters: NULL device");
    dm_stats *s = &device->stats;
    s->kernels_dispatched = s->command_buffers_committed = s->waits = 0;
    s->bytes_uploaded = s->bytes_downloaded = s->pool_hits = s->pool_misses = 0;
    s->cpu_fallbacks = s->pipelines_built = s->encode_ns = 0;
    s->peak_in_flight = (uint64_t)device->n_in_flight;
    if (device->driver->copy_counters)
        device->driver->copy_counters(device->handle, &device->copies_base,
                                      &device->copy_bytes_base);
    return DM_OK;
}

int dm_device_count_fallback(dm_device *device, uint64_t n) {
    if (device == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_device_count_fallback: NULL device");
    device->stats.cpu_fallbacks += n;
    return DM_OK;
}
