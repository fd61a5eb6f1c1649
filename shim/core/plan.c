/* Prepared dispatch lists: checked and copied once, encoded together many times. */
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "core.h"

struct dm_plan {
    dm_device *device; /* NULL once the device was destroyed */
    dm_plan *prev, *next;

    dm_driver_item *items;
    dm_pipeline **pipelines; /* per item, for messages */
    void **args;             /* per item: owned copy of the argument bytes (or NULL) */
    int *ref_end;            /* per item: end of its buffers in `refs` */
    int n, cap;

    dm_buffer **refs; /* buffers bound by each item, item after item */
    int n_refs, cap_refs;

    dm_buffer **held; /* distinct buffers, each counted once in its plan_refs */
    int n_held, cap_held;
};

static int grow(void **array, int *cap, int need, size_t item) {
    if (need <= *cap) return DM_OK;
    int next = *cap > 0 ? *cap : 16;
    while (next < need) next *= 2;
    void *p = realloc(*array, (size_t)next * item);
    if (p == NULL) return dm_set_error(DM_ERR_RESOURCE, "out of host memory growing a plan");
    *array = p;
    *cap = next;
    return DM_OK;
}

static int grow_items(dm_plan *plan, int need) {
    if (need <= plan->cap) return DM_OK;
    int cap = plan->cap > 0 ? plan->cap : 16;
    while (cap < need) cap *= 2;
    /* Arrays already grown stay grown if a later one fails: harmless, cap is unchanged. */
    void *p = realloc(plan->items, (size_t)cap * sizeof *plan->items);
    if (p == NULL) goto fail;
    plan->items = p;
    p = realloc(plan->pipelines, (size_t)cap * sizeof *plan->pipelines);
    if (p == NULL) goto fail;
    plan->pipelines = p;
    p = realloc(plan->args, (size_t)cap * sizeof *plan->args);
    if (p == NULL) goto fail;
    plan->args = p;
    p = realloc(plan->ref_end, (size_t)cap * sizeof *plan->ref_end);
    if (p == NULL) goto fail;
    plan->ref_end = p;
    plan->cap = cap;
    return DM_OK;
fail:
    return dm_set_error(DM_ERR_RESOURCE, "out of host memory growing a plan");
}

