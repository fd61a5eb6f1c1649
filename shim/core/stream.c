/* The command stream: encode into the open command buffer, commit, wait; and what a profile
 * notes of each dispatch encoded (profile.c reads it back). */
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "core.h"

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
    if ((uint64_t)device->n_in_flight > device->stats.peak_in_flight)
        device->stats.peak_in_flight = (uint64_t)device->n_in_flight;
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
    rc = dm_profile_note(device, &pipeline, &desc->tag, 1);
    if (rc == DM_OK && device->commit_every && device->open_dispatches >= device->commit_every)
        rc = dm_stream_commit(device);
    device->stats.encode_ns += dm_now_ns() - start;
    return rc;
}

int dm_profile_note(dm_device *device, dm_pipeline *const *pipelines, const uint64_t *tags,
                    int n) {
    if (!device->profiling || n <= 0) return DM_OK;
    size_t need = device->n_profile + (size_t)n;
    if (need > device->cap_profile) {
        size_t cap = device->cap_profile ? device->cap_profile : 256;
        while (cap < need) cap *= 2;
        dm_profile_record *records = realloc(device->profile, cap * sizeof *records);
        if (records == NULL) return dm_set_error(DM_ERR_RESOURCE, "out of memory profiling");
        device->profile = records;
        uint64_t *ns = realloc(device->profile_ns, cap * sizeof *ns);
        if (ns == NULL) return dm_set_error(DM_ERR_RESOURCE, "out of memory profiling");
        device->profile_ns = ns;
        device->cap_profile = cap;
    }
    for (int i = 0; i < n; i++) {
        dm_profile_record *r = &device->profile[device->n_profile++];
        r->kernel = pipelines[i]->name;
        r->tag = tags[i];
        r->device_ns = 0;
    }
    return DM_OK;
}
