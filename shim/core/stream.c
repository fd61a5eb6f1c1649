/* Pipeline cache and the command stream: encode, commit, wait. */
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "core.h"

static unsigned hash_name(const char *s) {
    unsigned h = 2166136261u; /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 16777619u;
    return h % DM_PIPELINE_BUCKETS;
}

int dm_pipeline_get(dm_device *device, const char *name, dm_pipeline **out) {
    if (device == NULL || name == NULL || out == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_pipeline_get: NULL argument");
    *out = NULL;
    if (name[0] == '\0') return dm_set_error(DM_ERR_INVALID, "empty kernel name");
    unsigned bucket = hash_name(name);
    for (dm_pipeline *p = device->pipelines[bucket]; p; p = p->next) {
        if (strcmp(p->name, name) == 0) {
            *out = p;
            return DM_OK;
        }
    }
    dm_pipeline *p = calloc(1, sizeof *p);
    char *copy = malloc(strlen(name) + 1);
    if (p == NULL || copy == NULL) {
        free(p);
        free(copy);
        return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
    }
    strcpy(copy, name);
    int rc = device->driver->pipeline_create(device->handle, name, &p->handle, &p->facts);
    if (rc != DM_OK) {
        free(p);
        free(copy);
        return rc;
    }
    if (p->facts.max_total_threads == 0) p->facts.max_total_threads = 1;
    p->device = device;
    p->name = copy;
    p->next = device->pipelines[bucket];
    device->pipelines[bucket] = p;
    device->stats.pipelines_built++;
    *out = p;
    return DM_OK;
}

void dm_pipelines_free(dm_device *device) {
    for (int i = 0; i < DM_PIPELINE_BUCKETS; i++) {
        dm_pipeline *p = device->pipelines[i];
        while (p) {
            dm_pipeline *next = p->next;
            device->driver->pipeline_free(device->handle, p->handle);
            free(p->name);
            free(p);
            p = next;
        }
        device->pipelines[i] = NULL;
    }
}

uint32_t dm_pipeline_max_threads(const dm_pipeline *p) { return p ? p->facts.max_total_threads : 0; }
uint32_t dm_pipeline_execution_width(const dm_pipeline *p) {
    return p ? p->facts.execution_width : 0;
}
uint32_t dm_pipeline_static_tg_memory(const dm_pipeline *p) {
    return p ? p->facts.static_tg_memory : 0;
}
const char *dm_pipeline_name(const dm_pipeline *p) { return p ? p->name : ""; }

/* Waits for the oldest in-flight command buffer and forgets it. */
static int wait_oldest(dm_device *device) {
    dm_in_flight f = device->in_flight[0];
    device->n_in_flight--;
    memmove(device->in_flight, device->in_flight + 1,
            (size_t)device->n_in_flight * sizeof device->in_flight[0]);
    int rc = device->driver->wait(device->handle, f.command);
    if (f.seq > device->completed_seq) device->completed_seq = f.seq;
    return rc;
}

int dm_stream_commit(dm_device *device) {
    if (device->open_command == NULL) return DM_OK;
    int rc = DM_OK;
    if (device->n_in_flight == DM_MAX_IN_FLIGHT) {
        /* Bounded queue: the driver's queue is bounded too. Counted as a wait. */
        device->stats.waits++;
        rc = wait_oldest(device);
    }
    void *command = device->open_command;
    uint64_t seq = device->open_seq;
    device->open_command = NULL;
    device->open_seq = 0;
    device->open_dispatches = 0;
    int crc = device->driver->commit(device->handle, command);
    if (crc != DM_OK) {
        /* A command buffer that failed to commit is complete as far as the stream goes. */
        device->driver->discard(device->handle, command);
        if (seq > device->completed_seq) device->completed_seq = seq;
        return crc;
    }
    device->in_flight[device->n_in_flight].command = command;
    device->in_flight[device->n_in_flight].seq = seq;
    device->n_in_flight++;
    device->stats.command_buffers_committed++;
    return rc;
}

int dm_stream_wait_for(dm_device *device, uint64_t seq) {
    int rc = DM_OK;
    if (device->open_command && device->open_seq <= seq) rc = dm_stream_commit(device);
    if (device->n_in_flight == 0 || device->in_flight[0].seq > seq) return rc;
    device->stats.waits++;
    /* Keep waiting after a failure so no command buffer is left behind; report the first. */
    char first_error[1024] = "";
    while (device->n_in_flight > 0 && device->in_flight[0].seq <= seq) {
        int w = wait_oldest(device);
        if (w != DM_OK && rc == DM_OK) {
            rc = w;
            strncpy(first_error, dm_last_error(), sizeof first_error - 1);
        }
    }
    if (rc != DM_OK && first_error[0]) dm_set_error(rc, "%s", first_error);
    return rc;
}

int dm_device_commit(dm_device *device) {
    if (device == NULL) return dm_set_error(DM_ERR_INVALID, "dm_device_commit: NULL device");
    return dm_stream_commit(device);
}

int dm_device_synchronize(dm_device *device) {
    if (device == NULL) return dm_set_error(DM_ERR_INVALID, "dm_device_synchronize: NULL device");
    uint64_t last = device->open_command ? device->open_seq : device->next_seq - 1;
    return dm_stream_wait_for(device, last);
}

int dm_stream_open(dm_device *device) {
    if (device->open_command != NULL) return DM_OK;
    int rc = device->driver->command_begin(device->handle, &device->open_command);
    if (rc != DM_OK) {
        device->open_command = NULL;
        return rc;
    }
    device->open_seq = device->next_seq++;
    device->open_dispatches = 0;
    return DM_OK;
}

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

int dm_dispatch(dm_device *device, dm_pipeline *pipeline, const dm_dispatch_desc *desc) {
    if (device == NULL || pipeline == NULL || desc == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_dispatch: NULL argument");
    if (pipeline->device != device)
        return dm_set_error(DM_ERR_INVALID, "kernel '%s': pipeline of another device",
                            pipeline->name);
    uint64_t start = dm_now_ns();
    dm_driver_dispatch d;
    int rc = dm_check_dispatch(device, pipeline, desc, &d);
    if (rc != DM_OK) return rc;
    rc = dm_stream_open(device);
    if (rc != DM_OK) return rc;
    rc = device->driver->encode(device->handle, device->open_command, pipeline->handle, &d);
    if (rc != DM_OK) return rc;
    for (int i = 0; i < desc->n_buffers; i++)
        if (desc->buffers[i]) desc->buffers[i]->last_use = device->open_seq;
    device->open_dispatches++;
    device->stats.kernels_dispatched++;
    if (device->commit_every && device->open_dispatches >= device->commit_every)
        rc = dm_stream_commit(device);
    device->stats.encode_ns += dm_now_ns() - start;
    return rc;
}