int dm_plan_create(dm_device *device, int capacity, dm_plan **out) {
    if (device == NULL || out == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_plan_create: NULL argument");
    *out = NULL;
    if (capacity < 0)
        return dm_set_error(DM_ERR_INVALID, "dm_plan_create: negative capacity %d", capacity);
    dm_plan *plan = calloc(1, sizeof *plan);
    if (plan == NULL) return dm_set_error(DM_ERR_RESOURCE, "out of host memory creating a plan");
    if (capacity > 0 && grow_items(plan, capacity) != DM_OK) {
        dm_plan_destroy(plan);
        return DM_ERR_RESOURCE;
    }
    plan->device = device;
    plan->next = device->plans;
    if (device->plans) device->plans->prev = plan;
    device->plans = plan;
    *out = plan;
    return DM_OK;
}

int dm_plan_size(const dm_plan *plan) { return plan ? plan->n : 0; }

/* Holds `b` for the plan (once per distinct buffer). */
static int hold(dm_plan *plan, dm_buffer *b) {
    for (int i = 0; i < plan->n_held; i++)
        if (plan->held[i] == b) return DM_OK;
    int rc = grow((void **)&plan->held, &plan->cap_held, plan->n_held + 1, sizeof *plan->held);
    if (rc != DM_OK) return rc;
    plan->held[plan->n_held++] = b;
    b->plan_refs++;
    return DM_OK;
}

int dm_plan_add(dm_plan *plan, dm_pipeline *pipeline, const dm_dispatch_desc *desc) {
    if (plan == NULL || pipeline == NULL || desc == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_plan_add: NULL argument");
    dm_device *device = plan->device;
    if (device == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_plan_add: the plan's device was destroyed");
    if (pipeline->device != device)
        return dm_set_error(DM_ERR_INVALID, "kernel '%s': pipeline of another device",
                            pipeline->name);
    dm_driver_dispatch d;
    int rc = dm_check_dispatch(device, pipeline, desc, &d);
    if (rc != DM_OK) return rc;
    rc = grow_items(plan, plan->n + 1);
    if (rc != DM_OK) return rc;
    rc = grow((void **)&plan->refs, &plan->cap_refs, plan->n_refs + desc->n_buffers,
              sizeof *plan->refs);
    if (rc != DM_OK) return rc;
    void *args = NULL;
    if (d.args_size > 0) {
        args = malloc(d.args_size);
        if (args == NULL) return dm_set_error(DM_ERR_RESOURCE, "out of host memory");
        memcpy(args, d.args, d.args_size);
        d.args = args;
    }
    /* Hold every buffer before publishing the item; on failure undo what this call held. */
    int held_before = plan->n_held;
    int n_refs = plan->n_refs;
    for (int i = 0; i < desc->n_buffers; i++) {
        dm_buffer *b = desc->buffers[i];
        if (b == NULL) continue;
        rc = hold(plan, b);
        if (rc != DM_OK) {
            while (plan->n_held > held_before) plan->held[--plan->n_held]->plan_refs--;
            free(args);
            return rc;
        }
        plan->refs[n_refs++] = b;
    }
    plan->n_refs = n_refs;
    plan->items[plan->n].pipeline = pipeline->handle;
    plan->items[plan->n].dispatch = d;
    plan->pipelines[plan->n] = pipeline;
    plan->args[plan->n] = args;
    plan->ref_end[plan->n] = n_refs;
    plan->n++;
    return DM_OK;
}

/* The first item binding `b`, for the message of a failed encode. */
static int first_use(const dm_plan *plan, const dm_buffer *b) {
    int item = 0;
    for (int r = 0; r < plan->n_refs; r++) {
        while (plan->ref_end[item] <= r) item++;
        if (plan->refs[r] == b) return item;
    }
    return 0;
}

static int encode_items(dm_device *device, dm_plan *plan, int first, int n, int *n_done) {
    const dm_driver *driver = device->driver;
    if (driver->encode_batch)
        return driver->encode_batch(device->handle, device->open_command, plan->items + first, n,
                                    n_done);
    for (int i = 0; i < n; i++) {
        const dm_driver_item *item = &plan->items[first + i];
        int rc = driver->encode(device->handle, device->open_command, item->pipeline,
                                &item->dispatch);
        if (rc != DM_OK) {
            *n_done = i;
            return rc;
        }
    }
    *n_done = n;
    return DM_OK;
}

int dm_plan_encode(dm_device *device, dm_plan *plan) {
    if (device == NULL || plan == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_plan_encode: NULL argument");
    if (plan->device == NULL)
        return dm_set_error(DM_ERR_INVALID, "dm_plan_encode: the plan's device was destroyed");
    if (plan->device != device)
        return dm_set_error(DM_ERR_INVALID, "dm_plan_encode: the plan belongs to another device");
    /* Refuse before encoding anything, so a stale plan leaves the command buffer as it was. */
    for (int i = 0; i < plan->n_held; i++) {
        dm_buffer *b = plan->held[i];
        if (!b->live) {
            int item = first_use(plan, b);
            return dm_set_error(DM_ERR_INVALID,
                                "plan of %d dispatches: a buffer of dispatch %d (kernel '%s') "
                                "was released",
                                plan->n, item + 1, plan->pipelines[item]->name);
        }
    }
    uint64_t start = dm_now_ns();
    int rc = DM_OK;
    int i = 0;
    while (i < plan->n && rc == DM_OK) {
        rc = dm_stream_open(device);
        if (rc != DM_OK) break;
        int chunk = plan->n - i;
        if (device->commit_every) {
            /* Split where n separate dispatches would have committed. */
            uint32_t room = device->commit_every > device->open_dispatches
                                ? device->commit_every - device->open_dispatches
                                : 1;
            if ((uint32_t)chunk > room) chunk = (int)room;
        }
        int done = 0;
        rc = encode_items(device, plan, i, chunk, &done);
        int r0 = i > 0 ? plan->ref_end[i - 1] : 0;
        int r1 = done > 0 ? plan->ref_end[i + done - 1] : r0;
        for (int r = r0; r < r1; r++) plan->refs[r]->last_use = device->open_seq;
        device->open_dispatches += (uint32_t)done;
        device->stats.kernels_dispatched += (uint64_t)done;
        i += done;
        if (rc == DM_OK && device->commit_every &&
            device->open_dispatches >= device->commit_every)
            rc = dm_stream_commit(device);
    }
    device->stats.encode_ns += dm_now_ns() - start;
    return rc;
}

void dm_plan_destroy(dm_plan *plan) {
    if (plan == NULL) return;
    dm_device *device = plan->device;
    if (device != NULL) {
        if (plan->prev) plan->prev->next = plan->next;
        else device->plans = plan->next;
        if (plan->next) plan->next->prev = plan->prev;
        for (int i = 0; i < plan->n_held; i++) {
            dm_buffer *b = plan->held[i];
            if (--b->plan_refs == 0 && !b->live) dm_buffer_finish_release(b);
        }
    }
    for (int i = 0; i < plan->n; i++) free(plan->args[i]);
    free(plan->items);
    free(plan->pipelines);
    free(plan->args);
    free(plan->ref_end);
    free(plan->refs);
    free(plan->held);
    free(plan);
}

void dm_plans_detach(dm_device *device) {
    for (dm_plan *p = device->plans; p; p = p->next) p->device = NULL;
    device->plans = NULL;
}
