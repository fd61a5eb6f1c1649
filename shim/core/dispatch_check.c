/* Dispatch validation. One set of checks for dm_dispatch and dm_dispatch_list_add, so that a
 * dispatch list refuses exactly what a direct dispatch refuses and never fails half encoded;
 * and on the host, where the caller can still be told which call was wrong, since a bad
 * dispatch on the GPU faults or runs with undefined results. */
#include <string.h>

#include "core.h"

int dm_check_dispatch(dm_device *device, dm_pipeline *p, const dm_dispatch_desc *d,
                      dm_driver_dispatch *out) {
    const char *k = p->name;
    if (d->mode != DM_DISPATCH_THREADS && d->mode != DM_DISPATCH_THREADGROUPS)
        return dm_set_error(DM_ERR_INVALID, "kernel '%s': unknown dispatch mode %d", k, d->mode);
    uint64_t group_threads = 1;
    for (int i = 0; i < 3; i++) {
        if (d->grid[i] == 0 || d->group[i] == 0)
            return dm_set_error(DM_ERR_INVALID,
                                "kernel '%s': grid (%u,%u,%u) and threadgroup (%u,%u,%u) need "
                                "every dimension >= 1",
                                k, d->grid[0], d->grid[1], d->grid[2], d->group[0], d->group[1],
                                d->group[2]);
        group_threads *= d->group[i];
    }
    if (group_threads > p->facts.max_total_threads)
        return dm_set_error(DM_ERR_INVALID,
                            "kernel '%s': threadgroup (%u,%u,%u) has %llu threads, more than the "
                            "pipeline's maxTotalThreadsPerThreadgroup %u",
                            k, d->group[0], d->group[1], d->group[2],
                            (unsigned long long)group_threads, p->facts.max_total_threads);
    if (d->args_size > DM_MAX_ARGS_BYTES)
        return dm_set_error(DM_ERR_INVALID, "kernel '%s': %zu argument bytes, more than %d", k,
                            d->args_size, DM_MAX_ARGS_BYTES);
    if (d->args_size > 0 && d->args == NULL)
        return dm_set_error(DM_ERR_INVALID, "kernel '%s': NULL argument bytes", k);
    if (d->n_buffers < 0 || d->first_buffer_index < 0 ||
        d->first_buffer_index + d->n_buffers > DM_MAX_BUFFER_INDEX)
        return dm_set_error(DM_ERR_INVALID,
                            "kernel '%s': buffers at indices %d..%d; valid indices are 0..%d", k,
                            d->first_buffer_index, d->first_buffer_index + d->n_buffers - 1,
                            DM_MAX_BUFFER_INDEX - 1);
    if (d->args_size > 0 && d->first_buffer_index == 0 && d->n_buffers > 0)
        return dm_set_error(DM_ERR_INVALID,
                            "kernel '%s': buffer index 0 holds the argument bytes; buffers must "
                            "start at index 1",
                            k);
    if (d->n_buffers > 0 && d->buffers == NULL)
        return dm_set_error(DM_ERR_INVALID, "kernel '%s': NULL buffer list", k);
    if (d->n_tg_memory < 0 || d->n_tg_memory > DM_MAX_TG_MEMORY_ARGS)
        return dm_set_error(DM_ERR_INVALID,
                            "kernel '%s': %d threadgroup memory lengths; at most %d", k,
                            d->n_tg_memory, DM_MAX_TG_MEMORY_ARGS);
    memset(out, 0, sizeof *out);
    uint64_t tg_total = p->facts.static_tg_memory;
    for (int i = 0; i < d->n_tg_memory; i++) {
        if (d->tg_memory[i] % 16 != 0)
            return dm_set_error(DM_ERR_INVALID,
                                "kernel '%s': threadgroup memory %d is %u bytes; Metal needs a "
                                "multiple of 16",
                                k, i, d->tg_memory[i]);
        tg_total += d->tg_memory[i];
        out->tg_memory[i] = d->tg_memory[i];
    }
    if (device->facts.max_threadgroup_memory && tg_total > device->facts.max_threadgroup_memory)
        return dm_set_error(DM_ERR_INVALID,
                            "kernel '%s': %llu bytes of threadgroup memory, more than the "
                            "device's %u",
                            k, (unsigned long long)tg_total, device->facts.max_threadgroup_memory);
    out->n_tg_memory = d->n_tg_memory;
    out->args = d->args;
    out->args_size = d->args_size;
    out->n_indices = d->args_size > 0 ? 1 : 0;
    for (int i = 0; i < d->n_buffers; i++) {
        int index = d->first_buffer_index + i;
        dm_buffer *b = d->buffers[i];
        if (b == NULL) continue;
        if (b->device != device)
            return dm_set_error(DM_ERR_INVALID,
                                "kernel '%s': buffer at index %d belongs to another device", k,
                                index);
        if (!b->live)
            return dm_set_error(DM_ERR_INVALID, "kernel '%s': buffer at index %d was released",
                                k, index);
        size_t offset = d->offsets ? d->offsets[i] : 0;
        if (offset >= b->size && !(offset == 0 && b->size == 0))
            return dm_set_error(DM_ERR_INVALID,
                                "kernel '%s': offset %zu at index %d is outside the buffer of "
                                "%zu bytes",
                                k, offset, index, b->size);
        out->buffers[index] = b->handle;
        out->offsets[index] = offset;
        if (index + 1 > out->n_indices) out->n_indices = index + 1;
    }
    for (int i = 0; i < 3; i++) {
        out->grid[i] = d->grid[i];
        out->group[i] = d->group[i];
    }
    out->mode = d->mode;
    if (device->driver->check) return device->driver->check(device->handle, p->handle, out);
    return DM_OK;
}
